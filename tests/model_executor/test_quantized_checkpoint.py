"""Quantized HF checkpoints (``quantized_checkpoint``): GPTQ, AWQ and compressed-tensors dirs
written by the test's own packers (``quant_packers``, from the formats' descriptions) from tiny
random Llamas, against the same weights dequantized into a float dir.

Tolerances (stated): the kernel on repacked 4-bit weights against float64
dequantize-then-matmul: ``64 * eps32 * (|x| @ |W|^T)`` (the kernels' float32 sums, as
``test_quant_gemm``) plus ``2^-11 * (|x| @ |scale * zero|^T)`` (the float16 rounding of Q4_1's
``m = -scale * zero``); int8 with float16 scales: the kernels' term only (the repack is exact).
Greedy tokens of the quantized dir through kvserve equal transformers' on the float dir.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvserve.model_executor import quantized_checkpoint as qck
from kvserve.model_executor.layers.permuted_linear import InputPermutedWeight
from kvserve.model_executor.model_loader import load_hf_config, load_model
from kvserve.ops import quant
from tests.model_executor.helpers import llama_config, save_tiny
from tests.model_executor.test_gguf_quantized import greedy, prefill_logits
from tests.ops.quant_packers import (
    awq_tensors,
    dequant_4bit,
    gptq_tensors,
    quantize_dir,
    random_4bit,
)

EPS32 = float(np.finfo(np.float32).eps)
native = pytest.mark.skipif(not quant.available(), reason="quant kernels unavailable")
PROMPTS = ([5, 17, 3, 99, 42, 8, 8, 120, 1, 200], [7, 7, 7, 1, 250, 33])


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references here are float-activation results: run the quantized kernels in that
    mode (int8 activations are checked in test_quant_act8.py and by perplexity)."""
    from kvserve.ops import quant

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


