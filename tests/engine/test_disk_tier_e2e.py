"""The prefix cache's disk tier on the tiny model: blocks demoted to the host tier are written
to disk, and a new engine on the same directory starts with them in its host tier: its first
request with that prefix is served from them (host hits, no prefill of those blocks) and its
greedy output equals transformers token for token. An engine of another dtype ignores them."""

import random

from kvserve import LLM, SamplingParams
from tests.golden import TEST_DEVICE, compare, hf_greedy

BS = 4
MAX_NEW = 6


def _llm(model_dir, directory, dtype="float32"):
    return LLM(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype=dtype,
        block_size=BS,
        num_gpu_blocks=9,
        num_cpu_blocks=0,
        num_kv_offload_blocks=12,
        kv_offload_dir=str(directory),
        enable_prefix_caching=True,
    )


def _run(engine, request_id, tokens):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        engine.scheduler.block_manager.check_invariants()
    assert final is not None and final.outcome == "finished"
    return list(final.outputs[0].token_ids)


def test_restarted_engine_starts_warm_from_the_disk_tier(tiny_llama_dir, tiny_hf_model, tmp_path):
    rng = random.Random(11)
    prompt = [rng.randrange(3, 49152) for _ in range(18)]  # 4 full blocks + 2 tokens
    other = [rng.randrange(3, 49152) for _ in range(30)]
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first.llm_engine, "a", prompt)
    _run(first.llm_engine, "b", other)  # evicts the prompt's blocks into the host tier
    assert first.llm_engine.get_kv_cache_stats()["host_tier_demotions"] >= 4
    first.shutdown()
    assert len(list(tmp_path.glob("*.kvb"))) >= 4

    second = _llm(tiny_llama_dir, tmp_path)
    engine = second.llm_engine
    assert engine.get_kv_cache_stats()["host_tier_blocks"] >= 4
    out = _run(engine, "a-again", prompt)
    stats = engine.get_kv_cache_stats()
    assert stats["host_tier_hits"] == 4 and stats["prefix_cache_hits"] == 16
    compare(out, hf_greedy(tiny_hf_model, prompt, MAX_NEW))
    second.shutdown()

    foreign = _llm(tiny_llama_dir, tmp_path, dtype="bfloat16")  # other bytes: never loaded
    assert foreign.llm_engine.get_kv_cache_stats()["host_tier_blocks"] == 0
    foreign.shutdown()


def test_weights_rewritten_in_place_do_not_reuse_the_old_blocks(tiny_llama_dir, tmp_path):
    """Blocks written for one checkpoint are not loaded once the weights at the same path
    change (the path alone named the model): the restarted engine's greedy tokens are those of
    the new weights, computed, not the old weights' K/V."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    blocks = tmp_path / "blocks"
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(18)]
    other = [rng.randrange(3, 49152) for _ in range(30)]
    first = _llm(model_dir, blocks)
    _run(first.llm_engine, "a", prompt)
    _run(first.llm_engine, "b", other)  # the prompt's blocks go to the host tier and disk
    first.shutdown()
    assert len(list(blocks.glob("*.kvb"))) >= 4

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.model.layers[0].self_attn.parameters():
            p.mul_(-1.5)  # other K/V for the same tokens
    hf.save_pretrained(model_dir)
    hf = hf.to(TEST_DEVICE).eval()

    second = _llm(model_dir, blocks)
    engine = second.llm_engine
    assert engine.get_kv_cache_stats()["host_tier_blocks"] == 0
    out = _run(engine, "a-again", prompt)
    assert engine.get_kv_cache_stats()["host_tier_hits"] == 0
    compare(out, hf_greedy(hf, prompt, MAX_NEW))
    second.shutdown()
