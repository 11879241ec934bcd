"""The AMX kernel of the quantized linear layers (``quant.linear(kernel="amx")``,
``csrc/quant_amx.h``): weights dequantized into bfloat16 tiles, float32 sums.

Reference: float64 ``x @ dequantize(W)^T + b``. Tolerance, per output (derived in
``quant_amx.h``): the kernel rounds every weight ``w = d q (+ m)`` (float32) and every float32
activation to bfloat16 (nearest even, unit roundoff ``u = 2^-8``), so each product is off by at
most ``(2 u + u^2) |x w|`` (``u |x w|`` with bfloat16 ``x``, already exact), and the float32
sum of the ``K`` products and the bias adds at most ``(K + 1) 2^-24 sum |x w|``; a bfloat16
output is rounded once more (``u |y|``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import quant
from tests.ops.test_quant_gemm import K_QUANTS, make_weight

U = 2.0**-8
amx = pytest.mark.skipif(not quant.amx_supported(), reason="no AMX tiles here (or no kernels)")


def amx_bound(xd: np.ndarray, wd: np.ndarray, ref: np.ndarray, x_dtype, y_dtype) -> np.ndarray:
    """The per-output error bound of the module docstring."""
    k = xd.shape[1]
    per_product = (2 * U + U * U) if x_dtype == torch.float32 else U
    tol = (np.abs(xd) @ np.abs(wd).T) * (per_product + (k + 1) * 2.0**-24) + 1e-30
    if y_dtype == torch.bfloat16:
        tol = tol + U * (np.abs(ref) + tol)
    return tol


def check_amx(qtype, m, n, k, seed, dtype=torch.float32, bias=True, x4=False):
    qw, wd = make_weight(qtype, n, k, seed)
    if x4:
        qw.drop_gguf()  # only the x4 copy: the kernel reads that layout
        assert qw.layout == "x4"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = quant.linear(x, qw, b, kernel="amx")
    assert y.shape == (m, n) and y.dtype == dtype
    xd = x.double().numpy()
    ref = xd @ wd.T + (0 if b is None else b.double().numpy())
    tol = amx_bound(xd, wd, ref, dtype, dtype)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"{qtype} {m}x{n}x{k}: worst {float((err / tol).max()):.2f} x tolerance"
    return float((err / tol).max())


@amx
@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 1, 32),  # fewer rows than a token tile, one weight row
        (16, 32, 32),  # one tile of each
        (17, 33, 64),  # a 16-row tail and a ragged last group (one valid row)
        (40, 77, 96),  # 32 + 8 rows, 77 columns (a partial group of four in the x4 layout)
        (64, 200, 576),  # the decode shapes: K = 576, two groups per thread and more
        (300, 50, 1536),  # more rows than one L2 block of x (256), K = 1,536
    ],
)
def test_amx_kernel_equals_dequantize_then_matmul_within_the_bfloat16_bound(qtype, dtype, m, n, k):
    k = -(-k // quant.BLOCK_WEIGHTS[qtype]) * quant.BLOCK_WEIGHTS[qtype]
    check_amx(qtype, m, n, k, seed=m * 1000 + n + k, dtype=dtype)


@amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(16, 32, 32), (17, 77, 96), (64, 200, 576), (300, 50, 1536), (5, 3, 64)])
def test_amx_kernel_on_the_q4_1_x4_layout(dtype, m, n, k):
    """A Q4_1 GEMM weight keeps only its x4 copy in the int8 mode: the kernel's table lookup of
    the nibbles reads that layout (rows past ``n`` in the last group of four are zero)."""
    check_amx("q4_1", m, n, k, seed=m + n + k, dtype=dtype, bias=m % 2 == 0, x4=True)


@amx
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(sorted(quant.BLOCK_BYTES)),
    m=st.integers(1, 70),
    n=st.integers(1, 70),
    blocks=st.integers(1, 20),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
    bias=st.booleans(),
    x4=st.booleans(),
)
def test_amx_kernel_property_random_shapes(qtype, m, n, blocks, seed, bf16, bias, x4):
    k = quant.BLOCK_WEIGHTS[qtype] * (blocks if qtype not in K_QUANTS else 1 + blocks % 3)
    check_amx(qtype, m, n, k, seed, torch.bfloat16 if bf16 else torch.float32, bias, x4 and qtype == "q4_1")


@amx
def test_the_bound_is_tight_enough_to_catch_a_float_kernel_or_a_wrong_weight():
    """The bound is not loose: the float32 panels sit far inside it, the AMX result uses a good
    part of it (its bfloat16 roundings), and a kernel with the halves of each block swapped
    (the low / high nibble order mixed up) would be far outside."""
    qw, wd = make_weight("q4_1", 64, 576, seed=5)
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(5))
    xd = x.double().numpy()
    ref = xd @ wd.T
    tol = amx_bound(xd, wd, ref, torch.float32, torch.float32)
    panel = quant.linear(x, qw, kernel="panel").double().numpy()
    got = quant.linear(x, qw, kernel="amx").double().numpy()
    assert float((np.abs(panel - ref) / tol).max()) < 0.02
    assert 0.05 < float((np.abs(got - ref) / tol).max()) <= 1.0
    swapped = wd.reshape(64, -1, 2, 16)[:, :, ::-1].reshape(64, 576)
    assert (np.abs(got - xd @ swapped.T) > tol).mean() > 0.5


@amx
@pytest.mark.parametrize("kernel", ["amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_give_an_empty_result(kernel, dtype):
    qw, _ = make_weight("q8_0", 5, 64, seed=0)
    y = quant.linear(torch.empty(0, 64, dtype=dtype), qw, kernel=kernel)
    assert y.shape == (0, 5) and y.dtype == dtype


@amx
def test_pick_kernel_runs_amx_from_its_rows_in_the_int8_mode_only(monkeypatch):
    monkeypatch.delenv(quant.AMX_ENV, raising=False)
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    assert quant.amx_enabled()
    for qtype in quant.AMX_TYPES:
        r = quant.AMX_ROWS[qtype]
        assert quant.pick_kernel(r, qtype) == "amx"
        assert quant.pick_kernel(300, qtype) == "amx"
        assert quant.pick_kernel(r - 1, qtype) != "amx"
    assert quant.AMX_ROWS["q4_1"] <= quant.AMX_ROWS["q8_0"] <= quant.PANEL_ROWS
    # the LM head too (a Q8_0 table), from the same rows
    assert quant.head_kernel(quant.AMX_ROWS["q8_0"], "q8_0") is None
    assert quant.head_kernel(quant.AMX_ROWS["q8_0"] - 1, "q8_0") == "act16"
    # which bytes it reads: Q4_1 holding only x4 -> x4; otherwise the GGUF blocks
    q41, _ = make_weight("q4_1", 8, 64, seed=0)
    q8, _ = make_weight("q8_0", 8, 64, seed=0)
    assert quant.weight_attr(q41, 64) == "data" and quant.weight_attr(q8, 64) == "data"
    q41.drop_gguf()
    assert quant.weight_attr(q41, 64) == "x4"
    # the switch: the old routes (panels from PANEL_ROWS, int8 GEMV below; the VNNI many-row
    # kernel off too: test_quant_vnni.py)
    monkeypatch.setenv(quant.AMX_ENV, "0")
    monkeypatch.setenv(quant.VNNI_ENV, "0")
    assert not quant.amx_enabled()
    assert quant.pick_kernel(64, "q4_1") == "panel"
    assert quant.pick_kernel(quant.AMX_ROWS["q4_1"], "q4_1") == "act8"
    monkeypatch.setenv(quant.AMX_ENV, "1")
    # the float mode keeps dequantize-then-matmul up to float32 rounding: no AMX
    monkeypatch.setenv(quant.ACT_ENV, "float")
    assert not quant.amx_enabled()
    assert quant.pick_kernel(64, "q8_0") == "panel"


@amx
@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_linear_routes_both_ways_and_the_results_differ_only_by_the_bfloat16_rounding(qtype, monkeypatch):
    """The default route at 64 rows is the AMX kernel; with ``KVSERVE_QUANT_AMX=0`` it is the
    float panels again (bit-identical to ``kernel="panel"``; the VNNI many-row kernel off)."""
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    monkeypatch.setenv(quant.VNNI_ENV, "0")
    qw, wd = make_weight(qtype, 96, 192, seed=2)
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(2))
    on = quant.linear(x, qw)
    assert torch.equal(on, quant.linear(x, qw, kernel="amx"))
    monkeypatch.setenv(quant.AMX_ENV, "0")
    off = quant.linear(x, qw)
    assert torch.equal(off, quant.linear(x, qw, kernel="panel"))
    assert not torch.equal(on, off)
    xd = x.double().numpy()
    ref = xd @ wd.T
    assert (np.abs(on.double().numpy() - ref) <= amx_bound(xd, wd, ref, torch.float32, torch.float32)).all()


def test_without_amx_the_panels_run_and_a_forced_amx_kernel_is_refused(monkeypatch):
    """A CPU or kernel build without AMX: ``amx_supported()`` False (simulated here on any
    machine), so the routes are the old ones and ``kernel="amx"`` is a clear error."""
    monkeypatch.setattr(quant, "_amx_ok", False)
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    monkeypatch.setenv(quant.VNNI_ENV, "0")  # (the VNNI route: test_quant_vnni.py)
    assert not quant.amx_enabled()
    assert quant.pick_kernel(64, "q4_1") == "panel"
    assert quant.pick_kernel(quant.PANEL_ROWS - 1, "q8_0") == "act8"
    if not quant.available():
        return
    qw, wd = make_weight("q4_1", 40, 96, seed=1)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(1))
    y = quant.linear(x, qw)
    assert torch.equal(y, quant.linear(x, qw, kernel="panel"))
    with pytest.raises(ValueError, match="needs AMX"):
        quant.linear(x, qw, kernel="amx")
