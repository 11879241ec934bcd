"""Markdown tables of ``kvserve bench fidelity`` results, and the host's noise floor.

``kvserve bench fidelity-report R1.json [R2.json ...]``: one row per result file (label = file
name): the target metrics (TTFT and TPOT p50 / p90, e2e p50) real and simulated with the relative
error, preemptions and how many of the same requests were preempted; a cell over the 10% target
is marked with "!" (preemptions too: counts more than 10% apart, ``preemption_miss``). Files with
an oracle replay (runs with ``--steps-out``) add its largest target error and how many steps took
another shape. A cell with a noise report beside it (``<cell>_noise.json``) adds the host's noise
floor: the largest target difference between its two real runs.

``kvserve bench fidelity-report --noise A.json B.json [--json-out R.json]``: two real runs of the
same cell set against each other: the relative difference ``(B - A) / A`` of the target metrics,
then every latency statistic, preemptions and throughput, the runs' durations and step counts, and
how many of the same requests each preempted. A simulator cannot be held closer to a real run than
two real runs are to each other: on a host whose speed drifts, a queueing workload amplifies a few
percent of step time into tens of percent of TTFT. ``benchmarks/fidelity.sh`` with
``REPEAT_REAL=1`` runs every cell twice and writes this report as ``<cell>_noise.json``.

A file of another shape (a profile, a step-record file, any other JSON) is a one-line error
naming it and the shape expected (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.benchmarks.fidelity import LATENCY_KEYS, STAT_KEYS, real_vs_real
from kvserve.workload.io import write_json

CELLS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"), ("e2e_s", "p50"))
TARGET = 0.10


def _cell(res: dict[str, Any], key: str, q: str) -> str:
    r, s, e = res["real"][key][q], res["simulated"][key][q], res["relative_error"][key][q]
    if r is None or s is None:
        return "-"
    mark = "" if e is not None and abs(e) <= TARGET else " !"
    err = f"{e:+.0%}" if e is not None else "-"
    return f"{r:.3g} / {s:.3g} ({err}{mark})"


def preemption_miss(real: float, simulated: float) -> bool:
    """Whether the preemption counts miss the target: more than 10% apart, relative to the
    real count (any simulated preemption is a miss when the real run had none)."""
    if real == 0:
        return simulated != 0
    return abs(simulated - real) / real > TARGET


def noise_floor(path: str) -> float | None:
    """The largest real-vs-real target difference of ``path``'s cell (its ``_noise.json``,
    ``--noise``), or None when there is none."""
    p = Path(path)
    f = p.with_name(p.stem + "_noise.json")
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a JSON noise report ({e})") from None
    v = data.get("max_abs_target") if isinstance(data, dict) else "?"
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ValueError(
            f"{f}: expected a `fidelity-report --noise` report (max_abs_target a number), got {v!r}"
        )
    return v


#: what a result file must hold (a ``kvserve bench fidelity --json-out``)
EXPECTED = (
    "a `kvserve bench fidelity --json-out` result (an object with real, simulated, relative_error, "
    "preempted_requests)"
)


def _shape_error(path: str, data: Any) -> str | None:
    """Why ``data`` (the JSON of ``path``) is not a fidelity result, or None when it is one."""
    if not isinstance(data, dict):
        return f"{path}: expected {EXPECTED}, got a JSON {type(data).__name__}"
    if data.get("schema") == "kvserve-cost-model":
        return f"{path}: a cost-model profile (`kvserve profile`), expected {EXPECTED}"
    if data.get("schema") == "kvserve-steps":
        return f"{path}: a step-record file (--steps-out), expected {EXPECTED}"
    missing = [k for k in ("real", "simulated", "relative_error", "preempted_requests") if k not in data]
    if missing:
        return f"{path}: expected {EXPECTED}; it lacks {', '.join(missing)}"
    for side in ("real", "simulated", "relative_error"):
        for k, q in CELLS:
            obj = data[side].get(k) if isinstance(data[side], dict) else None
            v = obj.get(q) if isinstance(obj, dict) else "?"
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"{path}: expected {EXPECTED}; {side}.{k}.{q} is not a number"
        if side != "relative_error":
            v = data[side].get("num_preemptions")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"{path}: expected {EXPECTED}; {side}.num_preemptions is not a number"
    pre = data["preempted_requests"]
    if not isinstance(pre, dict) or "real" not in pre or "simulated" not in pre:
        return f"{path}: expected {EXPECTED}; preempted_requests lacks real / simulated"
    o = data.get("oracle")
    if o is not None and (
        not isinstance(o, dict)
        or not isinstance(o.get("relative_error"), dict)
        or not isinstance(o.get("steps"), dict)
        or any(not isinstance(o["relative_error"].get(k), dict) for k, _ in CELLS)
        or not {"num_diverged", "real_steps"} <= set(o["steps"])
    ):
        return f"{path}: expected {EXPECTED}; its oracle lacks relative_error / steps"
    return None


def load_result(path: str) -> dict[str, Any]:
    """A fidelity result file.

    Raises:
        ValueError: unreadable, not JSON, or another shape (saying which shape was expected).
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}); expected {EXPECTED}") from None
    why = _shape_error(path, data)
    if why:
        raise ValueError(why)
    return data


