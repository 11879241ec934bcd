"""Markdown tables of ``kvserve bench fidelity`` results (for docs/benchmarks.md).

One row per result file: the target metrics (TTFT and TPOT p50 / p90, e2e p50) real and
simulated with the relative error, preemptions and how many of the same requests were preempted;
a cell over the 10% target is marked with "!" (preemptions too: counts more than 10% apart,
``preemption_miss``). Files with an oracle replay (runs with
``--steps-out``) add its largest target error and how many steps took another shape. A cell
with a noise report beside it (``<cell>_noise.json``, ``fidelity.sh`` with ``REPEAT_REAL=1``)
adds the host's noise floor: the largest target difference between its two real runs.

Usage: python benchmarks/fidelity_report.py R1.json [R2.json ...]   (label = file name)

A file of another shape (a profile, a step-record file, any other JSON) is a one-line error
naming it and the shape expected (exit status 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CELLS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"), ("e2e_s", "p50"))
TARGET = 0.10


def _cell(res: dict, key: str, q: str) -> str:
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
    ``benchmarks/fidelity_noise.py``), or None when there is none."""
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
        raise ValueError(f"{f}: expected a fidelity_noise.py report (max_abs_target a number), got {v!r}")
    return v


#: what a result file must hold (a ``kvserve bench fidelity --json-out``)
EXPECTED = (
    "a `kvserve bench fidelity --json-out` result (an object with real, simulated, relative_error, "
    "preempted_requests)"
)


def _shape_error(path: str, data) -> str | None:
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


def load_result(path: str) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        text = table(args)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print("cells: real / simulated seconds (relative error; ! = over 10%)\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
