"""The preemption benchmark's workloads and simulator runs (cut down to stay fast)."""

from __future__ import annotations

import random

import pytest

from kvserve.benchmarks.preemption_modes import (
    PreemptionWorkload,
    _requests,
    preemption_workloads,
    simulate_preemption,
)
from kvserve.sim.cost_model import CostModel


def test_workloads_are_deterministic_and_overfill_their_cache():
    a, b = preemption_workloads(seed=3), preemption_workloads(seed=3)
    assert [w.name for w in a] == ["long", "short", "n4", "mixed"]
    for wa, wb in zip(a, b):
        assert [r.prompt_token_ids for r in wa.requests] == [r.prompt_token_ids for r in wb.requests]
        n = [wa.n] * len(wa.requests) if isinstance(wa.n, int) else wa.n
        tokens = sum(k * (r.prompt_len + r.output_len) for k, r in zip(n, wa.requests))
        assert tokens > 4 * wa.num_gpu_blocks * wa.block_size, wa.name  # far too small a cache


@pytest.mark.parametrize("swap_block_s", [2e-5, 4e-3])
def test_modes_agree_on_output_and_auto_follows_the_cheaper(swap_block_s):
    """A small mixed workload: every mode emits the same tokens; auto recomputes no more than
    recompute, and with the swap priced far below (above) a re-prefill it swaps (recomputes)
    as the fixed mode does."""
    rng = random.Random(1)
    w = PreemptionWorkload(
        "small",
        _requests(rng, 10, (40, 120), (40, 80)),
        n=[1, 2] * 5,
        num_gpu_blocks=24,
        num_cpu_blocks=24,
    )
    cm = CostModel(swap_block_s=swap_block_s)
    res = {m: simulate_preemption(w, m, cm) for m in ("recompute", "swap", "auto")}
    assert {r["output_tokens"] for r in res.values()} == {
        sum(r.output_len * k for r, k in zip(w.requests, w.n))
    }
    assert all(r["finished"] == 10 for r in res.values())
    assert res["recompute"]["num_preemptions"] > 0
    assert res["auto"]["recomputed_tokens"] <= res["recompute"]["recomputed_tokens"]
    cheaper = "swap" if swap_block_s < 1e-4 else "recompute"
    assert res["auto"]["num_preemptions"] == res["auto"][f"num_{cheaper}_preemptions"] > 0
