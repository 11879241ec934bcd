"""The int8-activation kernels on the K-quants Q4_K and Q6_K (``csrc/quant_dot8_k.h``) against
the float64 references of test_quant_act8.py: act8 against ``xq @ W^T`` (the int8-quantized
activations times the dequantized weight, within float32 rounding of the scaled integer sums),
act16 against the float activations (within ``d / 508`` per element). Shapes: rows 1..16,
``in_features`` multiples of 256, odd and even ``out_features``; random and extreme codes and
scales. The AVX2 and scalar builds: test_quant_act8.py's fallback test (it runs every type of
``ACT8_TYPES``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import quant
from tests.ops.test_quant_act8 import check_act8, check_act16, k4_scales_mins
from tests.ops.test_quant_gemm import make_weight

native = pytest.mark.skipif(not quant.available(), reason="quant kernels unavailable")
KQ = ("q4_k", "q6_k")


def random_k_blocks(qtype: str, n: int, nb: int, rng, extreme: str = "") -> np.ndarray:
    """``[n, nb * block_bytes]`` K-quant blocks: every code and sub-scale byte random, float16
    super-scales of mixed magnitude and sign (Q4_K's dmin too; some zero). ``extreme``: "max"
    sets every code and sub-scale to its largest (Q4_K codes 15, scales and minima 63; Q6_K codes
    63, sub-scales 127), "min" to its smallest (Q4_K codes 0; Q6_K codes 0, i.e. -32, sub-scales
    -128)."""
    bb = quant.BLOCK_BYTES[qtype]
    data = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    big = {"max": 0xFF, "min": 0x00}.get(extreme)
    if big is not None:
        if qtype == "q4_k":
            data[..., 4:16] = 0xFF  # scales and minima 63 either way (all their bits set)
            data[..., 16:144] = big
        else:
            data[..., 0:192] = big
            data[..., 192:208] = np.uint8(127) if extreme == "max" else np.uint8(128)
    scale = rng.standard_normal((n, nb, 2)) * 10.0 ** rng.integers(-4, 1, (n, nb, 2))
    scale[rng.random((n, nb, 2)) < 0.1] = 0
    s16 = scale.astype(np.float16).view(np.uint8).reshape(n, nb, 4)
    if qtype == "q6_k":
        data[..., 208:210] = s16[..., 0:2]
    else:
        data[..., 0:4] = s16
    return data.reshape(n, -1)


def test_extreme_blocks_hold_the_extreme_codes():
    """The helper's "max" Q4_K blocks do decode to scales and minima of 63 (the test of the
    kernels' bounds relies on it)."""
    b = random_k_blocks("q4_k", 2, 3, np.random.default_rng(0), "max").reshape(2, 3, 144)
    sc, m = k4_scales_mins(b[..., 4:16])
    assert (sc == 63).all() and (m == 63).all()


@native
@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_act8_equals_float64_of_the_int8_activations_rows_1_to_16(qtype, dtype, threads):
    """37 columns (not a multiple of the 4-column tile), 3 superblocks, rows 1..16 (tile tails
    of 1-3 rows); also 1 and 8 columns."""
    g = torch.Generator().manual_seed(2)
    for n, k in ((37, 768), (1, 256), (8, 512)):
        qw, wd = make_weight(qtype, n, k, seed=n)
        bias = torch.randn(n, generator=g).to(dtype)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16):
            x = torch.randn(m, k, generator=g).to(dtype)
            check_act8(qw, wd, x, bias if m % 2 else None, threads)


@native
@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("threads", [1, 2])
def test_act16_is_within_d_over_508_of_the_float_activations(qtype, threads):
    qw, wd = make_weight(qtype, 37, 512, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(37, generator=g)
    for m in (1, 3, 4, 5, 16):
        check_act16(qw, wd, torch.randn(m, 512, generator=g) * 4, bias if m % 2 else None, threads)


@native
@pytest.mark.parametrize("qtype", KQ)
@pytest.mark.parametrize("extreme", ["max", "min"])
def test_extreme_codes_and_scales_with_saturated_activations(qtype, extreme):
    """Every code and sub-scale at its largest or smallest, activations constant (every int8
    activation +-127): the largest integer lanes the kernels can produce (quant_dot8_k.h's
    bound), exact against the reference."""
    rng = np.random.default_rng(5)
    n, nb = 13, 2
    qw = quant.QuantWeight(torch.from_numpy(random_k_blocks(qtype, n, nb, rng, extreme)), qtype, 256 * nb)
    wd = quant.dequantize(qw).double().numpy()
    for v in (3.0, -0.5):
        x = torch.full((3, 256 * nb), v)
        x[1, ::2] = -v  # alternating signs: the per-16 / per-32 activation sums cancel
        check_act8(qw, wd, x)
        check_act16(qw, wd, x)


@native
@settings(max_examples=30, deadline=None)
@given(
    qtype=st.sampled_from(KQ),
    m=st.integers(1, 16),
    n=st.integers(1, 11),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
    xkind=st.sampled_from(["normal", "tiny", "huge", "sparse", "constant"]),
)
def test_act8_property_random_blocks_and_activations(qtype, m, n, blocks, seed, bf16, xkind):
    """Arbitrary block bytes (every code, sub-scale and minimum) and activations that are tiny,
    huge, mostly zero (zero blocks: d = 0) or constant (every q = +-127)."""
    rng = np.random.default_rng(seed)
    k = 256 * blocks
    qw = quant.QuantWeight(torch.from_numpy(random_k_blocks(qtype, n, blocks, rng)), qtype, k)
    wd = quant.dequantize(qw).double().numpy()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x = {"tiny": x * 1e-30, "huge": x * 1e30, "sparse": x * torch.from_numpy(rng.random((m, k)) < 0.05)}.get(
        xkind, torch.full((m, k), float(rng.standard_normal())) if xkind == "constant" else x
    )
    check_act8(qw, wd, x.to(torch.bfloat16) if bf16 else x)


@native
def test_the_int8_mode_runs_them_and_differs_from_float_by_the_activation_rounding(monkeypatch):
    """``linear`` in the int8 mode picks act8 for both K-quants; the result moves from the float
    kernel's by at most half an activation step per element ((d_x / 2) @ |W|^T), and does move."""
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    monkeypatch.setenv(quant.AMX_ENV, "0")
    for qtype in KQ:
        qw, wd = make_weight(qtype, 21, 512, seed=9)
        x = torch.randn(2, 512)
        assert quant.pick_kernel(2, qtype) == "act8"
        _, d = quant.quantize_activations(x)
        bound = (d.double().repeat_interleave(32, dim=1).numpy() / 2) @ np.abs(wd).T
        diff = (quant.linear(x, qw) - quant.linear(x, qw, kernel="tile")).double()
        assert (diff.abs().numpy() <= bound * 1.001 + 1e-6).all()
        assert float(diff.abs().max()) > 0
