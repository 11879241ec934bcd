"""Greedy output with waiting-aware prefix-cache eviction on a cache small enough that
admissions evict: equal to transformers, token for token (near-ties aside), with the eviction
order on and off."""

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.golden import TEST_DEVICE, compare, hf_greedy

MAX_NEW = 8


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Three 16-token system prompts, each continued by several requests' own tokens,
    interleaved so a queue of different prefixes competes for a small cache."""
    rng = random.Random(1)
    systems = [[rng.randrange(3, 49152) for _ in range(16)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(3, 49152) for _ in range(5 + i % 4)] for i in range(9)]


@pytest.fixture(scope="module")
def shared_prefix_references(tiny_hf_model, shared_prefix_prompts):
    return [hf_greedy(tiny_hf_model, p, MAX_NEW) for p in shared_prefix_prompts]


@pytest.mark.parametrize("aware", [True, False])
def test_greedy_unchanged_by_eviction_order(
    tiny_llama_dir, shared_prefix_prompts, shared_prefix_references, aware
):
    llm = LLM(
        model=str(tiny_llama_dir),
        device=TEST_DEVICE,
        dtype="float32",
        block_size=4,
        num_gpu_blocks=20,
        num_cpu_blocks=0,
        max_num_seqs=2,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    engine.scheduler.block_manager.gpu.keep_wanted = aware
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(shared_prefix_prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.block_manager.check_invariants()
    for i, ref in enumerate(shared_prefix_references):
        assert finals[f"r{i}"].outcome == "finished"
        compare(list(finals[f"r{i}"].outputs[0].token_ids), ref)
    stats = engine.get_kv_cache_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert engine.scheduler.block_manager.gpu.wanted == {}
    print(f"aware={aware} hits={stats['prefix_cache_hits']} wanted_evictions={stats['num_wanted_evictions']}")
