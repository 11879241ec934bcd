"""The prefix cache's host tier on the tiny model: a prefix evicted from a small device pool
is demoted to the host tier, and a later request with that prefix gets its blocks swapped back
in: the device blocks hold the very bytes they held before eviction, the stats count the host
hit, and greedy output equals transformers token for token."""

import random

import torch

from kvserve import LLM, SamplingParams
from kvserve.core.block_manager import chain_block_hashes
from tests.golden import TEST_DEVICE, compare, hf_greedy

BS = 4
MAX_NEW = 6


def test_prefix_evicted_then_hit_in_host_tier_equals_transformers(tiny_llama_dir, tiny_hf_model):
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49152) for _ in range(18)]  # 4 full blocks + 2 tokens
    other = [rng.randrange(3, 49152) for _ in range(30)]
    llm = LLM(
        model=str(tiny_llama_dir),
        device=TEST_DEVICE,
        dtype="float32",
        block_size=BS,
        num_gpu_blocks=9,
        num_cpu_blocks=0,
        num_kv_offload_blocks=12,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    cache = engine.executor.cache_engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    hashes = chain_block_hashes(prompt, BS)
    assert len(hashes) == 4

    def run(request_id, tokens, after_first_step=None):
        engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
        final, first = None, True
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
            bm.check_invariants()
            if first and after_first_step is not None:
                after_first_step()
            first = False
        assert final is not None and final.outcome == "finished"
        return list(final.outputs[0].token_ids)

    run("a", prompt)
    ids = [bm.gpu.lookup(h).block_number for h in hashes]
    kv_before = cache.device_cache[:, :, :, ids].clone()
    run("b", other)  # grows to the whole 9-block pool: every cached block is evicted
    assert all(bm.gpu.lookup(h) is None for h in hashes)
    assert all(bm.cpu.lookup(h) is not None for h in hashes)
    hits_before = engine.get_kv_cache_stats()["prefix_cache_hits"]

    promoted = {}

    def capture():
        seq = engine.scheduler.running[0].get_seqs()[0]
        promoted["ids"] = bm.get_block_table(seq)[:4]

    out = run("a2", prompt, capture)
    assert torch.equal(cache.device_cache[:, :, :, promoted["ids"]], kv_before)
    stats = engine.get_kv_cache_stats()
    assert stats["host_tier_hits"] == 4
    assert stats["host_tier_demotions"] >= 4
    assert stats["prefix_cache_hits"] - hits_before == 16
    compare(out, hf_greedy(tiny_hf_model, prompt, MAX_NEW))
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    llm.shutdown()
