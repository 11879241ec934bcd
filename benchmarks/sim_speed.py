"""How fast the simulator runs: N requests of the shared Azure code trace through ``simulate``
(target: 10,000 requests in < 60 s). The trace has 8,819 rows; past its end it repeats, each
repetition arriving after the previous one (so the request rate stays the trace's).

Prints requests simulated per wall second and a JSON line.

Usage: python benchmarks/sim_speed.py [--num-requests 10000] [--cost-model profile.json]
                                      [--time-scale 1.0] [engine flags, e.g. --num-gpu-blocks 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.entrypoints.cli import add_engine_args, engine_args_from
from kvserve.envs import shared_dir
from kvserve.sim.cli import _cost_model_for, simulate
from kvserve.workload import workload as wl


def tiled(records: list[wl.TraceRecord], n: int) -> list[wl.TraceRecord]:
    """``n`` records: the trace, then again shifted by its span (plus one mean gap), ..."""
    span = records[-1].arrival_s or 0.0
    gap = span / max(len(records) - 1, 1)
    out: list[wl.TraceRecord] = []
    k = 0
    while len(out) < n:
        for r in records:
            if len(out) >= n:
                break
            out.append(wl.TraceRecord((r.arrival_s or 0.0) + k * (span + gap), r.input_len, r.output_len))
        k += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace", default=str(shared_dir() / "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv")
    )
    ap.add_argument("--num-requests", type=int, default=10000)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--cost-model", default=None)
    add_engine_args(ap)
    ap.set_defaults(num_gpu_blocks=None, max_model_len=8192)
    ns = ap.parse_args()
    cost_model = _cost_model_for(ns)
    try:
        trace = wl.load_trace(ns.trace)
    except ValueError as e:
        print(f"error: --trace {e} (or set $KVSERVE_SHARED_DIR to the shared folder)", file=sys.stderr)
        return 2
    records = wl.scale_arrivals(tiled(trace, ns.num_requests), ns.time_scale)
    corpus = [3 + (i * 7919) % 49000 for i in range(1 << 16)]
    requests, _ = wl.trace_to_requests(records, corpus, ns.max_model_len)
    t0 = time.perf_counter()
    s = simulate(engine_args_from(ns), requests, cost_model=cost_model)
    wall = time.perf_counter() - t0
    print(f"cost model: {cost_model.describe()}")
    print(
        f"{len(requests)} requests ({s['finished']} finished, {s['num_steps']} steps, {s['num_preemptions']} "
        f"preemptions, {s['duration_s']:.0f} virtual s) simulated in {wall:.1f} s: {len(requests) / wall:.0f} req/s, "
        f"{s['num_steps'] / wall:.0f} steps/s"
    )
    print(
        json.dumps(
            {
                "num_requests": len(requests),
                "wall_s": wall,
                "requests_per_s": len(requests) / wall,
                "steps_per_s": s["num_steps"] / wall,
                "virtual_s": s["duration_s"],
                "num_steps": s["num_steps"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
