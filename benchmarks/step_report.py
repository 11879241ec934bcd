"""Predicted vs measured step time of a recorded replay (``kvserve bench fidelity --steps-out``).

Sets every recorded real step against a cost model (a ``kvserve profile`` file; default: the
profile the run used is not stored, so name it) by shape class, step size and both, with the
summed signed error against the step's own wall time and against the whole loop iteration, the
time outside the executor (scheduling, output processing), outside the step (the replay loop)
and in GC; then the cost model's terms refitted to the replay's own steps beside the profile's.

Usage: python benchmarks/step_report.py STEPS.json --cost-model PROFILE.json [--json-out R.json]
"""

from __future__ import annotations

import argparse
import sys

from kvserve.sim.step_record import (
    compare_steps,
    load_replay,
    print_comparison,
    print_refit,
    refit_steps,
)
from kvserve.workload.io import write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", help="the --steps-out file of a fidelity run")
    ap.add_argument("--cost-model", required=True, help="profile JSON (kvserve profile)")
    ap.add_argument("--json-out", default=None)
    ns = ap.parse_args(argv)
    try:
        records, meta, cm_file = load_replay(ns.steps, ns.cost_model)
        cm = cm_file.cost_model
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    rep = compare_steps(records, cm)
    trace = meta.get("trace")
    where = trace.get("path", "?") if isinstance(trace, dict) else "?"
    print(f"{len(records)} steps of {where}; cost model {cm.describe()}")
    print_comparison(rep)
    refit = refit_steps(records, cm)
    if refit is not None:
        print("cost model refitted to the replay's own steps (a coefficient far from the profile's")
        print("names the cost the profile does not see):")
        print_refit(refit)
        rep["refit"] = refit
    if ns.json_out:
        write_json(ns.json_out, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
