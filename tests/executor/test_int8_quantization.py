"""``quantization="int8"``: any float checkpoint's linear weights quantized at load to Q8_0
blocks (weight-only), run on the quantized kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvserve.model_executor.layers import quant_gemm
from kvserve.model_executor.model_loader import load_model
from tests.executor.helpers import llama_config, save_tiny
from tests.executor.test_gguf_quantized import greedy, prefill_logits


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references here are float-activation results: run the quantized kernels in that
    mode (int8 activations are checked by perplexity and test_quant_act8.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant_gemm.ACT_ENV, "float")
        yield


def test_quantize_q8_0_is_bit_identical_to_the_reference_quantizer():
    w = np.random.default_rng(0).standard_normal((70, 160)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block (scale 0)
    w[1, :32] = np.arange(32) * 0.5 - 8  # exact ties of the rounding
    q = quant_gemm.quantize_q8_0(torch.from_numpy(w))
    assert np.array_equal(q.data.numpy(), quantize(w, GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_gemm.quantize_q8_0(torch.zeros(4, 48))


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
            assert isinstance(w, quant_gemm.QuantWeight) and w.qtype == "q8_0"
        for name in ("gate_up_weight", "down_weight"):
            assert isinstance(getattr(layer.mlp, name), quant_gemm.QuantWeight)
    assert isinstance(m.lm_head, quant_gemm.QuantWeight) and isinstance(m.embed_tokens, torch.Tensor)
    # the reference: plain float weights = the dequantized Q8_0 ones
    for layer, rl in zip(m.layers, ref.layers):
        rl.self_attn.qkv_weight = quant_gemm.dequantize(layer.self_attn.qkv_weight)
        rl.self_attn.o_weight = quant_gemm.dequantize(layer.self_attn.o_weight)
        rl.mlp.gate_up_weight = quant_gemm.dequantize(layer.mlp.gate_up_weight)
        rl.mlp.down_weight = quant_gemm.dequantize(layer.mlp.down_weight)
    ref.lm_head = quant_gemm.dequantize(m.lm_head)
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
    from tests.executor.helpers import ToyAllocator, ToySeq

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
    monkeypatch.setenv(quant_gemm.ACT_ENV, "float")
    p_float = decode_perplexity(model, ids)
    monkeypatch.setenv(quant_gemm.ACT_ENV, "int8")
    p_int8 = decode_perplexity(model, ids)
    assert 1 < p_float < 100, p_float
    assert p_int8 != p_float  # the int8 kernels ran
    print(f"decode perplexity: float activations {p_float:.4f}, int8 {p_int8:.4f}")
    assert abs(p_int8 / p_float - 1) < 0.01, (p_int8, p_float)


@pytest.mark.slow
@pytest.mark.skipif(not quant_gemm.amx_supported(), reason="no AMX tiles here (or no kernels)")
@pytest.mark.parametrize(
    "quantization,dtype",
    [("gguf", torch.bfloat16), ("gguf", torch.float32), ("int8", torch.bfloat16)],
)
def test_default_model_amx_prefill_perplexity_within_one_percent_of_float(quantization, dtype, monkeypatch):
    """The prefill of the whole text (127 rows) in the int8 mode: every linear layer and the LM
    head on the AMX kernel (weights and activations rounded to bfloat16), against the float32
    model, and against the same quantized model on the float panels (``KVSERVE_QUANT_AMX=0``)."""
    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    d = resolve_model_dir(None)
    ids = load_tokenizer(d)(TEXT).input_ids
    p_float = perplexity(load_model(d, torch.float32, "cpu"), ids)
    monkeypatch.setenv(quant_gemm.ACT_ENV, "int8")
    if quantization == "gguf":
        model = load_gguf_model(
            default_gguf_path(), dtype, "cpu", load_hf_config(resolve_model_dir(None, "gguf"))
        )
    else:
        model = load_model(d, dtype, "cpu", quantization="int8")
    picked: list[str] = []
    pick = quant_gemm.pick_kernel
    monkeypatch.setattr(quant_gemm, "pick_kernel", lambda r, t: picked.append(pick(r, t)) or picked[-1])
    p_amx = perplexity(model, ids)
    assert picked and set(picked) == {"amx"}, set(picked)
    monkeypatch.setenv(quant_gemm.AMX_ENV, "0")
    picked.clear()
    p_panel = perplexity(model, ids)
    assert "amx" not in picked
    print(f"{quantization} {dtype}: perplexity float {p_float:.4f}, AMX {p_amx:.4f}, panels {p_panel:.4f}")
    assert p_amx != p_panel
    assert abs(p_amx / p_float - 1) < 0.01, (p_amx, p_float)


@pytest.mark.slow
@pytest.mark.skipif(quant_gemm.act8_isa() != "avx512-vnni", reason="no AVX-512 VNNI kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_vnni_prefill_perplexity_within_one_percent_of_float(dtype, monkeypatch):
    """The prefill of the whole text (127 rows) of the shipped Q4_1 GGUF on the VNNI int8 panels
    (``csrc/quant_vnni.h``; AMX off, so it runs on AMX CPUs too) against the float model of the
    same dtype (the issue's bound: int8 activations within 1% of the float path), and against
    the same quantized model on the float32 panels (``KVSERVE_QUANT_VNNI=0``: float
    activations). Measured on the AVX512-BF16 Xeon without AMX: float32 43.632 vs float 43.328
    (+0.70%; panels 43.328), bfloat16 43.936 vs float 43.668 (+0.61%; panels 43.448)."""
    from kvserve.model_executor.gguf_loader import load_gguf_model
    from kvserve.model_executor.model_loader import default_gguf_path, load_hf_config, resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    d = resolve_model_dir(None)
    ids = load_tokenizer(d)(TEXT).input_ids
    p_float = perplexity(load_model(d, dtype, "cpu"), ids)
    monkeypatch.setenv(quant_gemm.ACT_ENV, "int8")
    monkeypatch.setenv(quant_gemm.AMX_ENV, "0")
    model = load_gguf_model(
        default_gguf_path(), dtype, "cpu", load_hf_config(resolve_model_dir(None, "gguf"))
    )
    picked: list[str] = []
    pick = quant_gemm.pick_kernel
    monkeypatch.setattr(quant_gemm, "pick_kernel", lambda r, t: picked.append(pick(r, t)) or picked[-1])
    p_vnni = perplexity(model, ids)
    assert "vnni" in picked, set(picked)
    monkeypatch.setenv(quant_gemm.VNNI_ENV, "0")
    picked.clear()
    p_panel = perplexity(model, ids)
    assert picked and "vnni" not in picked, set(picked)
    print(f"{dtype}: prefill perplexity float {p_float:.4f}, VNNI {p_vnni:.4f}, float32 panels {p_panel:.4f}")
    assert 1 < p_float < 100, p_float
    assert p_vnni != p_panel  # int8 activations ran
    assert abs(p_vnni / p_float - 1) < 0.01, (p_vnni, p_float)
