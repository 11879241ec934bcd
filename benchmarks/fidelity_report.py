"""Markdown tables of ``kvserve bench fidelity`` results (for docs/benchmarks.md).

One row per result file: the target metrics (TTFT and TPOT p50 / p90, e2e p50) real and
simulated with the relative error, preemptions and how many of the same requests were preempted;
a cell over the 10% target is marked with "!". Files with an oracle replay (runs with
``--steps-out``) add its largest target error and how many steps took another shape. A cell
with a noise report beside it (``<cell>_noise.json``, ``fidelity.sh`` with ``REPEAT_REAL=1``)
adds the host's noise floor: the largest target difference between its two real runs.

Usage: python benchmarks/fidelity_report.py R1.json [R2.json ...]   (label = file name)
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


def noise_floor(path: str) -> float | None:
    """The largest real-vs-real target difference of ``path``'s cell (its ``_noise.json``,
    ``benchmarks/fidelity_noise.py``), or None when there is none."""
    p = Path(path)
    f = p.with_name(p.stem + "_noise.json")
    if not f.is_file():
        return None
    return json.loads(f.read_text()).get("max_abs_target")


def table(paths: list[str]) -> str:
    results = [json.loads(Path(p).read_text()) for p in paths]
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
        row.append(f"{res['real']['num_preemptions']} / {res['simulated']['num_preemptions']}")
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
    print("cells: real / simulated seconds (relative error; ! = over 10%)\n")
    print(table(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
