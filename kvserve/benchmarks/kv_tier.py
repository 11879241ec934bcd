"""The prefix cache's host tier on the simulator: prefix hit rate and TTFT with and without it.

Requests are the first ``--num-requests`` rows of a Mooncake JSONL trace (default: the shared
``traces/mooncake_fast25``), scaled down: each 512-token ``hash_id`` becomes ``--block-tokens``
tokens (one KV block by default), so rows that share hash ids share prefixes; at most
``--max-blocks`` hash ids a row, outputs cut to ``--max-output-len``; arrivals are the trace's
timestamps times ``--time-scale``. The device pool (``--num-gpu-blocks``) is far smaller than
the trace's distinct prefixes, so a prefix is evicted before most of its reuses; each host-tier
size of ``--tiers`` (blocks, 0 = none) is one run through the real scheduler on the simulator
(built-in cost model; a promotion's swap-in is priced as a swapped block). No swap pool.

    python -m kvserve.benchmarks.kv_tier [--tiers 0,2048,8192] [--num-requests 1000]
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvserve.benchmarks.common import fmt_table
from kvserve.config import EngineArgs
from kvserve.envs import shared_dir
from kvserve.workload.workload import BenchRequest, corpus_window, load_corpus, load_trace

DEFAULT_TRACE = "traces/mooncake_fast25/synthetic_trace.jsonl"


def tier_requests(
    path: str, num_requests: int, block_tokens: int, max_blocks: int, max_output_len: int, time_scale: float
) -> list[BenchRequest]:
    """The benchmark's requests (see the module doc). Raises ValueError when the trace has
    no ``hash_ids`` or arrival times."""
    rows = [r for r in load_trace(path) if r.hash_ids][:num_requests]
    if not rows or any(r.arrival_s is None for r in rows):
        raise ValueError(f"{path}: a Mooncake JSONL trace (hash_ids and timestamps) is needed")
    try:
        corpus = load_corpus()
    except ValueError:
        corpus = [3 + (i * 7919) % 49149 for i in range(1 << 17)]
    span = max(len(corpus) - block_tokens, 1)
    t0 = min(r.arrival_s or 0.0 for r in rows)
    reqs = []
    for i, r in enumerate(rows):
        ids: list[int] = []
        for h in (r.hash_ids or [])[:max_blocks]:
            ids.extend(corpus_window(corpus, (h * 1_000_003) % span, block_tokens))
        out = max(1, min(r.output_len, max_output_len))
        arrival = ((r.arrival_s or 0.0) - t0) * time_scale
        reqs.append(BenchRequest(prompt_token_ids=ids, output_len=out, id=i, arrival_s=arrival))
    return reqs


def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """One simulation per tier size; rows of the table."""
    from kvserve.sim.cli import simulate

    path = ns.trace or str(shared_dir() / DEFAULT_TRACE)
    reqs = tier_requests(
        path, ns.num_requests, ns.block_tokens, ns.max_blocks, ns.max_output_len, ns.time_scale
    )
    rows = []
    for tier in ns.tiers:
        args = EngineArgs(
            block_size=16,
            num_gpu_blocks=ns.num_gpu_blocks,
            num_cpu_blocks=0,
            num_kv_offload_blocks=tier,
            enable_prefix_caching=True,
            enable_chunked_prefill=False,
            max_model_len=ns.max_blocks * ns.block_tokens + ns.max_output_len,
        )
        s = simulate(args, [BenchRequest(**vars(r)) for r in reqs])
        pc = s["prefix_cache"]
        rows.append(
            {
                "host tier blocks": tier,
                "prefix hit rate": round(pc["prefix_cache_hit_rate"], 3),
                "device hit blocks": pc["gpu_prefix_cache_hit_blocks"],
                "host hit blocks": pc["host_tier_hits"],
                "demotions": pc["host_tier_demotions"],
                "TTFT p50 s": round(s["ttft_s"]["p50"], 4),
                "TTFT p90 s": round(s["ttft_s"]["p90"], 4),
                "finished": s["finished"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.kv_tier", description=__doc__)
    ap.add_argument("--trace", default=None, help=f"Mooncake JSONL (default: shared/{DEFAULT_TRACE})")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per trace hash id")
    ap.add_argument("--max-blocks", type=int, default=64, help="hash ids kept per row")
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=0.25, help="multiplies the trace's arrival times")
    ap.add_argument("--num-gpu-blocks", type=int, default=1024)
    ap.add_argument(
        "--tiers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0, 2048, 8192],
        help="host tier sizes",
    )
    ns = ap.parse_args(argv)
    logging.getLogger("kvserve").setLevel(logging.ERROR)  # one line per preemption otherwise
    rows = run(ns)
    print(fmt_table(list(rows[0]), [list(r.values()) for r in rows]))
    base = rows[0]["prefix hit rate"]
    for r in rows[1:]:
        if base:
            print(f"host tier of {r['host tier blocks']} blocks: hit rate x{r['prefix hit rate'] / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
