"""Adapter-slot occupancy of ``kvserve bench lora``'s workload, on the simulator.

The same requests as the real benchmark (w64 by default, all at once, adapters round-robin over
``--adapters``, greedy, fixed output lengths) and the CPU engine's scheduler settings (chunked
prefill, 2,048-token steps, 256 sequences, a 1 GiB float32 KV cache of the default model:
1,456 blocks of 16), on the simulator's virtual clock: the counts printed do not depend on how
loaded the machine is. Per run: steps, mean scheduled groups per step, slot-steps by how many
groups the adapter runs in that step (``1`` = a lone straggler holds the slot; ``free`` = a slot
no adapter holds), slot turnover preemptions, the simulator's output tok/s (its built-in cost
model, a GPU's: read the steps, not the seconds), TTFT mean / p99 and the longest e2e latency.

``bound`` is the least number of decode steps any scheduler can take under the slot rule: an
adapter is in every step that decodes one of its requests, so it holds a slot for at least its
longest request's output length, and ``max_loras`` slots share ``sum over adapters of that
length``: steps >= that sum / ``max_loras`` (and >= the longest request).

    kvserve bench lora-occupancy [--adapters 16 --max-loras 4 --slot-preemptions 0,1,2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvserve.benchmarks.common import fmt_table
from kvserve.workload.io import write_json
from kvserve.workload.workload import BenchRequest, default_workload_path, load_workload

#: The CPU engine's defaults for the default model (float32, 1 GiB KV cache, block 16).
CPU_ENGINE = {"num_gpu_blocks": 1456, "enable_chunked_prefill": True, "max_num_batched_tokens": 2048}


def assign_round_robin(reqs: list[BenchRequest], n_adapters: int) -> list[BenchRequest]:
    """Request ``i`` runs with adapter ``i % n_adapters + 1`` (none when ``n_adapters`` is 0),
    all at time 0, as ``kvserve bench lora`` sends them. Changes ``reqs`` in place."""
    for i, r in enumerate(reqs):
        r.lora_id = i % n_adapters + 1 if n_adapters else 0
        r.arrival_s = 0.0
    return reqs


def slot_bound_steps(reqs: list[BenchRequest], max_loras: int) -> int:
    """Fewest decode steps that the slot rule allows for ``reqs`` all queued at once: each
    adapter needs its longest request's output length in slot-steps, ``max_loras`` at a time
    (ceil of their sum / ``max_loras``, at least the longest one). Requests without an adapter
    do not count."""
    longest: dict[int, int] = {}
    for r in reqs:
        if r.lora_id:
            longest[r.lora_id] = max(longest.get(r.lora_id, 0), r.output_len)
    if not longest:
        return 0
    return max(-(-sum(longest.values()) // max_loras), max(longest.values()))


def occupancy(
    reqs: list[BenchRequest], max_loras: int, max_slot_preemptions: int = 0, **engine: Any
) -> dict[str, Any]:
    """Simulate ``reqs`` (their ``lora_id``s as given) with ``max_loras`` slots; the summary's
    figures named in the module docstring. ``engine``: ``EngineArgs`` fields over
    ``CPU_ENGINE``."""
    from kvserve.config import EngineArgs
    from kvserve.sim.cli import simulate

    n_adapters = len({r.lora_id for r in reqs} - {0})
    kw: dict[str, Any] = {**CPU_ENGINE, **engine}
    if n_adapters:
        kw.update(
            max_loras=max_loras,
            max_cpu_loras=max(max_loras, n_adapters),
            max_slot_preemptions=max_slot_preemptions,
        )
    s = simulate(EngineArgs(**kw), reqs)
    lo = s.get("lora") or {}
    by = {int(k): v for k, v in (lo.get("slot_steps_by_groups") or {}).items()}
    steps = s["num_steps"]
    return {
        "steps": steps,
        "mean_groups_per_step": s["mean_groups_per_step"],
        "slot_steps_by_groups": by,
        "free_slot_steps": max_loras * steps - sum(by.values()) if n_adapters else 0,
        "slot_preemptions": lo.get("num_slot_preemptions", 0),
        "bound_steps": slot_bound_steps(reqs, max_loras) if n_adapters else None,
        "sim_output_tok_s": s["output_tok_s"],
        "ttft_mean_s": s["ttft_s"]["mean"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "e2e_max_s": s["e2e_s"]["max"],
        "finished": s["finished"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="lora_occupancy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default=None, help="a workload JSONL (default: shared w64)")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--slot-preemptions", default="0,1,2", help="max_slot_preemptions values to compare")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    path = ns.workload or default_workload_path()
    if not Path(path).is_file():
        print(f"error: workload {path} not found", file=sys.stderr)
        return 2
    rows, results = [], []
    runs = [("base", 0, 0, {}), ("base16", 0, 0, {"max_num_seqs": 16})]
    runs += [(f"lora{ns.adapters}", ns.adapters, int(m), {}) for m in ns.slot_preemptions.split(",") if m]
    for name, n_adapters, msp, extra in runs:
        reqs = assign_round_robin(load_workload(path), n_adapters)
        r = occupancy(reqs, ns.max_loras, msp, **extra)
        r.update(run=name, max_slot_preemptions=msp)
        results.append(r)
        by = r["slot_steps_by_groups"]
        rows.append(
            [
                name,
                msp if n_adapters else "-",
                r["steps"],
                r["bound_steps"] if r["bound_steps"] is not None else "-",
                round(r["mean_groups_per_step"], 2),
                " ".join(f"{k}:{v}" for k, v in sorted(by.items()))
                + (f" free:{r['free_slot_steps']}" if by else ""),
                r["slot_preemptions"],
                round(r["sim_output_tok_s"], 1),
                round(r["ttft_mean_s"], 2),
                round(r["ttft_p99_s"], 2),
                round(r["e2e_max_s"], 2),
            ]
        )
    headers = ["run", "slot preempt", "steps", "bound", "groups/step", "slot-steps by groups", "preempted"]
    headers += ["sim tok/s", "TTFT mean", "TTFT p99", "e2e max"]
    print(fmt_table(headers, rows))
    if ns.json_out:
        write_json(ns.json_out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
