"""Fused native kernels (RMSNorm, SiLU-and-mul, GELU-and-mul, greedy sampling) against their torch forms."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.rmsnorm import RMSNorm
from kvserve.ops import elementwise as ops

pytestmark = pytest.mark.skipif(not ops.available(), reason=f"native ops unavailable: {ops.failure_reason()}")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def torch_rms_norm(x, w, eps):
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return n.to(x.dtype) * w


@DTYPES
@pytest.mark.parametrize("T,H", [(1, 576), (300, 576), (5, 24), (3, 37)])  # 37, 24: scalar tails
def test_rms_norm_with_and_without_residual(T, H, dtype):
    torch.manual_seed(T + H)
    x = (torch.randn(T, H) * 3).to(dtype)
    r = torch.randn(T, H).to(dtype)
    w = torch.randn(H).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # one bfloat16 rounding of an O(1) value
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), torch_rms_norm(x, w, 1e-5).float(), atol=tol * 4, rtol=tol)
    r2 = r.clone()
    got = ops.rms_norm(x, w, 1e-5, residual=r2)
    s = x + r
    assert torch.equal(r2, s)  # the residual stream is updated exactly as torch adds
    assert torch.allclose(got.float(), torch_rms_norm(s, w, 1e-5).float(), atol=tol * 4, rtol=tol)


@DTYPES
def test_rmsnorm_module_uses_native_path_with_same_result(dtype, monkeypatch):
    torch.manual_seed(1)
    m = RMSNorm(64, 1e-6, dtype)
    m.weight.normal_()
    x, r = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    calls, real = [], ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    native_out, native_res = m(x, r.clone())
    assert calls, "the module did not take the native path"
    monkeypatch.setattr(ops, "supported", lambda *t: False)
    torch_out, torch_res = m(x, r.clone())
    assert torch.equal(native_res, torch_res)
    assert torch.allclose(
        native_out.float(), torch_out.float(), atol=1e-5 if dtype == torch.float32 else 0.05
    )


@DTYPES
def test_silu_and_mul_far_negative_gates(dtype):
    """Adversarial find: below -88 the clamped exp stopped cancelling the gate, so silu(-3e38)
    came out -1.8 instead of -0. Gates across the range (16 of them: the vector loop) against
    torch; -inf gives NaN like torch."""
    g = torch.tensor(
        [
            -3e38,
            -1e30,
            -1e5,
            -100.0,
            -89.0,
            -88.5,
            -50.0,
            -5.0,
            0.0,
            0.5,
            5.0,
            50.0,
            88.5,
            100.0,
            1e30,
            float("-inf"),
        ]
    )
    gu = torch.cat([g, torch.full_like(g, 1.5)]).view(1, -1).to(dtype)
    got, ref = ops.silu_and_mul(gu)[0].float(), (F.silu(gu[:, :16]) * gu[:, 16:])[0].float()
    assert torch.isnan(got[-1]) and torch.isnan(ref[-1])
    assert torch.allclose(got[:-1], ref[:-1], rtol=2**-7, atol=1e-30), (got, ref)


@DTYPES
@pytest.mark.parametrize("T,I", [(1, 1536), (64, 1536), (3, 40)])
def test_silu_and_mul(T, I, dtype):
    torch.manual_seed(T + I)
    gu = (torch.randn(T, 2 * I) * 4).to(dtype)
    ref = F.silu(gu[:, :I]) * gu[:, I:]
    got = ops.silu_and_mul(gu)
    assert got.shape == (T, I) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    else:  # both round silu to bfloat16 then the product: equal but for rare last-bit ties
        assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


@DTYPES
@pytest.mark.parametrize("T,I", [(1, 2048), (64, 96), (3, 40)])  # 40: the scalar tail
def test_gelu_tanh_and_mul(T, I, dtype):
    """Against torch's tanh GELU then mul, gates across the range: far negative ones (past the
    exp clamp) give -0 as torch's tanh does, -inf NaN."""
    torch.manual_seed(T + I)
    gu = (torch.randn(T, 2 * I) * 4).to(dtype)
    gu[0, :8] = torch.tensor([-3e38, -1e5, -60.0, -6.0, 0.0, 6.0, 1e5, float("-inf")]).to(dtype)
    ref = F.gelu(gu[:, :I], approximate="tanh") * gu[:, I:]
    got = ops.gelu_tanh_and_mul(gu)
    assert got.shape == (T, I) and got.dtype == dtype
    assert torch.isnan(got[0, 7]) and torch.isnan(ref[0, 7])
    got[0, 7] = ref[0, 7] = 0
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    else:  # both round the GELU to bfloat16 then the product: equal but for last-bit ties
        assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7
    with pytest.raises(ValueError, match="gelu_tanh_and_mul"):
        ops.gelu_tanh_and_mul(torch.zeros(2, 3, dtype=dtype))


