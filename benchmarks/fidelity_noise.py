"""The host's noise floor for ``kvserve bench fidelity``: two real runs of the same cell.

Prints the relative difference ``(B - A) / A`` of the real side's target metrics (TTFT, TPOT,
e2e p50 / p90; then every latency statistic, preemptions, throughput), the runs' durations and
step counts, and how many of the same requests each preempted. A simulator cannot be held
closer to a real run than two real runs are to each other: on a host whose speed drifts, a
queueing workload amplifies a few percent of step time into tens of percent of TTFT.
``benchmarks/fidelity.sh`` with ``REPEAT_REAL=1`` runs every cell twice and writes this report
as ``<cell>_noise.txt``.

Usage: python benchmarks/fidelity_noise.py A.json B.json [--json-out R.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvserve.benchmarks.fidelity import LATENCY_KEYS, STAT_KEYS, real_vs_real
from kvserve.workload.io import write_json


def _pct(v) -> str:
    return f"{v:+8.1%}" if v is not None else f"{'-':>8}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="first real run (--json-out of bench fidelity)")
    ap.add_argument("b", help="second real run of the same cell")
    ap.add_argument("--json-out", default=None)
    ns = ap.parse_args(argv)
    try:
        a, b = (json.loads(Path(p).read_text()) for p in (ns.a, ns.b))
        rep = real_vs_real(a, b)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    ta, tb = (r.get("system", {}).get("time", "?") for r in (a, b))
    print(f"A: {ns.a} ({ta})\nB: {ns.b} ({tb})")
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
            f"duration: {da:.1f} s vs {db:.1f} s ({(db - da) / da:+.1%}); steps {rep['num_steps'][0]} vs {rep['num_steps'][1]}"
        )
    pa = rep["preempted_requests"]
    if pa is not None:
        print(
            f"preempted requests: A {pa['real']}, B {pa['simulated']}, both {pa['both']} (Jaccard {pa['jaccard']:.2f})"
        )
    if ns.json_out:
        write_json(ns.json_out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
