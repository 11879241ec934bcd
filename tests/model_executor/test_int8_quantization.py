"""``quantization="int8"``: any float checkpoint's linear weights quantized at load to Q8_0
blocks (weight-only), run on the quantized kernels."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvserve.model_executor.model_loader import load_model
from kvserve.ops import quant
from tests.model_executor.helpers import llama_config, replace_weight, save_tiny
from tests.model_executor.test_gguf_quantized import greedy, prefill_logits


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references here are float-activation results: run the quantized kernels in that
    mode (int8 activations are checked by perplexity and test_quant_act8.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


def test_quantize_q8_0_is_bit_identical_to_the_reference_quantizer():
    w = np.random.default_rng(0).standard_normal((70, 160)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block (scale 0)
    w[1, :32] = np.arange(32) * 0.5 - 8  # exact ties of the rounding
    q = quant.quantize_q8_0(torch.from_numpy(w))
    assert np.array_equal(q.data.numpy(), quantize(w, GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_q8_0(torch.zeros(4, 48))


@pytest.mark.parametrize("tied", [True, False])
def test_int8_model_equals_float_model_on_the_quantized_weights(tmp_path, tied):
    """Every linear weight is Q8_0 (a tied LM head too, the embedding stays float); the logits
    equal a float model whose weights are those Q8_0 values dequantized."""
    cfg = llama_config(tie_word_embeddings=tied)
    save_tiny(tmp_path, cfg)
    m = load_model(tmp_path, torch.float32, "cpu", quantization="int8")
    ref = load_model(tmp_path, torch.float32, "cpu")
    for layer in m.layers:
        for name in ("qkv_weight", "o_weight"):
            w = getattr(layer.self_attn, name)
            assert isinstance(w, quant.QuantWeight) and w.qtype == "q8_0"
        for name in ("gate_up_weight", "down_weight"):
            assert isinstance(getattr(layer.mlp, name), quant.QuantWeight)
    assert isinstance(m.lm_head, quant.QuantWeight) and isinstance(m.embed_tokens, torch.Tensor)
    # the reference: plain float weights = the dequantized Q8_0 ones
    for layer, rl in zip(m.layers, ref.layers):
        for name in ("qkv_weight", "o_weight"):
            replace_weight(rl.self_attn, name, quant.dequantize(getattr(layer.self_attn, name)))
        for name in ("gate_up_weight", "down_weight"):
            replace_weight(rl.mlp, name, quant.dequantize(getattr(layer.mlp, name)))
    replace_weight(ref, "lm_head", quant.dequantize(m.lm_head))
    ids = [5, 17, 3, 99, 42, 8, 8, 120, 1, 200]
    got, want = prefill_logits(m, ids), prefill_logits(ref, ids)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert greedy(m, ids, 5) == greedy(ref, ids, 5)


def perplexity(model, ids: list[int]) -> float:
    logits = prefill_logits(model, ids).double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))


TEXT = (
    "The lighthouse stood at the end of the rocky point, its white tower weathered by a hundred "
    "winters. Every evening the keeper climbed the spiral stairs, trimmed the wick and wound the "
    "clockwork that turned the great lens, and every morning she wrote the weather in her log. "
    "Ships passed in the night without knowing her name, but they knew her light. One autumn a "
    "storm tore the shutters from the keeper's cottage and drove the fishing boats onto the "
    "shingle. She kept the lamp burning through three nights, and when the sea calmed the "
    "villagers came up the hill with bread, rope and new glass for the lantern room."
)


@pytest.mark.slow
def test_default_model_int8_perplexity_within_one_percent_of_float():
    """Measured on this text (127 tokens): float32 43.33, int8 43.09 (0.9945x)."""
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    d = resolve_model_dir(None)
    ids = load_tokenizer(d)(TEXT).input_ids
    assert len(ids) > 120
    p_float = perplexity(load_model(d, torch.float32, "cpu"), ids)
    p_int8 = perplexity(load_model(d, torch.float32, "cpu", quantization="int8"), ids)
    assert 1 < p_float < 100, p_float
    assert abs(p_int8 / p_float - 1) < 0.01, (p_int8, p_float)


@pytest.mark.slow
def test_default_model_gguf_bfloat16_perplexity_within_one_percent_of_float():
    """The quantized path with bfloat16 activations against the float32 reference on the same
    (dequantized) weights."""
    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    d = resolve_model_dir(None)
    ids = load_tokenizer(d)(TEXT).input_ids
    p_float = perplexity(load_model(d, torch.float32, "cpu"), ids)
    cfg = load_hf_config(resolve_model_dir(None, "gguf"))
    p_bf16 = perplexity(load_gguf_model(default_gguf_path(), torch.bfloat16, "cpu", cfg), ids)
    assert abs(p_bf16 / p_float - 1) < 0.01, (p_bf16, p_float)


def decode_perplexity(model, ids: list[int]) -> float:
    """Perplexity of ``ids`` fed one token per step through the paged cache (teacher forcing):
    every step is a 1-row decode step, the shape the int8-activation kernels serve."""
    from kvserve.worker.cache_engine import CacheEngine
    from kvserve.worker.model_runner import ModelRunner
    from tests.model_executor.helpers import ToyAllocator, ToySeq

    cfg = model.config
    blocks = len(ids) // 4 + 2
    ce = CacheEngine(
        cfg.num_hidden_layers, model.num_kv_heads, model.head_dim, 4, blocks, 0, model.dtype, "cpu"
    )
    runner = ModelRunner(model, 4, blocks, None, sampler=None)
    seq, alloc, nll = ToySeq(ids[:1]), ToyAllocator(blocks), 0.0
    for nxt in ids[1:]:
        inp = runner.prepare_inputs([seq.metadata(1, alloc, 4)])
        with torch.inference_mode():
            logits = model.compute_logits(model(inp.input_ids, inp.positions, ce.gpu_cache, inp.attn)[-1:])
        nll -= float(torch.log_softmax(logits.double(), dim=-1)[0, nxt])
        seq.data.update_num_computed_tokens(1)
        seq.data.append_token_id(nxt, 0.0)
    return math.exp(nll / (len(ids) - 1))


@pytest.mark.slow
def test_default_model_gguf_int8_activations_perplexity_within_one_percent_of_float_activations(monkeypatch):
    """The shipped Q4_1 GGUF (Q8_0 LM head), decoded one token at a time: int8 activations
    (``KVSERVE_QUANT_ACT=int8``) against float activations on the same weights, over the whole
    text (127 tokens). Its first 48 tokens alone are too few: a float32 rounding difference flips
    the int8 rounding of some activations, which moved their ratio by 0.17% between two int8
    kernels that agree to ~3e-7 (the Q4_1 x4 and GGUF-layout act8: -1.03% and -0.87% there;
    +0.58% and +0.45% over the whole text)."""
    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    ids = load_tokenizer(resolve_model_dir(None))(TEXT).input_ids
    cfg = load_hf_config(resolve_model_dir(None, "gguf"))
    model = load_gguf_model(default_gguf_path(), torch.float32, "cpu", cfg)
    monkeypatch.setenv(quant.ACT_ENV, "float")
    p_float = decode_perplexity(model, ids)
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    p_int8 = decode_perplexity(model, ids)
    assert 1 < p_float < 100, p_float
    assert p_int8 != p_float  # the int8 kernels ran
    print(f"decode perplexity: float activations {p_float:.4f}, int8 {p_int8:.4f}")
    assert abs(p_int8 / p_float - 1) < 0.01, (p_int8, p_float)


def paged_perplexity(model, ids: list[int]) -> float:
    """Perplexity of ``ids`` from one prefill through the paged KV cache: the serving path (the
    native prefill attention kernel, not torch's attention of ``perplexity``, whose rounding
    differs between CPUs and torch builds)."""
    from kvserve.worker.cache_engine import CacheEngine
    from kvserve.worker.model_runner import ModelRunner
    from tests.model_executor.helpers import ToyAllocator, ToySeq

    cfg, blocks = model.config, len(ids) // 4 + 2
    ce = CacheEngine(
        cfg.num_hidden_layers, model.num_kv_heads, model.head_dim, 4, blocks, 0, model.dtype, "cpu"
    )
    runner = ModelRunner(model, 4, blocks, None, sampler=None)
    inp = runner.prepare_inputs([ToySeq(ids).metadata(len(ids), ToyAllocator(blocks), 4)])
    assert inp.attn.native_prefill is not None
    with torch.inference_mode():
        logits = model.compute_logits(model(inp.input_ids, inp.positions, ce.gpu_cache, inp.attn)).double()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))


@functools.cache
def float32_prefill_perplexity() -> tuple[list[int], float]:
    """The text's ids and the float32 model's ``paged_perplexity``: the reference of every path
    below (kvserve's own float32 kernels, the same sums on every AVX-512 CPU; the bfloat16
    float model's prefill runs oneDNN, whose rounding varies with the CPU and thread count)."""
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    d = resolve_model_dir(None)
    ids = load_tokenizer(d)(TEXT).input_ids
    return ids, paged_perplexity(load_model(d, torch.float32, "cpu"), ids)


#: The quantized prefill routes a CPU can take by default, each forced here where this CPU can
#: run it: the kvserve environment switches, and whether bfloat16 attention runs on AMX tiles.
#: "amx": AMX hosts; "vnni": AVX-512 VNNI without AMX (AMD Zen 4; AMX hosts with the AMX
#: kernels off); "panels": the int8 mode with neither (the float panels past the int8 GEMV's
#: rows); "float": float activations, the default without VNNI (AVX2, AVX-512F).
PREFILL_ROUTES = {
    "amx": ({quant.ACT_ENV: "int8"}, True),
    "vnni": ({quant.ACT_ENV: "int8", quant.AMX_ENV: "0"}, False),
    "panels": ({quant.ACT_ENV: "int8", quant.AMX_ENV: "0", quant.VNNI_ENV: "0"}, False),
    "float": ({quant.ACT_ENV: "float", quant.AMX_ENV: "0"}, False),
}


def prefill_route_kernels(route: str, dtype: torch.dtype) -> set[str] | None:
    """The kernels a 127-row prefill runs on ``route`` here, or None where this CPU (or its
    kernel build) cannot run the route."""
    if route == "amx":
        return {"amx"} if quant.amx_supported() else None
    if route == "vnni":
        if quant.act8_isa() != "avx512-vnni":
            return None
        # bfloat16 prefills keep float activations (quant.VNNI_BF16_MAX_ROWS); the LM head
        # never runs on one int8 plane (quant.head_kernel: the panels)
        return {"panel"} if dtype == torch.bfloat16 else {"vnni", "panel"}
    return {"panel"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "quantization,dtype",
    [("gguf", torch.bfloat16), ("gguf", torch.float32), ("int8", torch.bfloat16)],
)
def test_default_model_prefill_perplexity_within_one_percent_of_float_on_every_route(
    quantization, dtype, monkeypatch
):
    """The prefill of the whole text (127 rows) through the paged cache, on each route of
    ``PREFILL_ROUTES`` this CPU can run (every kernel of each route's steps checked), within 1%
    of the float32 model's perplexity: the documented bound of int8 activations, which must hold
    on every route that is some CPU's default. The shipped Q4_1 GGUF (Q8_0 LM head), and the
    float checkpoint quantized to Q8_0 at load (``quantization="int8"``). The VNNI kernel's int8
    activations on a bfloat16 prefill missed the bound here (as on AMD Zen 4), so bfloat16
    prefills take the float panels on that route (``quant.VNNI_BF16_MAX_ROWS``)."""
    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir
    from kvserve.ops import prefill_attention

    ids, p_ref = float32_prefill_perplexity()
    assert 1 < p_ref < 100, p_ref
    for name in (quant.ACT_ENV, quant.AMX_ENV, quant.VNNI_ENV, quant.X4_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(quant.ACT_ENV, "int8")  # (the int8 mode's load: x4 copies made)
    if quantization == "gguf":
        model = load_gguf_model(
            default_gguf_path(), dtype, "cpu", load_hf_config(resolve_model_dir(None, "gguf"))
        )
    else:
        model = load_model(resolve_model_dir(None), dtype, "cpu", quantization="int8")
    picked: list[str] = []  # the kernels called (kernel_fn: every quantized GEMM's lookup)
    fn = quant.kernel_fn

    def kernel_fn(weight, rows, dt, kernel=None):
        picked.append(kernel or quant.pick_kernel(rows, weight.qtype, dt))
        return fn(weight, rows, dt, kernel)

    monkeypatch.setattr(quant, "kernel_fn", kernel_fn)
    results, not_here = {}, []
    for route, (env, attention_amx) in PREFILL_ROUTES.items():
        want = prefill_route_kernels(route, dtype)
        if want is None:
            not_here.append(route)
            continue
        for name in (quant.ACT_ENV, quant.AMX_ENV, quant.VNNI_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(prefill_attention, "USE_AMX", attention_amx)
        picked.clear()
        results[route] = paged_perplexity(model, ids)
        assert set(picked) == want, (route, set(picked))
    print(
        f"{quantization} {dtype}: prefill perplexity float32 {p_ref:.4f}; "
        + ", ".join(f"{r} {p:.4f} ({100 * (p / p_ref - 1):+.2f}%)" for r, p in results.items())
        + (f"; not on this CPU: {not_here}" if not_here else "")
    )
    assert "panels" in results and "float" in results  # (every CPU with the kernels runs these)
    for route, p in results.items():
        assert abs(p / p_ref - 1) < 0.01, (route, p, p_ref)
    if quant.act8_isa() == "avx512-vnni" and dtype == torch.float32:
        assert results["vnni"] != results["float"]  # int8 activations really ran