def test_greedy_sample_matches_argmax_and_log_softmax():
    torch.manual_seed(3)
    for N, V in [(1, 49152), (64, 49152), (5, 1000), (3, 13)]:
        x = torch.randn(N, V) * 5
        x[0, V // 2] = x[0].max() + 1.0  # a clear winner in the middle
        if V > 40:
            x[-1, 7] = x[-1, 40] = x[-1].max() + 2.0  # a tie: the first index wins, as torch.argmax
        tok, lp = ops.greedy_sample(x)
        assert torch.equal(tok, x.argmax(-1))
        ref = torch.log_softmax(x, -1).gather(1, tok[:, None])[:, 0]
        assert torch.allclose(lp, ref, atol=1e-5), (lp - ref).abs().max()


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="silu_and_mul"):
        ops.silu_and_mul(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="greedy_sample"):
        ops.greedy_sample(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(torch.zeros(2, 4), torch.zeros(3), 1e-6)


@DTYPES
@pytest.mark.parametrize("H,KH,D", [(9, 3, 64), (4, 2, 40)])  # D=40: half=20, a scalar tail
def test_rope_write_kv_matches_torch_rotary_and_cache_write(H, KH, D, dtype):
    from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(H + D)
    T, NB, BS = 6, 10, 4
    rope = RotaryEmbedding(D, 128, {"rope_type": "default", "rope_theta": 10000.0}, dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 127])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(T, (H + 2 * KH) * D).to(dtype)
    cache = torch.zeros(2, KH, NB, BS, D, dtype=dtype)
    slots = torch.tensor([3, 0, 39, 12, 13, 22])
    got = ops.rope_write_kv(qkv, cos, sin, H, KH, D, cache, slots)
    ref = RotaryEmbedding.apply(qkv[:, : (H + KH) * D].view(T, H + KH, D), cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 2**-6
    assert torch.allclose(got.float(), ref.float(), atol=tol * 4, rtol=tol)
    flat = cache.view(2, KH, NB * BS, D)
    v = qkv[:, (H + KH) * D :].view(T, KH, D)
    for t in range(T):
        assert torch.equal(flat[0, :, slots[t]], got[t, H:])  # rotated k
        assert torch.equal(flat[1, :, slots[t]], v[t])  # v as projected
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, :, untouched].any()
    # Without a cache: rotation only.
    assert torch.equal(ops.rope_write_kv(qkv, cos, sin, H, KH, D, None, None), got)
    with pytest.raises(ValueError, match="rope_write_kv"):
        ops.rope_write_kv(qkv, cos, sin, H + 1, KH, D, cache, slots)


@DTYPES
@pytest.mark.parametrize("H,KH,D", [(9, 3, 64), (4, 2, 40), (2, 1, 256)])
def test_rope_write_kv_into_an_int8_cache_writes_kv_quant_rows(H, KH, D, dtype):
    """An int8 cache receives, at each token's slot, exactly the rows (codes and float16 scale
    bytes together) ``kv_quant.quantize`` makes from the rotated k and the v the unquantized
    call writes -- a zero row (the smallest scale) and tiny / huge rows (clamped scales)
    included; q/k come out as without a cache; other slots are untouched."""
    from kvserve.model_executor.layers import kv_quant
    from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(H + D + 1)
    T, NB, BS = 7, 10, 4
    rope = RotaryEmbedding(D, 128, {"rope_type": "default", "rope_theta": 10000.0}, dtype)
    cos, sin = rope.lookup(torch.tensor([0, 1, 5, 17, 63, 127, 90]))
    qkv = (torch.randn(T, (H + 2 * KH) * D) * 3).to(dtype)
    qkv[1, H * D :] = 0  # zero k and v rows
    qkv[2, H * D :] *= 1e-7  # scales below float16's normal range: clamped to 2**-14
    qkv[3, (H + KH) * D :] *= 1e7  # above 65504 * 127: clamped, codes saturate
    slots = torch.tensor([3, 0, 39, 12, 13, 22, 7])
    plain = torch.zeros(2, KH, NB, BS, D, dtype=dtype)
    want_qk = ops.rope_write_kv(qkv, cos, sin, H, KH, D, plain, slots)
    cache = torch.full((2, KH, NB, BS, D + 2), 5, dtype=torch.int8)
    assert ops.writes_cache(qkv, cos, sin, cache)
    got_qk = ops.rope_write_kv(qkv, cos, sin, H, KH, D, cache, slots)
    assert torch.equal(got_qk, want_qk)
    flat = cache.view(2, KH, NB * BS, D + 2)
    values = plain.view(2, KH, NB * BS, D)[:, :, slots]
    want = kv_quant.quantize(values.reshape(-1, D), torch.int8).view(2, KH, T, D + 2)
    assert torch.equal(flat[:, :, slots], want)
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[:, :, untouched] == 5).all()
    with pytest.raises(ValueError, match="rope_write_kv"):  # rows without their scale bytes
        ops.rope_write_kv(qkv, cos, sin, H, KH, D, cache[..., :D].contiguous(), slots)
    assert not ops.writes_cache(qkv, cos, sin, cache.view(torch.float8_e4m3fn))  # torch writes float8


