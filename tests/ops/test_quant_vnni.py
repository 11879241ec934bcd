"""The VNNI many-row kernel of the quantized linear layers (``quant.linear(kernel="vnni")``,
``csrc/quant_vnni.h``): Q8_0 / Q4_1 weights in their x4 copy repacked per call into int8
panels, int8 activations per 32-block, integer sums with vpdpbusd.

Reference: the float64 product of the quantized activations (``quantize_activations``) and the
dequantized weights, within the act8 kernels' float32 bound (``check_act8``): the integer sums
are exact, so only the float32 scaling of the block sums rounds. Also: a row's result does not
depend on the batch it came in or the thread count (bit for bit: each row's block sums
accumulate in one fixed order), which kernel ``pick_kernel`` and ``head_kernel`` choose, and
the refusal of a weight type without an x4 layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.ops import quant
from tests.ops.test_quant_act8 import check_act8, random_blocks

vnni = pytest.mark.skipif(
    quant.act8_isa() != "avx512-vnni", reason="kernels not built with AVX-512 VNNI (or none)"
)


def weight(qtype: str, n: int, nb: int, seed: int, x4_only: bool = False):
    rng = np.random.default_rng(seed)
    qw = quant.QuantWeight(torch.from_numpy(random_blocks(qtype, n, nb, rng)), qtype, 32 * nb)
    wd = quant.dequantize(qw).double().numpy()
    if x4_only:
        qw.drop_gguf()
        assert qw.layout == "x4"
    return qw, wd


@vnni
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(quant.VNNI_TYPES),
    m=st.integers(1, 70),
    n=st.integers(1, 120),
    nb=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    threads=st.integers(1, 2),
    bf16=st.booleans(),
    bias=st.booleans(),
)
@example("q4_1", 5, 49, 3, 1, 2, False, True)  # one ragged panel (49 = 48 + 1), an odd block count
@example("q8_0", 17, 97, 1, 2, 2, True, False)  # a 4-row tail, a lone block, a partial group of four
def test_vnni_equals_float64_of_the_int8_activations_on_ragged_shapes(
    qtype, m, n, nb, seed, threads, bf16, bias
):
    qw, wd = weight(qtype, n, nb, seed, x4_only=qtype == "q4_1" and seed % 2 == 0)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(m, 32 * nb, generator=g) * 10.0 ** (seed % 5 - 2)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    check_act8(qw, wd, x, b, threads=threads, kernel="vnni")


@vnni
@pytest.mark.parametrize("qtype", quant.VNNI_TYPES)
@pytest.mark.parametrize(
    "m,n,k",
    [(64, 576, 576), (64, 192, 576), (16, 1536, 576), (64, 576, 1536), (300, 50, 1536), (700, 96, 576)],
)
def test_vnni_on_the_model_shapes_and_row_chunks_equals_the_reference(qtype, m, n, k):
    """The decode layers' shapes, and more rows than one ~256 KB chunk of quantized activations
    (K = 1,536: 136 rows a chunk; K = 576: 340), each panel repacked per chunk."""
    qw, wd = weight(qtype, n, k // 32, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    check_act8(qw, wd, x, torch.randn(n), threads=2, kernel="vnni")


@vnni
@pytest.mark.parametrize("qtype", quant.VNNI_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_row_result_is_independent_of_batch_and_threads(qtype, dtype):
    qw, _ = weight(qtype, 101, 18, seed=7)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    torch.set_num_threads(1)
    try:
        full = quant.linear(x, qw, kernel="vnni")
        torch.set_num_threads(2)
        assert torch.equal(quant.linear(x, qw, kernel="vnni"), full)
        for lo, hi in [(0, 16), (3, 22), (21, 40), (39, 40)]:
            assert torch.equal(quant.linear(x[lo:hi], qw, kernel="vnni"), full[lo:hi]), (lo, hi)
    finally:
        torch.set_num_threads(1)


@vnni
def test_pick_kernel_takes_vnni_from_vnni_rows_in_the_int8_mode_but_not_for_the_head(monkeypatch):
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    monkeypatch.setenv(quant.AMX_ENV, "0")
    rows = quant.PANEL_ROWS
    for qtype in quant.VNNI_TYPES:
        low = quant.VNNI_ROWS[qtype]
        assert 1 < low <= rows
        assert [quant.pick_kernel(r, qtype) for r in (low - 1, low, rows, 300)] == ["act8"] + ["vnni"] * 3
        # never one int8 plane for the logits: act16 below the panel rows, the panels from there
        assert [quant.head_kernel(r, qtype) for r in (low - 1, low, rows)] == ["act16", "act16", "panel"]
        # bfloat16 activations: int8 for decode-sized steps only, float panels for prefills
        top = quant.VNNI_BF16_MAX_ROWS
        assert [quant.pick_kernel(r, qtype, torch.bfloat16) for r in (low - 1, low, top, top + 1, 300)] == [
            "act8",
            "vnni",
            "vnni",
            "panel",
            "panel",
        ]
        # the bytes read follow the same choice (the panels read Q8_0's GGUF bytes, not x4)
        qw, _ = weight(qtype, 8, 2, seed=3)
        assert quant.weight_attr(qw, 300, dtype=torch.bfloat16) == "data"
        assert quant.weight_attr(qw, 300) == "x4"
    for qtype in ("q4_0", "q4_k", "q6_k"):  # no x4 layout: the float panels
        assert quant.pick_kernel(rows, qtype) == "panel"
    monkeypatch.setenv(quant.X4_ENV, "0")  # Q4_1 on its GGUF bytes: no x4 copy to read
    assert quant.pick_kernel(rows, "q4_1") == "panel"
    assert quant.pick_kernel(rows, "q8_0") == "vnni"
    monkeypatch.setenv(quant.VNNI_ENV, "0")
    assert quant.pick_kernel(rows, "q8_0") == "panel"
    monkeypatch.setenv(quant.VNNI_ENV, "1")
    monkeypatch.setenv(quant.ACT_ENV, "float")  # the float mode keeps float activations
    assert quant.pick_kernel(64, "q8_0") == "panel"


@vnni
def test_vnni_refuses_a_weight_type_without_the_x4_layout():
    qw, _ = weight("q4_0", 8, 2, seed=1)
    with pytest.raises(ValueError, match="vnni"):
        quant.linear(torch.randn(16, 64), qw, kernel="vnni")


@vnni
@pytest.mark.parametrize("qtype", quant.VNNI_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["vnni", "act8", "act16"])
def test_a_nonfinite_or_subnormal_activation_block_stays_in_its_row(qtype, dtype, kernel):
    """A NaN anywhere in a 32-block (also where the max of |x| would skip it) or an infinity makes
    the block's scale NaN / inf and its quants 0, so that row's outputs are all NaN (as the float
    kernels' NaN in, NaN out) rather than finite values of wrapped integer sums; a block whose
    scale max|x| / 127 is subnormal (1 / d would overflow) quantizes to zero, as an all-zero block.
    The other rows are bit for bit those of a batch without the odd rows."""
    qw, _ = weight(qtype, 50, 3, seed=11)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(5))
    x[2, 20] = float("nan")  # in the second 16 of block 0
    x[4, 37] = float("nan")  # in the first 16 of block 1
    x[5, 70] = float("inf")
    x[6, 64] = -float("inf")
    x[7, :32] = torch.linspace(-1e-39, 1e-39, 32)  # d ~ 8e-42: subnormal
    x = x.to(dtype)
    y = quant.linear(x, qw, kernel=kernel)
    for r in (2, 4, 5, 6):
        assert torch.isnan(y[r]).all(), (r, y[r])
    zeroed = x[7:8].clone()
    zeroed[0, :32] = 0
    assert torch.equal(y[7:8], quant.linear(zeroed, qw, kernel=kernel))
    keep = [0, 1, 3, 8]
    assert torch.equal(y[keep], quant.linear(x[keep], qw, kernel=kernel)[: len(keep)])
    assert torch.isfinite(y[keep]).all()
    # the torch reference of the activations agrees: quants 0 in those blocks, d NaN / inf
    q, d = quant.quantize_activations(x.float())
    assert (q[[2, 4, 5, 6, 7]].reshape(5, 3, 32)[[0, 1, 2, 3, 4], [0, 1, 2, 2, 0]] == 0).all()
    assert d[2, 0].isnan() and d[4, 1].isnan() and d[5, 2].isinf() and d[6, 2].isinf()
