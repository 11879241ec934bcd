"""``cpu_decode_step``: a pure-decode CPU step as straight native calls gives the same logits,
bit for bit, as the module path (same kernels, same order), and steps it does not cover fall
back to the module path."""

import random

import pytest
import torch

from kvserve.model_executor.models import cpu_decode_step, llama
from kvserve.ops import gemm, gemm_amx
from tests.model_executor.helpers import (
    VOCAB,
    ToyAllocator,
    ToySeq,
    advance,
    all_logits,
    llama_config,
    make_worker,
    save_tiny,
)


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


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def _gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=7,  # shorter than most sequences here: the windows matter
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


CONFIGS = {"qwen2_bias": _qwen2_config, "qwen3": _qwen3_config, "gemma3": _gemma3_config}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch,packing,kv",
    [(a, p, "auto") for a in ("llama", "qwen2_bias") for p in ("host", "panels")]
    + [("qwen3", "panels", "auto"), ("gemma3", "panels", "auto"), ("gemma3", "panels", "int8")],
)
def test_decode_steps_bit_identical_to_module_path(tmp_path, dtype, arch, packing, kv, monkeypatch):
    """Weights packed as ``prepack_weight`` does on this host (AVX2: float weights on oneDNN,
    the module path) and on the panels wherever the kernels built (the native path on AVX2
    hosts too): the decode steps' hidden states and cache writes equal the module path's.
    Qwen3 (per-head q/k RMSNorm) and Gemma 3 (its layer, sliding windows shorter than the
    sequences, a local rotary base) on the panels: their one-call step against their modules,
    Gemma 3 also over an int8 KV cache (its layer's rope write and attention take the q8
    kernels)."""
    if packing == "panels":
        monkeypatch.setattr(gemm, "beats_onednn", gemm.available)
    cfg = (
        llama_config(
            hidden_size=96,
            intermediate_size=128,
            num_attention_heads=6,
            num_hidden_layers=3,
            max_position_embeddings=512,
        )
        if arch == "llama"
        else CONFIGS[arch]()
    )
    save_tiny(tmp_path, cfg)
    w = make_worker(tmp_path, block_size=4, num_gpu_blocks=256, native=True, dtype=dtype, kv_cache_dtype=kv)
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
    real = cpu_decode_step.forward_layers
    monkeypatch.setattr(cpu_decode_step, "forward_layers", lambda *a: calls.append(1) or real(*a))
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
    # the native path ran every decode step where the weights are on a native GEMM: float32 on
    # the panels (AVX-512, or forced), bfloat16 on AMX tiles or panels (with AVX512-BF16 but no
    # AMX the panels take steps of up to BF16_DOT_MAX_ROWS rows, oneDNN's module path the
    # larger ones)
    native_bf16 = (
        gemm_amx.available()
        or gemm.packs_bfloat16()
        or (gemm.beats_onednn() and len(seqs) <= gemm.BF16_DOT_MAX_ROWS)
    )
    native = gemm.beats_onednn() if dtype == "float32" else native_bf16
    assert len(calls) == (6 if native else 0)


def test_prefill_and_mixed_steps_take_the_module_path(tmp_path, monkeypatch):
    save_tiny(tmp_path, llama_config(hidden_size=96, intermediate_size=128, num_attention_heads=6))
    w = make_worker(tmp_path, block_size=4, native=True, panels=True)
    calls = []
    real = cpu_decode_step.forward_layers
    monkeypatch.setattr(cpu_decode_step, "forward_layers", lambda *a: calls.append(1) or real(*a))
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


@pytest.mark.parametrize("window", [None, 6])
def test_verify_chunks_take_native_decode_path_with_chunk_path_logits(tmp_path, monkeypatch, window):
    """A step of plain decodes and speculative verify chunks (non-prompt chunks of m+1 tokens)
    runs as single-token decode rows on the native decode path, and every fed token's logits
    match the chunk (prefill attention) path; with a sliding window too, past the window."""
    from transformers import MistralConfig

    from kvserve.worker import model_runner

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=window,
        tie_word_embeddings=False,
    )
    save_tiny(tmp_path, cfg)
    w = make_worker(
        tmp_path, block_size=4, num_gpu_blocks=128, sliding_window=window, native=True, panels=True
    )
    rng = random.Random(3)
    alloc = ToyAllocator(128)
    seqs = [ToySeq([rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 20))]) for _ in range(4)]
    md = [s.metadata(s.data.get_prompt_len(), alloc, 4) for s in seqs]
    r = w.runner
    cache = w.cache_engine.gpu_cache
    with torch.inference_mode():
        inp = r.prepare_inputs(md)
        r.model(inp.input_ids, inp.positions, cache, inp.attn)
    advance(md)
    for s in seqs:
        s.data.append_token_id(rng.randrange(3, VOCAB))
    # seqs 0 and 2 verify 3 and 4 drafts (crossing block boundaries); 1 and 3 decode plainly
    chunk = {0: 4, 1: 1, 2: 5, 3: 1}
    for i, n in chunk.items():
        for _ in range(n - 1):
            seqs[i].data.append_token_id(rng.randrange(3, VOCAB))
    md = [s.metadata(chunk[i], alloc, 4, do_sample=chunk[i] == 1) for i, s in enumerate(seqs)]
    assert not any(m.is_prompt for m in md)
    calls = []
    real = cpu_decode_step.forward_layers
    monkeypatch.setattr(cpu_decode_step, "forward_layers", lambda *a: calls.append(1) or real(*a))
    snapshot = [c.clone() for c in cache]
    got = all_logits(w, md)
    assert len(calls) == 1, "a step of decodes and verify chunks must take the native decode path"
    got_cache = [c.clone() for c in cache]
    for c, s0 in zip(cache, snapshot):
        c.copy_(s0)
    monkeypatch.setattr(model_runner, "MAX_EXPANDED_DECODE_CHUNK", 1)  # verify chunks stay chunks
    inp = r.prepare_inputs(md)
    assert inp.attn.native_decode is not None and len(inp.attn.prefills) == 2
    want = all_logits(w, md)
    assert len(calls) == 1  # the chunk path is the module path
    for i, s in enumerate(seqs):
        g, e = got[s.seq_id], want[s.seq_id]
        assert g.shape == e.shape == (chunk[i], VOCAB)
        assert torch.allclose(g, e, atol=1e-4, rtol=1e-4), f"seq {i}: max diff {(g - e).abs().max()}"
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cache, got_cache))
    # the sampled rows (plain decodes) are the right ones
    with torch.inference_mode():
        monkeypatch.setattr(model_runner, "MAX_EXPANDED_DECODE_CHUNK", 16)
        lg = r.compute_logits(md, cache)
    assert torch.allclose(lg, torch.stack([got[seqs[1].seq_id][0], got[seqs[3].seq_id][0]]), atol=1e-4)
