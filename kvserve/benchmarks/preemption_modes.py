"""Preemption modes on tiny-cache workloads, on the simulator.

Each workload (``preemption_workloads``) queues all its requests at time 0 on a KV cache far
too small for them, so requests are preempted again and again; ``simulate_preemption`` runs one
through the real scheduler on the simulator (its cost model times the steps and, under
``--preemption-mode auto``, prices recompute against swap) and reports output tok/s on the
virtual clock, the preemptions, the tokens recomputed and the blocks swapped out.

Workloads (block size 16, host swap pool as large as the device pool, no chunked prefill):

* ``long``: 16 requests, 1,024-2,048-token prompts, 512-1,024 output tokens, 512 blocks;
* ``short``: 256 requests, 16-128-token prompts, 64-256 output tokens, 96 blocks;
* ``n4``: 32 requests of 4 seeded samples each, 128-512-token prompts, 128-256 output tokens,
  256 blocks;
* ``mixed``: 48 requests, every other one of 4 samples, 128-512-token prompts, 128-512 output
  tokens, 256 blocks (one-sample victims re-prefill cheaply, four-sample ones hold apart blocks
  that swap).

    python -m kvserve.benchmarks.preemption_modes [--modes recompute,swap,auto] [--swap-block-s S]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from kvserve.benchmarks.common import fmt_table
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.sampling_params import SamplingParams
from kvserve.workload.workload import BenchRequest

VOCAB = 49152
MODES = ("recompute", "swap", "auto")


@dataclass
class PreemptionWorkload:
    """Requests (all arriving at 0) and the tiny cache they run on.

    Attributes:
        name: short label.
        requests: prompt ids and output lengths (``BenchRequest``).
        n: samples per request (``SamplingParams.n``; > 1 samples at temperature 1, seeded),
            one for all or one per request.
        num_gpu_blocks: device blocks; ``num_cpu_blocks``: host swap blocks.
        block_size: tokens per block; ``max_model_len``: context limit (tokens).
    """

    name: str
    requests: list[BenchRequest]
    n: int | list[int] = 1
    num_gpu_blocks: int = 256
    num_cpu_blocks: int = 256
    block_size: int = 16
    max_model_len: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)


def _requests(rng: random.Random, count: int, prompt: tuple[int, int], output: tuple[int, int]):
    return [
        BenchRequest(
            prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt))],
            output_len=rng.randint(*output),
            id=i,
        )
        for i in range(count)
    ]


def preemption_workloads(seed: int = 0) -> list[PreemptionWorkload]:
    """The tiny-cache workloads of the module docstring (deterministic for ``seed``)."""
    rng = random.Random(seed)
    return [
        PreemptionWorkload(
            "long", _requests(rng, 16, (1024, 2048), (512, 1024)), num_gpu_blocks=512, num_cpu_blocks=512
        ),
        PreemptionWorkload(
            "short", _requests(rng, 256, (16, 128), (64, 256)), num_gpu_blocks=96, num_cpu_blocks=96
        ),
        PreemptionWorkload(
            "n4", _requests(rng, 32, (128, 512), (128, 256)), n=4, num_gpu_blocks=256, num_cpu_blocks=256
        ),
        PreemptionWorkload(
            "mixed",
            _requests(rng, 48, (128, 512), (128, 512)),
            n=[1 + 3 * (i % 2) for i in range(48)],
            num_gpu_blocks=256,
            num_cpu_blocks=256,
        ),
    ]


def simulate_preemption(
    workload: PreemptionWorkload, preemption_mode: str, cost_model=None, max_steps: int = 2_000_000
) -> dict[str, Any]:
    """Run ``workload`` to the end under ``preemption_mode`` on the simulator (``cost_model``:
    a ``kvserve.sim.cost_model.CostModel``, the built-in one when None; it also prices
    ``auto``). Returns ``mode``, ``duration_s`` (virtual), ``output_tokens``, ``output_tok_s``,
    ``finished``, ``num_preemptions`` (and by mode), ``recomputed_tokens``,
    ``swapped_out_blocks``, ``steps``.

    Raises:
        ValueError: an unknown ``preemption_mode`` (from ``SchedulerConfig``).
        RuntimeError: the engine did not drain within ``max_steps`` steps.
    """
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sim.cost_model import VirtualClock
    from kvserve.sim.executor import SimulatedExecutor
    from kvserve.sim.preemption_cost import CostModelPreemptionCost

    w = workload
    cc = CacheConfig(
        block_size=w.block_size, num_gpu_blocks=w.num_gpu_blocks, num_cpu_blocks=w.num_cpu_blocks
    )
    mode = SchedulerConfig.parse_preemption_mode(preemption_mode)
    sc = SchedulerConfig(max_model_len=w.max_model_len, max_num_seqs=256, preemption_mode=mode)
    clock = VirtualClock()
    executor = SimulatedExecutor(
        VOCAB, cost_model, cache_config=cc, check_kv=False, strict=False, clock=clock
    )
    engine = LLMEngine(
        ModelConfig(max_model_len=w.max_model_len, device="cpu"),
        cc,
        sc,
        executor=executor,
        clock=clock,
        vocab_size=VOCAB,
        preemption_cost=CostModelPreemptionCost(executor.cost_model),
    )
    for i, r in enumerate(w.requests):
        n = w.n if isinstance(w.n, int) else w.n[i]
        params = SamplingParams(
            n=n,
            max_tokens=r.output_len,
            ignore_eos=True,
            temperature=0.0 if n == 1 else 1.0,
            seed=r.id if n > 1 else None,
        )
        engine.add_request(str(r.id), {"prompt_token_ids": r.prompt_token_ids}, params, arrival_time=0.0)
    out_tokens = finished = steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished += o.outcome == "finished"
                out_tokens += sum(len(c.token_ids) for c in o.outputs)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"{w.name} under {preemption_mode}: not drained after {max_steps} steps")
    kv = engine.get_kv_cache_stats()
    duration = clock.now()
    return {
        "workload": w.name,
        "mode": preemption_mode,
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else 0.0,
        "finished": finished,
        "num_requests": len(w.requests),
        "num_preemptions": kv["num_preemptions"],
        "num_swap_preemptions": kv["num_swap_preemptions"],
        "num_recompute_preemptions": kv["num_recompute_preemptions"],
        "recomputed_tokens": kv["num_recomputed_tokens"],
        "swapped_out_blocks": kv["num_swapped_out_blocks"],
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    """Print a table of every workload under every mode (``--modes``), on the built-in cost
    model or one with ``--swap-block-s`` seconds per swapped block."""
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.preemption_modes", description=__doc__)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated preemption modes")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--swap-block-s", type=float, default=None, help="the cost model's swap_block_s")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    from kvserve.sim.cost_model import CostModel

    cm = CostModel() if ns.swap_block_s is None else CostModel(swap_block_s=ns.swap_block_s)
    names = set(ns.workloads.split(",")) if ns.workloads else None
    rows = []
    for w in preemption_workloads(ns.seed):
        if names is not None and w.name not in names:
            continue
        results = [simulate_preemption(w, m, cm) for m in ns.modes.split(",")]
        best = max(r["output_tok_s"] for r in results if r["mode"] != "auto")
        for r in results:
            rows.append(
                [
                    w.name,
                    r["mode"],
                    f"{r['output_tok_s']:.0f}",
                    f"{r['output_tok_s'] / best:.3f}",
                    r["num_preemptions"],
                    f"{r['num_swap_preemptions']}/{r['num_recompute_preemptions']}",
                    r["recomputed_tokens"],
                    r["swapped_out_blocks"],
                    f"{r['finished']}/{r['num_requests']}",
                ]
            )
    print(
        fmt_table(
            [
                "workload",
                "mode",
                "out tok/s",
                "vs best fixed",
                "preemptions",
                "swap/recompute",
                "recomputed tok",
                "swapped blocks",
                "finished",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
