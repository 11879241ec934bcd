"""``native_decode``: a pure-decode CPU step as straight native calls gives the same logits,
bit for bit, as the module path (same kernels, same order), and steps it does not cover fall
back to the module path."""

import random

import pytest
import torch

from kvserve.model_executor.layers import amx_gemm
from kvserve.model_executor.models import llama, native_decode
from tests.executor.helpers import VOCAB, ToyAllocator, ToySeq, advance, llama_config, make_worker, save_tiny


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2_bias"])
def test_decode_steps_bit_identical_to_module_path(tmp_path, dtype, arch, monkeypatch):
    cfg = (
        llama_config(
            hidden_size=96,
            intermediate_size=128,
            num_attention_heads=6,
            num_hidden_layers=3,
            max_position_embeddings=512,
        )
        if arch == "llama"
        else _qwen2_config()
    )
    save_tiny(tmp_path, cfg)
    w = make_worker(tmp_path, block_size=4, num_gpu_blocks=256, native=True, dtype=dtype)
    rng = random.Random(7)
    alloc = ToyAllocator(256)
    seqs = [ToySeq([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))]) for _ in range(9)]
    md = [s.metadata(s.data.get_prompt_len(), alloc, 4) for s in seqs]
    r = w.runner
    with torch.inference_mode():
        inp = r.prepare_inputs(md)
        r.model(inp.input_ids, inp.positions, w.cache_engine.gpu_cache, inp.attn)
    advance(md)
    calls = []
    real = native_decode.forward_layers
    monkeypatch.setattr(native_decode, "forward_layers", lambda *a: calls.append(1) or real(*a))
    for step in range(6):
        for s in seqs:
            s.data.append_token_id(rng.randrange(3, VOCAB))
        md = [s.metadata(1, alloc, 4) for s in seqs]
        inp = r.prepare_inputs(md)
        cache = w.cache_engine.gpu_cache
        snapshot = [c.clone() for c in cache]
        with torch.inference_mode():
            monkeypatch.setattr(llama.LlamaForCausalLM, "use_native_decode", False)
            want = r.model(inp.input_ids, inp.positions, cache, inp.attn)
            want_cache = [c.clone() for c in cache]
            for c, s0 in zip(cache, snapshot):
                c.copy_(s0)
            monkeypatch.setattr(llama.LlamaForCausalLM, "use_native_decode", True)
            got = r.model(inp.input_ids, inp.positions, cache, inp.attn)
        assert torch.equal(got, want), f"step {step}: max diff {(got.float() - want.float()).abs().max()}"
        assert all(torch.equal(a, b) for a, b in zip(cache, want_cache))
        advance(md)
    # the native path ran every decode step where this host has a native GEMM for the dtype
    # (bfloat16 needs AMX tiles; elsewhere its weights stay oneDNN's and the module path runs)
    assert len(calls) == (6 if dtype == "float32" or amx_gemm.available() else 0)


def test_prefill_and_mixed_steps_take_the_module_path(tmp_path, monkeypatch):
    save_tiny(tmp_path, llama_config(hidden_size=96, intermediate_size=128, num_attention_heads=6))
    w = make_worker(tmp_path, block_size=4, native=True)
    calls = []
    real = native_decode.forward_layers
    monkeypatch.setattr(native_decode, "forward_layers", lambda *a: calls.append(1) or real(*a))
    alloc = ToyAllocator(64)
    a, b = ToySeq([5, 6, 7, 8]), ToySeq([9, 10, 11])
    md = [a.metadata(4, alloc, 4)]
    r = w.runner
    with torch.inference_mode():
        inp = r.prepare_inputs(md)
        r.model(inp.input_ids, inp.positions, w.cache_engine.gpu_cache, inp.attn)
        advance(md)
        a.data.append_token_id(12)
        md = [a.metadata(1, alloc, 4), b.metadata(3, alloc, 4)]  # a decode beside a prefill
        inp = r.prepare_inputs(md)
        r.model(inp.input_ids, inp.positions, w.cache_engine.gpu_cache, inp.attn)
    assert calls == []
