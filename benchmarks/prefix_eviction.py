"""Simulated benchmark of the prefix cache's eviction order: plain least-recently-released
(LRU) against waiting-aware (cached blocks a waiting request's prompt holds go last).

Workload: ``--num-systems`` system prompts of ``--system-len`` tokens; requests arrive in
``--num-bursts`` bursts of ``--burst`` requests, each a random system prompt plus
``--own-len`` tokens of its own, ``--output-len`` output tokens. The device cache holds
``--num-gpu-blocks`` blocks of 16 tokens (a few system prompts), so a queue forms and every
admission evicts. Both runs replay the same requests on the simulator (``kvserve.sim``) with
the built-in cost model; prints prefix-cache hit rate (tokens), output tokens/s of simulated
time, mean TTFT and evictions of wanted blocks.

Usage: python benchmarks/prefix_eviction.py [--seed 0] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import random

from kvserve.config import EngineArgs
from kvserve.sim.cost_model import CostModel
from kvserve.sim.replay import replay, simulated_engine, summarize_replay
from kvserve.workload.workload import BenchRequest

VOCAB = 32000


def make_requests(args) -> list[BenchRequest]:
    """The bursty shared-prefix workload (deterministic in ``args.seed``)."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(VOCAB) for _ in range(args.system_len)] for _ in range(args.num_systems)]
    reqs = []
    for b in range(args.num_bursts):
        for _ in range(args.burst):
            own = [rng.randrange(VOCAB) for _ in range(args.own_len)]
            reqs.append(
                BenchRequest(
                    rng.choice(systems) + own, args.output_len, arrival_s=b * args.gap_s, id=len(reqs)
                )
            )
    return reqs


def run(args, aware: bool) -> dict:
    """One simulated replay; the summary plus the prefix-cache counters."""
    configs = EngineArgs(
        block_size=16,
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=0,
        max_num_seqs=args.max_num_seqs,
        max_model_len=4096,
        enable_prefix_caching=True,
    ).create_configs(4096)
    configs[1].waiting_aware_eviction = aware
    engine, clock = simulated_engine(configs, CostModel(), VOCAB)
    res = replay(engine, make_requests(args), clock, clock.set)
    s = summarize_replay(res)
    kv = engine.get_kv_cache_stats()
    return {
        "eviction": "waiting-aware" if aware else "LRU",
        "hit_rate": kv["prefix_cache_hit_rate"],
        "output_tok_s": s["output_tok_s"],
        "mean_ttft_s": s["ttft_s"]["mean"],
        "duration_s": s["duration_s"],
        "num_finished": s["num_finished"],
        "num_wanted_evictions": kv["num_wanted_evictions"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-systems", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--own-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-bursts", type=int, default=8)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--gap-s", type=float, default=4.0)
    p.add_argument("--num-gpu-blocks", type=int, default=160)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    args = p.parse_args()
    rows = [run(args, aware) for aware in (False, True)]
    print("| eviction | hit rate | out tok/s | mean TTFT s | wanted evictions |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['eviction']} | {r['hit_rate']:.3f} | {r['output_tok_s']:.1f} | "
            f"{r['mean_ttft_s']:.2f} | {r['num_wanted_evictions']} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