def hf_greedy(hf_model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny float Llama (hidden 64, intermediate 96: down_proj has 96 inputs, a ragged last
    group for group sizes 64 / 128) and its directory."""
    d = tmp_path_factory.mktemp("tiny")
    return save_tiny(d, llama_config()).cpu()


def _load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# ------------------------------------------------------------------ kernels on repacked weights
def _check_4bit_kernel(method, out_f, in_f, group_size, sym, desc_act, m_rows, seed):
    """``method``: gptq, awq, or gptq8 (8-bit symmetric GPTQ -> Q8_0: exact repack)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(in_f) if desc_act else None
    bits = 8 if method == "gptq8" else 4
    sym = sym or bits == 8
    codes, scales, zeros, g_idx = random_4bit(rng, out_f, in_f, group_size, sym, perm, bits)
    wd = dequant_4bit(codes, scales, zeros, g_idx)  # float64 reference
    if method.startswith("gptq"):
        zeros = np.maximum(zeros, 1)  # v1 format: zero 0 cannot be stored
        wd = dequant_4bit(codes, scales, zeros, g_idx)
        t = gptq_tensors(codes, scales, zeros, g_idx, bits=bits)
        qcodes = qck.unpack_int32_rows(t["qweight"], bits).t()
        qzeros = qck.unpack_int32_cols(t["qzeros"], bits=bits).to(torch.int32) + 1
        qw, p = qck.repack_grouped(qcodes, t["scales"], qzeros, t["g_idx"], "test", bits)
        assert qw.qtype == ("q8_0" if bits == 8 else "q4_1")
    else:
        t = awq_tensors(codes, scales, zeros)
        qcodes = qck.unpack_int32_cols(t["qweight"], qck._AWQ_ORDER).t()
        qzeros = qck.unpack_int32_cols(t["qzeros"], qck._AWQ_ORDER)
        qw, p = qck.repack_grouped(qcodes, t["scales"], qzeros, torch.from_numpy(g_idx), "test")
    assert (p is not None) == (desc_act and not np.array_equal(np.sort(g_idx), g_idx))
    weight = qw if p is None else InputPermutedWeight(qw, p)
    x = torch.randn(m_rows, in_f, generator=torch.Generator().manual_seed(seed))
    from kvserve.model_executor.models.llama import linear

    y = linear(x, weight).double().numpy()
    xd = x.double().numpy()
    ref = xd @ wd.T
    sz = np.abs(scales.astype(np.float64) * zeros)[g_idx].T * (bits == 4)  # |scale * zero| (Q4_1's m)
    tol = 64 * EPS32 * (np.abs(xd) @ np.abs(wd).T) + 2.0**-11 * (np.abs(xd) @ sz.T) + 1e-12
    err = np.abs(y - ref)
    assert (err <= tol).all(), f"worst {float((err / tol).max()):.2f} x tolerance"


@native
@pytest.mark.parametrize("method", ["gptq", "awq", "gptq8"])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_repacked_4bit_kernel_equals_float64_dequantize_then_matmul(method, group_size):
    # in 160: 160 / 64 and 160 / 128 leave ragged last groups; out 40: not a multiple of 16
    _check_4bit_kernel(method, 40, 160, group_size, False, False, 5, 0)


@native
def test_gptq_8bit_layer_of_one_block_repacks():
    """Found by the property test: in_features 32 (one block per row) made the scales a
    strided [out, 1] view that the Q8_0 packer could not reinterpret as bytes."""
    _check_4bit_kernel("gptq8", 8, 32, 32, False, False, 1, 0)


@native
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_gptq_act_order_kernel_with_input_permutation_equals_float64(group_size):
    _check_4bit_kernel("gptq", 24, 192, group_size, True, True, 3, 1)


@native
@settings(max_examples=25, deadline=None)
@given(
    method=st.sampled_from(["gptq", "awq", "gptq8"]),
    out_blocks=st.integers(1, 12),
    in_blocks=st.integers(1, 10),
    group=st.sampled_from([32, 64, 128, -1]),
    sym=st.booleans(),
    desc_act=st.booleans(),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_repacked_4bit_kernel_property(method, out_blocks, in_blocks, group, sym, desc_act, rows, seed):
    """Random shapes (out a multiple of 8, in of 32), group sizes and act-order permutations."""
    if method == "awq":
        desc_act = False
    _check_4bit_kernel(method, 8 * out_blocks, 32 * in_blocks, group, sym, desc_act, rows, seed)


@native
@settings(max_examples=25, deadline=None)
@given(
    out_f=st.integers(1, 70),
    in_blocks=st.integers(1, 8),
    strategy=st.sampled_from(["channel", "group32", "group64", "tensor"]),
    scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_repacked_int8_kernel_equals_float64_dequantize_then_matmul(
    out_f, in_blocks, strategy, scale_dtype, rows, seed
):
    """compressed-tensors int8 -> Q8_0: the kernel's float32 sums against float64, plus the
    float16 rounding of non-float16 scales (``2^-11`` relative per weight)."""
    in_f = 32 * in_blocks
    if strategy == "group64" and in_f % 64:
        strategy = "group32"
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_f, in_f), generator=g, dtype=torch.int8)
    cols = {"channel": 1, "group32": in_f // 32, "group64": in_f // 64, "tensor": 0}[strategy]
    shape = (1,) if cols == 0 else (out_f, cols)
    scale = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).mul(1e-3).to(scale_dtype)
    qw = qck.repack_int8(q, scale, "w", "s", set())
    assert qw.qtype == "q8_0"
    s = scale.double().reshape(-1, 1) if cols == 0 else scale.double()
    wd = q.double() * (s if cols <= 1 else s.repeat_interleave(in_f // cols, dim=1))
    x = torch.randn(rows, in_f, generator=g)
    y = quant.linear(x, qw).double().numpy()
    xd = x.double().numpy()
    ref = xd @ wd.numpy().T
    absprod = np.abs(xd) @ np.abs(wd.numpy()).T
    tol = 64 * EPS32 * absprod + (0 if scale_dtype == torch.float16 else 2.0**-11 * absprod) + 1e-12
    assert (np.abs(y - ref) <= tol).all()


def test_int8_scales_outside_float16_run_dequantized(caplog):
    q = torch.randint(-128, 128, (4, 64), dtype=torch.int8)
    scale = torch.full((4, 1), 1e-9)  # under float16's subnormals: a Q8_0 block would hold 0
    with caplog.at_level(logging.INFO, logger="kvserve.quantized_checkpoint"):
        w = qck.repack_int8(q, scale, "w", "s", set())
    assert "dequantized to float at load" in caplog.text
    assert isinstance(w, torch.Tensor) and torch.equal(w, (q.double() * scale.double()).float())


def test_act_order_groups_that_split_a_block_are_refused():
    g_idx = torch.arange(64) // 16  # groups of 16 channels: not whole 32-blocks
    with pytest.raises(ValueError, match="whole blocks of 32"):
        qck.repack_grouped(
            torch.zeros(8, 64, dtype=torch.uint8), torch.ones(4, 8), torch.zeros(4, 8), g_idx, "t"
        )
    with pytest.raises(ValueError, match=r"g_idx values must lie in \[0, 4\)"):
        qck.repack_grouped(
            torch.zeros(8, 64, dtype=torch.uint8),
            torch.ones(4, 8),
            torch.zeros(4, 8),
            torch.full((64,), 4),
            "t",
        )


# ------------------------------------------------------------------ whole checkpoints
GPTQ_VARIANTS = [
    dict(group_size=64, sym=True, bits=8),
    dict(group_size=32, sym=True, bits=8, desc_act=True),
    dict(group_size=128, sym=True),
    dict(group_size=32, sym=False),
    dict(group_size=64, sym=False, v2=True),
    dict(group_size=-1, sym=True, quantize_lm_head=True),
    dict(group_size=32, sym=False, desc_act=True),
    dict(group_size=64, sym=True, desc_act=True),
]


def _check_dir(tmp_path, tiny, method, atol=2e-3, dtype=torch.float32, **kw):
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    quantize_dir(tiny, qdir, fdir, method, **kw)
    m = load_model(qdir, dtype, "cpu")
    ref = load_model(fdir, torch.float32, "cpu")
    for ids in PROMPTS:
        got, want = prefill_logits(m, ids), prefill_logits(ref, ids)
        assert torch.allclose(got.float(), want, atol=atol), (got.float() - want).abs().max()
    hf = _load_hf(fdir)
    for ids in PROMPTS:
        assert greedy(m, ids, 6) == hf_greedy(hf, ids, 6)
    return m


@pytest.mark.parametrize("kw", GPTQ_VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_gptq_dir_greedy_equals_transformers_on_dequantized_dir(tmp_path, tiny, kw):
    m = _check_dir(tmp_path, tiny, "gptq", **kw)
    # act order permutes the inputs where a layer has more than one group (in 64 / 96)
    qkv, down = m.layers[0].self_attn.qkv_weight, m.layers[1].mlp.down_weight
    gs = kw["group_size"]
    assert isinstance(qkv, InputPermutedWeight) == bool(kw.get("desc_act") and 0 < gs < 64)
    assert isinstance(down, InputPermutedWeight) == bool(kw.get("desc_act") and 0 < gs < 96)
    for w in (qkv, down):
        assert getattr(w, "weight", w).qtype == ("q8_0" if kw.get("bits") == 8 else "q4_1")
    assert isinstance(m.lm_head, quant.QuantWeight) == bool(kw.get("quantize_lm_head"))


def test_gptq_act_order_with_different_permutations_per_part_runs_dequantized(tmp_path, tiny, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.quantized_checkpoint"):
        m = _check_dir(tmp_path, tiny, "gptq", group_size=32, desc_act=True, shared_perm=False)
    # q/k/v (and gate/up) have one input but different orders: that fused weight runs in float
    assert not isinstance(m.layers[0].self_attn.qkv_weight, (quant.QuantWeight, InputPermutedWeight))
    assert isinstance(m.layers[0].self_attn.o_weight, InputPermutedWeight)
    assert "dequantized to float" in caplog.text


@pytest.mark.parametrize("group_size", [128, 64, 32])
def test_awq_dir_greedy_equals_transformers_on_dequantized_dir(tmp_path, tiny, group_size):
    m = _check_dir(tmp_path, tiny, "awq", group_size=group_size, sym=False)
    assert m.layers[0].mlp.gate_up_weight.qtype == "q4_1"


def test_gptq_dir_in_bfloat16_runs_close_to_float(tmp_path, tiny):
    _check_dir(tmp_path, tiny, "gptq", atol=3e-2, dtype=torch.bfloat16, group_size=64, sym=False)


@pytest.mark.parametrize(
    "kw",
    [
        dict(ct_strategy="channel"),
        dict(ct_strategy="group"),
        dict(ct_strategy="tensor"),
        dict(ct_strategy="channel", scale_dtype=torch.bfloat16),
        dict(ct_strategy="channel", scale_dtype=torch.float32),
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_compressed_tensors_int8_dir_greedy_equals_transformers(tmp_path, tiny, kw):
    m = _check_dir(tmp_path, tiny, "compressed-tensors", **kw)
    assert m.layers[0].self_attn.qkv_weight.qtype == "q8_0"
    assert not isinstance(m.lm_head, quant.QuantWeight)  # in "ignore": float


def test_compressed_tensors_int8_float16_scales_are_repacked_exactly(tmp_path, tiny):
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    sd = quantize_dir(tiny, qdir, fdir, "compressed-tensors")
    m = load_model(qdir, torch.float32, "cpu")
    w = quant.dequantize(m.layers[1].mlp.down_weight)
    assert torch.equal(w, sd["model.layers.1.mlp.down_proj.weight"])


def test_compressed_tensors_fp8_dir_is_dequantized_at_load(tmp_path, tiny, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.quantized_checkpoint"):
        m = _check_dir(tmp_path, tiny, "compressed-tensors", ct_type="float", scale_dtype=torch.float32)
    assert "float8 e4m3 weights have no kernel: dequantized" in caplog.text
    assert not isinstance(m.layers[0].self_attn.qkv_weight, quant.QuantWeight)


def test_compressed_tensors_activation_quantization_is_logged_as_not_applied(tmp_path, tiny, caplog):
    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    quantize_dir(tiny, qdir, fdir, "compressed-tensors")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = act
    (qdir / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="kvserve.quantized_checkpoint"):
        m = load_model(qdir, torch.float32, "cpu")
    assert (
        "activation quantization (int8, dynamic per token) is not applied; running weight-only" in caplog.text
    )
    assert greedy(m, PROMPTS[0], 4) == hf_greedy(_load_hf(fdir), PROMPTS[0], 4)


def test_gptq_all_zero_bias_of_a_biasless_layer_is_accepted_and_nonzero_refused(tmp_path, tiny):
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    quantize_dir(tiny, qdir, fdir, "gptq")
    t = load_file(str(qdir / "model.safetensors"))
    t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64, dtype=torch.float16)
    save_file(t, str(qdir / "model.safetensors"))
    assert greedy(load_model(qdir, torch.float32, "cpu"), PROMPTS[0], 3) == hf_greedy(
        _load_hf(fdir), PROMPTS[0], 3
    )
    t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(t, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.bias'.*non-zero bias"):
        load_model(qdir, torch.float32, "cpu")


# ------------------------------------------------------------------ malformed checkpoints
def _edit_config(qdir, **changes):
    cfg = json.loads((qdir / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg["quantization_config"].pop(k, None)
        else:
            cfg["quantization_config"][k] = v
    (qdir / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(qdir, fn):
    t = load_file(str(qdir / "model.safetensors"))
    fn(t)
    save_file(t, str(qdir / "model.safetensors"))


@pytest.fixture()
def gptq_dir(tmp_path, tiny):
    qdir = tmp_path / "q"
    quantize_dir(tiny, qdir, tmp_path / "f", "gptq", group_size=32)
    return qdir


def test_gptq_8bit_asymmetric_is_refused_naming_the_tensor(tmp_path, tiny):
    qdir = tmp_path / "q"
    quantize_dir(tiny, qdir, tmp_path / "f", "gptq", bits=8, sym=False)
    with pytest.raises(
        ValueError, match=r"model.safetensors: tensor '.*qweight': 8-bit zero points must all be 128"
    ):
        load_model(qdir, torch.float32, "cpu")


@pytest.mark.parametrize("bits", [2, 3, 16])
def test_gptq_dir_with_unsupported_bits_is_refused_naming_the_file(gptq_dir, bits):
    _edit_config(gptq_dir, bits=bits)
    with pytest.raises(
        ValueError, match=rf"config.json: GPTQ quantization_config bits={bits} is not supported"
    ):
        load_model(gptq_dir, torch.float32, "cpu")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quant_method="bitsandbytes"), "quant_method='bitsandbytes' is not supported"),
        (dict(quant_method="hqq"), "quant_method='hqq' is not supported"),
        (dict(quant_method="exl2"), "quant_method='exl2' is not supported"),
        (dict(quant_method="marlin"), "quant_method='marlin' is not supported"),
        (dict(checkpoint_format="marlin"), "checkpoint_format='marlin' is not supported"),
        (dict(group_size=48), "group_size=48 is not supported"),
    ],
)
def test_unsupported_quantization_configs_are_refused_naming_the_field(gptq_dir, changes, message):
    _edit_config(gptq_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_config(gptq_dir)


def test_awq_unknown_version_and_no_zero_point_are_refused(tmp_path, tiny):
    qdir = tmp_path / "q"
    quantize_dir(tiny, qdir, tmp_path / "f", "awq")
    _edit_config(qdir, version="gemv")
    with pytest.raises(ValueError, match="AWQ quantization_config version='gemv' is not supported"):
        load_model(qdir, torch.float32, "cpu")
    _edit_config(qdir, version="GEMM", zero_point=False)
    with pytest.raises(ValueError, match="zero_point=False is not supported"):
        load_model(qdir, torch.float32, "cpu")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"),
            r"tensor 'model.layers.1.mlp.up_proj.qzeros' is missing",
        ),
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.scales"), r"k_proj.scales' is missing"),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.down_proj.scales", torch.ones(2, 64, dtype=torch.float16)
            ),
            r"down_proj.scales' has shape \(2, 64\), expected \(3, 64\)",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.qweight", torch.zeros(6, 64, dtype=torch.int32)
            ),
            r"q_proj.qweight'.*shape \(64, 48\), expected \(64, 64\)",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.qweight", torch.zeros(8, 64, dtype=torch.float16)
            ),
            r"q_proj.qweight' has dtype torch.float16, expected int32",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.g_idx", torch.full((64,), 9, dtype=torch.int32)
            ),
            r"g_idx values must lie in \[0, 2\)",
        ),
        (
            lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(torch.int8)),
            r"'lm_head.weight' is torch.int8 \(integer\), expected a float weight",
        ),
    ],
    ids=[
        "missing-qzeros",
        "missing-scales",
        "scales-shape",
        "qweight-shape",
        "qweight-dtype",
        "g_idx-range",
        "int-float",
    ],
)
def test_malformed_gptq_tensors_are_refused_naming_file_and_tensor(gptq_dir, edit, message):
    _edit_tensors(gptq_dir, edit)
    with pytest.raises(ValueError, match=message) as e:
        load_model(gptq_dir, torch.float32, "cpu")
    assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize(
    "group_changes, message",
    [
        ({"format": "pack-quantized"}, "format='pack-quantized'"),
        (
            {
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                }
            },
            "num_bits=4",
        ),
        (
            {"weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}},
            "symmetric=False",
        ),
        (
            {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "block"}},
            "strategy='block'",
        ),
        ({"weights": None}, "quantizes no weights"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_refused(tmp_path, tiny, group_changes, message):
    qdir = tmp_path / "q"
    quantize_dir(tiny, qdir, tmp_path / "f", "compressed-tensors")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"].update(group_changes)
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(qdir, torch.float32, "cpu")


def test_quantization_flag_must_match_the_checkpoint(tmp_path, tiny, gptq_dir):
    with pytest.raises(ValueError, match="already quantized \\(quant_method='gptq'\\); quantization='int8'"):
        load_model(gptq_dir, torch.float32, "cpu", quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(gptq_dir, torch.float32, "cpu", quantization="awq")
    load_model(gptq_dir, torch.float32, "cpu", quantization="gptq")  # the same method: fine
    fdir = tmp_path / "f"
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint quantized with it"):
        load_model(fdir, torch.float32, "cpu", quantization="gptq")


def test_quantized_checkpoint_flag_is_refused_with_tensor_parallelism():
    from kvserve.config import EngineArgs

    with pytest.raises(ValueError, match="quantization='awq' is not supported with tensor_parallel_size > 1"):
        EngineArgs(quantization="awq", tensor_parallel_size=2)


def test_llm_generates_from_a_gptq_dir_and_equals_transformers(tmp_path, tiny, default_tokenizer_dir):
    """End to end through the engine (the checkpoint's method detected from config.json)."""
    from transformers import AutoTokenizer

    from kvserve import LLM, SamplingParams

    qdir, fdir = tmp_path / "q", tmp_path / "f"
    quantize_dir(tiny, qdir, fdir, "gptq", group_size=32, sym=False, desc_act=True)
    AutoTokenizer.from_pretrained(default_tokenizer_dir).save_pretrained(qdir)
    llm = LLM(model=str(qdir), max_model_len=64)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    hf = _load_hf(fdir)
    for ids, out in zip(PROMPTS, outs):
        assert out.outcome == "finished"
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, ids, 5)
    with pytest.raises(ValueError, match="enable_lora is not supported with quantization='gptq'"):
        LLM(model=str(qdir), max_model_len=64, enable_lora=True)


@settings(max_examples=20, deadline=None)
@given(
    method=st.sampled_from(["gptq", "awq", "compressed-tensors"]),
    which=st.integers(0, 10_000),
    mutation=st.sampled_from(["drop", "shape", "dtype", "values"]),
    seed=st.integers(0, 2**16),
)
def test_corrupted_quantized_checkpoint_loads_or_raises_value_error(
    tmp_path_factory, tiny, method, which, mutation, seed
):
    """Fuzz: one tensor of a valid checkpoint dropped, reshaped, retyped or filled with random
    values: the load either succeeds or raises ValueError naming a tensor, never another error."""
    qdir = tmp_path_factory.mktemp("fuzz")
    quantize_dir(
        tiny, qdir, tmp_path_factory.mktemp("fuzzf"), method, group_size=32, desc_act=method == "gptq"
    )
    t = load_file(str(qdir / "model.safetensors"))
    name = sorted(t)[which % len(t)]
    g = torch.Generator().manual_seed(seed)
    if mutation == "drop":
        t.pop(name)
    elif mutation == "shape":
        n = t[name].numel()
        t[name] = t[name].reshape(-1)[: max(1, n - 8)].clone()
    elif mutation == "dtype":
        t[name] = t[name].to(torch.float16 if not t[name].dtype.is_floating_point else torch.int32)
    else:
        t[name] = torch.randint(-(2**31), 2**31 - 1, t[name].shape, generator=g, dtype=torch.int64).to(
            t[name].dtype
        )
    save_file(t, str(qdir / "model.safetensors"))
    try:
        m = load_model(qdir, torch.float32, "cpu")
    except ValueError as e:
        assert "tensor" in str(e) or "weight" in str(e), str(e)
        return
    prefill_logits(m, PROMPTS[1])  # a loaded model runs


def test_quantized_checkpoint_needs_float32_or_bfloat16(gptq_dir):
    with pytest.raises(ValueError, match="quantization 'gptq' needs dtype float32 or bfloat16"):
        load_model(gptq_dir, torch.float16, "cpu")
