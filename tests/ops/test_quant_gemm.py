"""The GGUF block-quantized kernels (``csrc/quant_gemm.c``) against dequantize-then-matmul in
float64 (Q8_0, Q4_0, Q4_1, and the K-quants Q4_K, Q5_K, Q6_K), the torch dequantization against
the ``gguf`` package's, and the wrapper's checks.

Tolerance (stated): with float32 activations ``|y - ref| <= 64 * eps32 * (|x| @ |W|^T)``
elementwise, ``ref`` the float64 product of ``x`` and the dequantized ``W`` (float32 sums
over K <= 1,024 terms, in a different order); bfloat16 adds the rounding of ``y`` to bfloat16
(``2^-8 |ref|``).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import quant

GGML = {t: GGMLQuantizationType[t.upper()] for t in quant.BLOCK_BYTES}
EPS32 = float(np.finfo(np.float32).eps)
native = pytest.mark.skipif(not quant.available(), reason="quant kernels unavailable")


K_QUANTS = ("q4_k", "q5_k", "q6_k")


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """These tests check the float-activation kernels (``tile``, ``panel``): int8 activations
    have their own reference (test_quant_act8.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


def random_kquant_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """``[n, k / 256 * block_bytes]`` random K-quant blocks (the gguf package cannot quantize
    to them): random quants, sub-block scales and high bits, float16 super-scales ~0.01."""
    bb, nb = quant.BLOCK_BYTES[qtype], k // 256
    data = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    d = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if qtype == "q6_k":
        data[..., 208:210] = d
    else:
        data[..., 0:2] = d
        dmin = np.abs(rng.standard_normal((n, nb)) * 0.01).astype(np.float16)
        data[..., 2:4] = dmin.view(np.uint8).reshape(n, nb, 2)
    return data.reshape(n, -1)


def make_weight(qtype: str, n: int, k: int, seed: int) -> tuple[quant.QuantWeight, np.ndarray]:
    """A random ``[n, k]`` weight quantized by the gguf package (random blocks for the
    K-quants), and its float64 dequantization by the gguf package."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        q = random_kquant_blocks(qtype, n, k, rng)
    else:
        q = quantize(rng.standard_normal((n, k)).astype(np.float32), GGML[qtype])
    wd = dequantize(q, GGML[qtype]).astype(np.float64).reshape(n, k)
    return quant.QuantWeight(torch.from_numpy(np.array(q)), qtype, k), wd


def check_linear(qtype, m, n, k, seed, dtype=torch.float32, bias=True):
    qw, wd = make_weight(qtype, n, k, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = quant.linear(x, qw, b)
    assert y.shape == (m, n) and y.dtype == dtype
    xd = x.double().numpy()
    ref = xd @ wd.T + (0 if b is None else b.double().numpy())
    tol = 64 * EPS32 * (np.abs(xd) @ np.abs(wd).T) + 1e-30
    if dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * np.abs(ref)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"{qtype} {m}x{n}x{k}: worst {float((err / tol).max()):.2f} x tolerance"


@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
def test_dequantize_blocks_equals_the_gguf_package(qtype):
    qw, wd = make_weight(qtype, 37, 3 * quant.BLOCK_WEIGHTS[qtype], 1)
    assert np.array_equal(quant.dequantize(qw).numpy(), wd.astype(np.float32))


@native
@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 32),
        (1, 7, 64),
        (3, 5, 96),
        (8, 3, 32),
        (9, 25, 160),
        (17, 48, 576),
        (1, 576, 576),
        (64, 13, 1024),
    ],
)
def test_quant_linear_equals_dequantize_then_matmul(qtype, m, n, k):
    """Ragged row tiles (m not a multiple of 8), ragged column tiles (n not a multiple of 3),
    one block and many blocks per row (K-quants: k rounded up to superblocks of 256)."""
    k = -(-k // quant.BLOCK_WEIGHTS[qtype]) * quant.BLOCK_WEIGHTS[qtype]
    check_linear(qtype, m, n, k, seed=m * 1000 + n + k)


@native
@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
def test_quant_linear_bfloat16_activations(qtype):
    k = quant.BLOCK_WEIGHTS[qtype]
    check_linear(qtype, 11, 29, 6 * k, seed=3, dtype=torch.bfloat16)
    check_linear(qtype, 1, 8, 2 * k, seed=4, dtype=torch.bfloat16, bias=False)


@native
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(sorted(quant.BLOCK_BYTES)),
    m=st.integers(1, 20),
    n=st.integers(1, 40),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
    bias=st.booleans(),
)
def test_quant_linear_property_random_shapes(qtype, m, n, blocks, seed, bf16, bias):
    k = quant.BLOCK_WEIGHTS[qtype] * (blocks if qtype not in K_QUANTS else 1 + blocks % 3)
    check_linear(qtype, m, n, k, seed, torch.bfloat16 if bf16 else torch.float32, bias)


@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
def test_torch_fallback_equals_the_kernel_reference(qtype, monkeypatch):
    monkeypatch.setattr(quant, "available", lambda: False)
    k = quant.BLOCK_WEIGHTS[qtype]
    check_linear(qtype, 5, 9, 2 * k, seed=7)
    qw, wd = make_weight(qtype, 10, k, 2)
    e = quant.embedding(torch.tensor([9, 0, 3]), qw, torch.float32)
    assert np.array_equal(e.numpy(), wd[[9, 0, 3]].astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_embedding_rows_are_the_dequantized_rows(qtype, dtype):
    k = 3 * quant.BLOCK_WEIGHTS[qtype]
    qw, wd = make_weight(qtype, 50, k, 5)
    ids = torch.tensor([0, 49, 7, 7, 23])
    e = quant.embedding(ids, qw, dtype)
    assert e.dtype == dtype
    assert torch.equal(e, torch.from_numpy(wd[ids.numpy()].astype(np.float32)).to(dtype))
    assert quant.embedding(torch.tensor([], dtype=torch.int64), qw, dtype).shape == (0, k)
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        quant.embedding(torch.tensor([50]), qw, dtype)
    with pytest.raises(IndexError):
        quant.embedding(torch.tensor([-1]), qw, dtype)


def test_quant_weight_and_linear_reject_bad_input():
    with pytest.raises(ValueError, match="iq2_xs"):
        quant.QuantWeight(torch.zeros(2, 20, dtype=torch.uint8), "iq2_xs", 32)
    with pytest.raises(ValueError, match="q4_k in_features=32 is not a positive multiple of 256"):
        quant.QuantWeight(torch.zeros(2, 18, dtype=torch.uint8), "q4_k", 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.QuantWeight(torch.zeros(2, 20, dtype=torch.uint8), "q4_1", 48)
    with pytest.raises(ValueError, match=r"\[out, 40\]"):
        quant.QuantWeight(torch.zeros(2, 20, dtype=torch.uint8), "q4_1", 64)
    qw, _ = make_weight("q4_1", 4, 64, 0)
    with pytest.raises(ValueError, match="do not fit"):
        quant.linear(torch.randn(2, 32), qw)
    with pytest.raises(ValueError, match="do not fit"):
        quant.linear(torch.randn(2, 64, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match="do not fit"):
        quant.linear(torch.randn(2, 64), qw, torch.randn(3))