def table(paths: list[str]) -> str:
    """The markdown table of ``paths``' results.

    Raises:
        ValueError: a file that is not a fidelity result, or a malformed noise report.
    """
    results = [load_result(p) for p in paths]
    oracle = any("oracle" in r for r in results)
    noise = [noise_floor(p) for p in paths]
    head = ["run"] + [f"{k[:-2].upper()} {q}" for k, q in CELLS] + ["preemptions", "same preempted"]
    if oracle:
        head.append("oracle: largest error, steps diverged")
    if any(n is not None for n in noise):
        head.append("noise: real vs real, largest")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, res, n in zip(paths, results, noise):
        pre = res["preempted_requests"]
        row = [Path(p).stem] + [_cell(res, k, q) for k, q in CELLS]
        rp, sp = res["real"]["num_preemptions"], res["simulated"]["num_preemptions"]
        row.append(f"{rp} / {sp}" + (" !" if preemption_miss(rp, sp) else ""))
        jac = f"{pre['jaccard']:.2f}" if pre.get("jaccard") is not None else "-"
        row.append(
            f"{pre.get('both') if pre.get('both') is not None else '-'} of {pre['real']} / {pre['simulated']} (Jaccard {jac})"
        )
        if oracle:
            o = res.get("oracle")
            if o is None:
                row.append("-")
            else:
                errs = [abs(e) for k, q in CELLS if (e := o["relative_error"][k][q]) is not None]
                st = o["steps"]
                row.append(f"{max(errs, default=0.0):.2%}, {st['num_diverged']} of {st['real_steps']}")
        if any(n is not None for n in noise):
            row.append(f"{n:.0%}" if n is not None else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return f"{v:+8.1%}" if v is not None else f"{'-':>8}"


def noise_report(path_a: str, path_b: str, json_out: str | None = None) -> int:
    """Print (and with ``json_out`` write) the real-vs-real report of two runs of one cell;
    returns the exit status (2: a file unreadable or not a fidelity result)."""
    try:
        a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
        rep = real_vs_real(a, b)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    ta, tb = (r.get("system", {}).get("time", "?") for r in (a, b))
    print(f"A: {path_a} ({ta})\nB: {path_b} ({tb})")
    print(f"{'target':12}{'A':>10}{'B':>10}{'(B-A)/A':>9}")
    for key, d in rep["targets"].items():
        k, q = key.split()
        print(f"{key:12}{a['real'][k][q]:10.4f}{b['real'][k][q]:10.4f}{_pct(d)}")
    m = rep["max_abs_target"]
    print(f"largest target difference: {m:.1%}" if m is not None else "largest target difference: -")
    print("all statistics (B-A)/A:")
    diff = rep["relative_difference"]
    for k in LATENCY_KEYS:
        print(f"  {k:8}" + "".join(f" {q} {_pct(diff[k][q])}" for q in STAT_KEYS))
    print(f"  num_preemptions {_pct(diff['num_preemptions'])}  output_tok_s {_pct(diff['output_tok_s'])}")
    da, db = rep["duration_s"]
    if da and db:
        print(
            f"duration: {da:.1f} s vs {db:.1f} s ({(db - da) / da:+.1%}); "
            f"steps {rep['num_steps'][0]} vs {rep['num_steps'][1]}"
        )
    pa = rep["preempted_requests"]
    if pa is not None:
        print(
            f"preempted requests: A {pa['real']}, B {pa['simulated']}, both {pa['both']} (Jaccard {pa['jaccard']:.2f})"
        )
    if json_out:
        write_json(json_out, rep)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvserve bench fidelity-report``; returns the exit status (2: a bad file)."""
    ap = argparse.ArgumentParser(
        prog="kvserve bench fidelity-report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("results", nargs="+", help="--json-out files of `kvserve bench fidelity`")
    ap.add_argument("--noise", action="store_true", help="two real runs of one cell: A.json B.json")
    ap.add_argument("--json-out", default=None, help="--noise: write the report here")
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.noise:
        if len(ns.results) != 2:
            print("Error: --noise takes exactly two result files (A.json B.json)", file=sys.stderr)
            return 2
        return noise_report(ns.results[0], ns.results[1], ns.json_out)
    try:
        text = table(ns.results)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print("cells: real / simulated seconds (relative error; ! = over 10%)\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