def gemma_norm(dim: int, weight: torch.Tensor, eps: float):
    """transformers' Gemma 3 RMSNorm with ``weight`` (the offset from 1), the reference."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ref = Gemma3RMSNorm(dim, eps=eps).to(weight.dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
    return ref


def close_to(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32: to a few ulps; bfloat16: within one rounding of the value (the float32 sums may
    differ in order and land on the other side of a bfloat16 rounding)."""
    if got.dtype == torch.float32:
        return torch.allclose(got, want, rtol=4e-6, atol=1e-6)
    return torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-7)


@DTYPES
@pytest.mark.parametrize("T,H", [(1, 640), (300, 256), (3, 37)])  # 37: the scalar tail
def test_offset_rms_norm_matches_transformers_gemma_norm_and_residual_add(T, H, dtype):
    from kvserve.model_executor.layers.rmsnorm import OffsetRMSNorm

    torch.manual_seed(T + H)
    x = (torch.randn(T, H) * 3).to(dtype)
    add = torch.randn(T, H).to(dtype)
    norm = OffsetRMSNorm(H, 1e-6, dtype)
    norm.weight.normal_(0.0, 0.5)
    ref = gemma_norm(H, norm.weight, 1e-6)
    with torch.no_grad():
        want = ref(x)
        got = ops.offset_rms_norm(x, norm.scale(), 1e-6)
        assert got.dtype == dtype and close_to(got, want)
        # with the residual add: add + norm(x), the norm rounded to the dtype first
        got = ops.offset_rms_norm(x, norm.scale(), 1e-6, add=add)
        assert close_to(got, add + want)
        if dtype == torch.float32:
            assert (got - (add + want)).abs().max() < 1e-5
        else:  # one bfloat16 rounding of the sum apart at most
            assert (
                (got.float() - (add + want).float()).abs() <= 2**-7 * (add + want).float().abs() + 2**-7
            ).all()


@DTYPES
def test_offset_rms_norm_heads_in_place_normalises_only_its_columns(dtype):
    torch.manual_seed(3)
    T, H, KH, D = 5, 4, 2, 32
    qkv = (torch.randn(T, (H + 2 * KH) * D) * 2).to(dtype)
    w = torch.randn(D).to(dtype) * 0.3
    scale = 1.0 + w.float()
    before = qkv.clone()
    ops.offset_rms_norm_heads_(qkv, H * D, KH, scale, 1e-6)  # the k columns
    with torch.no_grad():
        want = gemma_norm(D, w, 1e-6)(before[:, H * D : (H + KH) * D].reshape(T, KH, D)).reshape(T, KH * D)
    assert close_to(qkv[:, H * D : (H + KH) * D], want)
    assert torch.equal(qkv[:, : H * D], before[:, : H * D])
    assert torch.equal(qkv[:, (H + KH) * D :], before[:, (H + KH) * D :])


@DTYPES
def test_offset_rmsnorm_module_native_path_equals_its_torch_path(dtype, monkeypatch):
    """The module's native passes (whole rows, the residual add, heads in place) against its
    own torch ops; its cached ``1 + weight`` follows a weight written in place."""
    from kvserve.model_executor.layers.rmsnorm import OffsetRMSNorm

    torch.manual_seed(2)
    m = OffsetRMSNorm(32, 1e-6, dtype)
    x, add = torch.randn(6, 32).to(dtype), torch.randn(6, 32).to(dtype)
    qkv = torch.randn(6, 4 * 32).to(dtype)
    first = m(x)
    m.weight.normal_()  # as loading does: in place
    calls, real = [], ops.offset_rms_norm
    monkeypatch.setattr(ops, "offset_rms_norm", lambda *a: calls.append(1) or real(*a))
    native, native_add, native_qkv = m(x), m(x, add=add), qkv.clone()
    m.normalize_heads_(native_qkv, 32, 2)
    assert calls, "the module did not take the native path"
    assert not torch.equal(first, native)  # the new weight was used
    monkeypatch.setattr(ops, "supported", lambda *t: False)
    plain, plain_add, plain_qkv = m(x), m(x, add=add), qkv.clone()
    m.normalize_heads_(plain_qkv, 32, 2)
    assert close_to(native, plain) and close_to(native_add, plain_add) and close_to(native_qkv, plain_qkv)
    assert torch.equal(native_qkv[:, :32], qkv[:, :32]) and torch.equal(native_qkv[:, 96:], qkv[:, 96:])


def test_offset_rms_norm_bad_inputs_are_errors_naming_the_kernel():
    with pytest.raises(ValueError, match="offset_rms_norm"):
        ops.offset_rms_norm(torch.zeros(2, 4), torch.zeros(3), 1e-6)
    with pytest.raises(ValueError, match="offset_rms_norm"):
        ops.offset_rms_norm(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="offset_rms_norm_heads_"):
        ops.offset_rms_norm_heads_(torch.zeros(2, 64), 40, 1, torch.zeros(32), 1e-6)
