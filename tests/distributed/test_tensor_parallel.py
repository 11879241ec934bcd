"""Tensor parallelism on CPU (gloo, one thread per rank): greedy output at TP=2 equals TP=1 and
transformers under preemption (recompute and swap) and chunked prefill, for untied and tied
embeddings and a vocabulary that does not divide by T (vocab-parallel LM head); peers never
outlive their engine; a dead peer is a clear error, never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve import LLM
from kvserve.config import EngineArgs, ParallelConfig
from tests.engine.test_e2e_tiny import MAX_NEW, PROMPT_LENS, check_all, greedy, run_engine
from tests.golden import TEST_DEVICE, Reference, compare, hf_greedy

pytestmark = [pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU"), pytest.mark.slow]

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_cpu_blocks=64)
CONFIGS = {
    "chunked_prefix_recompute": dict(
        num_gpu_blocks=24,
        preemption_mode="recompute",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    ),
    "chunked_swap": dict(
        num_gpu_blocks=24, preemption_mode="swap", enable_chunked_prefill=True, max_num_batched_tokens=24
    ),
}


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    # two ranks on this 2-core machine: one OpenMP thread each
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def prompts():
    import random

    rng = random.Random(1)
    ps = [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]
    # two more sharing a 24-token prefix with the third (full blocks for prefix caching)
    return ps + [ps[2][:24] + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 13)]


#: The tiny models: ``untied`` (vocab 49152) and ``tied_odd_vocab`` (tied, vocab 49153), with
#: the CPU's replicated embedding, and the second with the embedding sharded too (CUDA's layout).
MODELS = {
    "untied": "tiny_llama_dir",
    "tied_odd_vocab": "tiny_llama_tied_odd_vocab_dir",
    "tied_odd_vocab-sharded_embedding": "tiny_llama_tied_odd_vocab_dir",
}
_REFERENCES: dict = {}


def _use_model(request, which: str, monkeypatch) -> str:
    """The model directory of ``MODELS[which]``, with the embedding layout it asks for set for
    the TP engines started after this (their peers inherit the environment)."""
    from kvserve.model_executor.layers.vocab_parallel import SHARD_EMBEDDING_ENV

    monkeypatch.setenv(SHARD_EMBEDDING_ENV, "1" if which.endswith("sharded_embedding") else "0")
    return request.getfixturevalue(MODELS[which])


def _model_and_references(request, which: str, prompts, monkeypatch):
    """``_use_model`` and transformers' greedy references for ``prompts`` (computed once per
    model)."""
    path = _use_model(request, which, monkeypatch)
    which = MODELS[which]
    if which not in _REFERENCES:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE).eval()
        _REFERENCES[which] = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, _REFERENCES[which]


def _peer_procs(llm):
    return list(llm.llm_engine.executor.peers._procs)


def _tokens(finals, n):
    return [finals[f"r{i}"].outputs[0].token_ids for i in range(n)]


@pytest.mark.parametrize(
    "name, which",
    [(name, which) for name in CONFIGS for which in list(MODELS)[:2]]
    + [("chunked_prefix_recompute", "tied_odd_vocab-sharded_embedding")],
)
def test_tp2_greedy_equals_tp1_and_transformers_under_preemption(request, prompts, name, which, monkeypatch):
    model_dir, references = _model_and_references(request, which, prompts, monkeypatch)
    cfg = CONFIGS[name]
    requests = [(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    one = LLM(model=str(model_dir), **ENGINE, **cfg)
    tp1 = _tokens(run_engine(one.llm_engine, requests), len(prompts))

    llm = LLM(model=str(model_dir), **ENGINE, **cfg, tensor_parallel_size=2)
    procs = _peer_procs(llm)
    try:
        engine = llm.llm_engine
        model = engine.executor.model
        assert model.num_kv_heads == 1  # 2 KV heads over 2 ranks
        assert engine.executor.cache_engine.device_cache.shape[2] == 1
        vocab = model.config.vocab_size
        half = -(-vocab // 2)
        assert model.lm_head.shape[0] == half  # the driver's vocab rows only
        assert model.embed_tokens.shape[0] == (half if which.endswith("sharded_embedding") else 2 * half)
        assert model.tie_word_embeddings == which.startswith("tied")
        finals = run_engine(engine, requests)
        check_all(finals, references)
        stats = engine.get_kv_cache_stats()
        assert stats["num_preemptions"] > 0, "the tiny cache must force preemption"
        if "swap" in name:
            assert stats["num_swap_preemptions"] > 0
        if "prefix" in name:
            assert stats["prefix_cache_hits"] > 0
        # TP=1 and TP=2 agree token for token up to transformers' first near-tie
        for ours, ref, base in zip(_tokens(finals, len(prompts)), references, tp1):
            compare(ours, Reference(base, ref.near_tie_step))
        assert engine.executor.tp.stats.calls > 0  # the shards really were summed
        assert engine.executor.tp.gather_stats.calls > 0  # and the logits slices gathered
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs), "peer ranks outlived shutdown"


@pytest.mark.parametrize("which", list(MODELS))
def test_tp2_logits_match_tp1(request, prompts, monkeypatch, which):
    """Beyond greedy tokens: the sampled and prompt logprobs of TP=2 equal TP=1 to float32
    rounding (every token id of the vocabulary, padding never sampled); the decode steps run
    on the native decode path (with its all-reduces) where the float32 weights are on the
    panels (AVX-512F), the module path where they are left to torch's GEMM (AVX2: the int8
    cases below take the native path there)."""
    from kvserve.model_executor.models import cpu_decode_step
    from kvserve.ops import gemm

    native_steps = []
    real = cpu_decode_step.forward_layers
    monkeypatch.setattr(
        cpu_decode_step,
        "forward_layers",
        lambda model, *a: native_steps.append(model.tp_size) or real(model, *a),
    )
    tiny_llama_dir = _use_model(request, which, monkeypatch)
    params = greedy(max_tokens=4, logprobs=5, prompt_logprobs=2)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    one = LLM(model=str(tiny_llama_dir), **ENGINE, num_gpu_blocks=128)
    a = one.generate(batch, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, num_gpu_blocks=128, tensor_parallel_size=2)
    widths = []
    runner = llm.llm_engine.executor.runner
    sampler = runner.sampler
    runner.sampler = lambda logits, mds: widths.append(tuple(logits.shape)) or sampler(logits, mds)
    try:
        b = llm.generate(batch, params, use_tqdm=False)
        gathers = llm.llm_engine.executor.tp.gather_stats.calls
        assert gathers >= 4 + 1  # one per step (4 tokens), one more for the prompt logprobs
        # the benchmark's idle transfer timings run on every rank and leave the counters clean
        assert llm.llm_engine.executor.time_gather(3, reps=2) > 0
        assert llm.llm_engine.executor.tp.gather_stats.calls == 0
    finally:
        llm.shutdown()
    if gemm.beats_onednn():
        assert 1 in native_steps and 2 in native_steps, native_steps
    else:
        assert native_steps == [], native_steps
    vocab = 49152 if which == "untied" else 49153
    # the gathered logits: every row of the step, the real vocabulary, no padding column
    assert widths and all(w[1] == vocab for w in widths), widths
    assert widths[0][0] == 3 and widths[-1][0] == 3
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs)
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert px.keys() == py.keys()
            for t in px:
                va, vb = (float(getattr(v[t], "logprob", v[t])) for v in (px, py))
                assert abs(va - vb) < 1e-3
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            for t in lx:
                va, vb = (float(getattr(v[t], "logprob", v[t])) for v in (lx, ly))
                assert abs(va - vb) < 1e-3


@pytest.mark.parametrize(
    "kw, which",
    [
        (dict(quantization="int8"), "untied"),
        (dict(dtype="bfloat16"), "untied"),
        (dict(quantization="int8"), "tied_odd_vocab"),
        (dict(quantization="int4"), "tied_odd_vocab"),
    ],
    ids=["int8", "bfloat16", "int8-tied_odd_vocab", "int4-tied_odd_vocab"],
)
def test_tp2_int8_and_bfloat16_equal_tp1(request, prompts, kw, which, monkeypatch):
    """int8 / int4 shards quantize the same Q8_0 / Q4_1 blocks as the whole weight (shards split on 32-column
    boundaries; the LM head's vocab rows are whole rows); bfloat16 activations are all-reduced
    in float32. Quantized decode steps run the native decode path at both sizes (on every CPU
    with the quantized kernels)."""
    from kvserve.model_executor.models import cpu_decode_step
    from kvserve.ops import quant

    native_steps = []
    real = cpu_decode_step.forward_layers
    monkeypatch.setattr(
        cpu_decode_step,
        "forward_layers",
        lambda model, *a: native_steps.append(model.tp_size) or real(model, *a),
    )
    tiny_llama_dir = _use_model(request, which, monkeypatch)
    engine_kw = {**ENGINE, **kw, "num_gpu_blocks": 128}
    params = greedy(max_tokens=6)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    one = LLM(model=str(tiny_llama_dir), **engine_kw)
    a = [o.outputs[0].token_ids for o in one.generate(batch, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_llama_dir), **engine_kw, tensor_parallel_size=2)
    try:
        b = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert a == b
    if "quantization" in kw and quant.available():
        assert 1 in native_steps and 2 in native_steps, native_steps


def test_killed_peer_rank_is_a_clear_error_not_a_hang(tiny_llama_dir, prompts):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, num_gpu_blocks=64, tensor_parallel_size=2)
    procs = _peer_procs(llm)
    try:
        pid = procs[0].pid
        os.kill(pid, signal.SIGKILL)
        procs[0].join(10)
        assert not procs[0].is_alive()
        t = time.monotonic()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]], greedy(max_tokens=3), use_tqdm=False
        )
        assert time.monotonic() - t < 60  # a hang waits out the 120 s collective timeout
        for o in outs:
            assert o.outcome == "failed"
            assert "tensor-parallel worker rank 1" in (o.error or "")
            assert str(pid) in (o.error or "")
        # every block came back
        st = llm.llm_engine.get_kv_cache_stats()
        assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_default_model_tp3_matches_tp1(default_model_dir):
    """SmolLM2-135M has 9 heads and 3 KV heads: T=3 divides both (T=2 does not)."""
    params = greedy(max_tokens=4)
    prompt = [{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}]
    one = LLM(model=str(default_model_dir), device="cpu", dtype="float32", num_gpu_blocks=32)
    ref = one.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(
        model=str(default_model_dir), device="cpu", dtype="float32", num_gpu_blocks=32, tensor_parallel_size=3
    )
    procs = _peer_procs(llm)
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert out == ref
    assert not any(p.is_alive() for p in procs)


def test_tp_size_that_does_not_divide_heads_names_both_counts(default_model_dir):
    from kvserve.model_executor.model_loader import load_hf_config

    cfg = load_hf_config(default_model_dir)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 must divide both num_attention_heads=9 and num_key_value_heads=3",
    ):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu")
    # through the engine too, before any rank is started
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        LLM(model=str(default_model_dir), device="cpu", tensor_parallel_size=2)


def test_more_ranks_than_cuda_devices_is_refused(tiny_llama_dir, monkeypatch):
    import torch

    from kvserve.model_executor.model_loader import load_hf_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_hf_config(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 CUDA devices .* only 1"):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cuda")


def test_engine_refuses_more_ranks_than_cuda_devices_before_starting_any(tiny_llama_dir, monkeypatch):
    """Through ``LLM``: the clear error comes from the engine, before a peer process is spawned
    (here with CUDA faked present with one device)."""
    import torch

    from kvserve.worker import tp_executor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = []
    monkeypatch.setattr(tp_executor.TensorParallelPeers, "start", lambda self: started.append(self))
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 needs 2 CUDA devices .* only 1 are visible"
    ):
        LLM(model=str(tiny_llama_dir), device="cuda", tensor_parallel_size=2)
    assert started == []


def test_cli_flag_reaches_engine_args():
    import argparse

    from kvserve.entrypoints.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--tensor-parallel-size", "2"])
    assert engine_args_from(ns).create_parallel_config().tensor_parallel_size == 2
    with pytest.raises(SystemExit):  # not an integer: argparse refuses it
        parser.parse_args(["--tensor-parallel-size", "two"])


@pytest.mark.parametrize("bad", [0, -1, 65, 1.5, True, "2"])
def test_tensor_parallel_size_out_of_range_names_field(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer in \\[1, 64\\]"):
        EngineArgs(tensor_parallel_size=bad)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(quantization="gguf"), "quantization='gguf' is not supported with tensor_parallel_size > 1"),
        (dict(speculative_config={"method": "ngram"}), "speculative_config"),
    ],
)
def test_unsupported_combinations_refused_before_loading(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(tensor_parallel_size=2, **kw)


@pytest.fixture(scope="module")
def tiny_llama_48_column_shards_dir(tmp_path_factory, default_tokenizer_dir):
    """The tiny Llama with hidden 96 (head_dim 24) and intermediate 96: at T=2 each rank's o_proj
    and down_proj take 48 input columns, not a whole number of 32-weight quantization blocks."""
    from tests.conftest import _save_tiny, tiny_llama_config

    config = tiny_llama_config(hidden_size=96, intermediate_size=96, vocab_size=1000)
    return _save_tiny(tmp_path_factory, default_tokenizer_dir, "tiny-llama-48-col", config)


@pytest.mark.parametrize("quant, block", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_int8_int4_shards_off_the_32_column_blocks_refused_before_any_peer_starts(
    tiny_llama_48_column_shards_dir, monkeypatch, quant, block
):
    from kvserve.model_executor.model_loader import load_hf_config
    from kvserve.worker import tp_executor

    cfg = load_hf_config(tiny_llama_48_column_shards_dir)
    want = (
        rf"quantization='{quant}' with tensor_parallel_size=2 needs each rank's input columns to be "
        rf"whole {block} blocks of 32: o_proj 96/2 = 48, down_proj intermediate_size 96/2 = 48"
    )
    with pytest.raises(ValueError, match=want):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu", quantization=quant)
    ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu")  # float shards: any width
    started = []
    monkeypatch.setattr(tp_executor.TensorParallelPeers, "start", lambda self: started.append(self))
    with pytest.raises(ValueError, match=want):
        LLM(
            model=str(tiny_llama_48_column_shards_dir),
            device="cpu",
            quantization=quant,
            tensor_parallel_size=2,
        )
    assert started == []


@given(
    heads=st.sampled_from([2, 4, 8]),
    head_dim=st.sampled_from([8, 16, 24, 32, 64]),
    inter=st.integers(1, 40).map(lambda k: 16 * k),
    t=st.sampled_from([2, 4]),
    quant=st.sampled_from(["int8", "int4", None]),
)
def test_quantized_tp_shape_check_accepts_exactly_whole_blocks(heads, head_dim, inter, t, quant):
    """The check refuses exactly the splits whose row-parallel shards (o_proj, down_proj) are
    not whole 32-column blocks; unquantized splits are never refused for it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=inter,
    )
    if heads % t or inter % t:
        return
    ok = quant is None or ((heads // t) * head_dim % 32 == 0 and (inter // t) % 32 == 0)
    try:
        ParallelConfig(tensor_parallel_size=t).verify_with_model(cfg, "cpu", quantization=quant)
        assert ok
    except ValueError as e:
        assert not ok and "32" in str(e)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_checkpoint_found_in_config_refused_at_tp2_before_any_peer_starts(
    tiny_llama_dir, tmp_path, monkeypatch, method
):
    """Without ``quantization=`` the method comes from the checkpoint's config.json; at T > 1
    it is refused as the flag is, before a peer process is spawned (was after every rank had
    started and loaded)."""
    import json
    import shutil

    from kvserve.worker import tp_executor

    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32}
    (model / "config.json").write_text(json.dumps(cfg))
    started = []
    monkeypatch.setattr(tp_executor.TensorParallelPeers, "start", lambda self: started.append(self))
    with pytest.raises(
        ValueError, match=rf"quant_method '{method}'\) is not supported with tensor_parallel_size > 1"
    ):
        LLM(model=str(model), device="cpu", tensor_parallel_size=2)
    assert started == []
