"""The int8-activation kernels (``quant_gemm_act8_*``) and the dequantized-panel kernels
(``quant_gemm_panel_*``) of ``csrc/quant_gemm.c``, and how ``quant.linear`` picks them.

References (float64):
- act8: ``xq @ W^T`` with ``xq = q * d`` the int8-quantized activations
  (``quant.quantize_activations``, bit-identical to the kernel's step) and ``W`` the
  dequantized weight. The kernel sums exact integer dot products scaled in float32, with the
  weight offset of its pair layout (``quant_dot8.h``: up to 128 per quant; the K-quants'
  minima and Q6_K's 32, ``quant_dot8_k.h``) folded into float32 sums, so
  ``|y - ref| <= 64 eps32 (|xq| @ (|W| + O)^T)`` elementwise, ``O`` the folded term's size per
  weight (``offset_terms``).
- panel: ``x @ W^T`` as the float tests of test_quant_gemm.py (float32 sums in another order).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import cpu, quant
from tests.ops.test_quant_gemm import EPS32, make_weight

native = pytest.mark.skipif(not quant.available(), reason="quant kernels unavailable")
#: The 32-weight block types of ``ACT8_TYPES`` (the K-quants, 256 per block: test_quant_act8_k.py).
ACT8 = tuple(t for t in quant.ACT8_TYPES if quant.BLOCK_WEIGHTS[t] == 32)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _f16(b: np.ndarray) -> np.ndarray:
    """float64 of the float16 held in the last axis' 2 bytes."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and minima ``[..., 8]`` of Q4_K's 12 packed bytes ``s``
    ``[..., 12]`` (ggml-common.h's layout, as csrc/quant_gemm.c's scale_min_k4)."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def offset_terms(qw: quant.QuantWeight) -> np.ndarray:
    """``[n, K]`` float64: per weight, the size of the term the act8 kernels fold into float32
    sums besides the weight itself: 32-weight blocks ``128 |d|`` (the pair layout's offset, at
    most 128); Q4_K ``16 |d sc| + |dmin m|`` (codes up to 15 times the sub-scale, the minimum);
    Q6_K ``32 |d sc|`` (its offset of 32)."""
    n, bb = qw.out_features, quant.BLOCK_BYTES[qw.qtype]
    b = qw.data.numpy().reshape(n, -1, bb)
    if qw.qtype == "q4_k":
        sc, m = k4_scales_mins(b[..., 4:16])
        t = 16 * np.abs(_f16(b[..., 0:2]))[..., None] * sc + np.abs(_f16(b[..., 2:4]))[..., None] * m
        return np.repeat(t.reshape(n, -1), 32, axis=1)
    if qw.qtype == "q6_k":
        sc = b[..., 192:208].view(np.int8).astype(np.float64)
        t = 32 * np.abs(_f16(b[..., 208:210])[..., None] * sc)
        return np.repeat(t.reshape(n, -1), 16, axis=1)
    return 128 * np.repeat(np.abs(_f16(b[..., 0:2])), 32, axis=1)


def check_act8(qw, wd, x, bias=None, threads=1, kernel="act8"):
    """The act8 kernel (or ``kernel``: act8_gguf) on ``x`` against the float64 reference of the
    module doc."""
    torch.set_num_threads(threads)
    try:
        y = quant.linear(x, qw, bias, kernel=kernel)
    finally:
        torch.set_num_threads(1)
    assert y.shape == (x.shape[0], qw.out_features) and y.dtype == x.dtype
    q, d = quant.quantize_activations(x)
    xq = (q.double().reshape(x.shape[0], -1, 32) * d.double().unsqueeze(-1)).reshape(x.shape).numpy()
    ref = xq @ wd.T + (0 if bias is None else bias.double().numpy())
    tol = 64 * EPS32 * (np.abs(xq) @ (np.abs(wd) + offset_terms(qw)).T) + 1e-30
    if bias is not None:  # the bias added in float32: one more rounding of the result
        tol = tol + EPS32 * np.abs(ref)
    if x.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * np.abs(ref)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), (
        f"{qw.qtype} {tuple(x.shape)}: worst {float((err / tol).max()):.2f} x tolerance"
    )


def check_act16(qw, wd, x, bias=None, threads=1, kernel="act16"):
    """The act16 kernel (or ``kernel``: act16_gguf) on ``x`` against the float64 product of the
    unquantized activations: the two planes leave at most d / 508 per element
    (``quantize_activations2``), plus the act8 kernels' float32 rounding of the scaled sums."""
    torch.set_num_threads(threads)
    try:
        y = quant.linear(x, qw, bias, kernel=kernel)
    finally:
        torch.set_num_threads(1)
    assert y.shape == (x.shape[0], qw.out_features) and y.dtype == x.dtype
    xd = x.double().numpy()
    ref = xd @ wd.T + (0 if bias is None else bias.double().numpy())
    _, d = quant.quantize_activations(x)
    step = d.double().repeat_interleave(32, dim=1).numpy()
    tol = (step / 508) @ np.abs(wd).T * (1 + 1e-3)
    tol = tol + 64 * EPS32 * ((np.abs(xd) + step) @ (np.abs(wd) + offset_terms(qw)).T) + 1e-30
    if x.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * np.abs(ref)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), (
        f"{qw.qtype} {tuple(x.shape)}: worst {float((err / tol).max()):.2f} x tolerance"
    )


def check_panel(qw, wd, x, bias=None, threads=1):
    torch.set_num_threads(threads)
    try:
        y = quant.linear(x, qw, bias, kernel="panel")
    finally:
        torch.set_num_threads(1)
    xd = x.double().numpy()
    ref = xd @ wd.T + (0 if bias is None else bias.double().numpy())
    tol = 64 * EPS32 * (np.abs(xd) @ np.abs(wd).T) + 1e-30
    if x.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * np.abs(ref)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), (
        f"{qw.qtype} {tuple(x.shape)}: worst {float((err / tol).max()):.2f} x tolerance"
    )


def test_quantize_activations_rounds_each_block_to_127_steps():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 2.54, 32)
    x[0, 40] = 1e-3  # alone in its block: q = 127
    q, d = quant.quantize_activations(x)
    assert d.shape == (2, 2) and q.dtype == torch.int8
    assert d[0, 0] == torch.tensor(2.54) / 127 and d[0, 1] == torch.tensor(1e-3) / 127
    assert q[0, 0] == -127 and q[0, 31] == 127 and q[0, 40] == 127 and int(q[0, 32:].abs().sum()) == 127
    assert (d[1] == 0).all() and (q[1] == 0).all()  # a zero block: d = 0, q = 0 (no division)
    err = (q.float().reshape(2, 2, 32) * d.unsqueeze(-1)).reshape(2, 64) - x
    assert float(err.abs().max()) <= float(d.max()) / 2 * (1 + 1e-6)


@native
@pytest.mark.parametrize("qtype", ACT8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_act8_equals_float64_of_the_int8_activations_rows_1_to_300(qtype, dtype, threads):
    """Ragged everywhere: 3 blocks (an odd count: the last pair has one block), 37 columns (not
    a multiple of the 4-column tile), rows 1..300 (tile tails of 1-3 rows, several row chunks)."""
    qw, wd = make_weight(qtype, 37, 96, seed=1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(37, generator=g).to(dtype)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 64, 65, 130, 300):
        x = torch.randn(m, 96, generator=g).to(dtype)
        check_act8(qw, wd, x, bias if m % 2 else None, threads)


def test_quantize_activations2_leaves_at_most_d_over_508_per_element():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 96, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.0]).unsqueeze(1)
    q, q2, d = quant.quantize_activations2(x)
    assert q2.dtype == torch.int8 and int(q2.abs().max()) <= 127 and (q2[3] == 0).all()
    back = ((q.float() + q2.float() / 254).reshape(4, 3, 32) * d.unsqueeze(-1)).reshape(4, 96)
    step = d.repeat_interleave(32, dim=1)
    assert ((back - x).abs() <= step / 508 * 1.01 + 1e-30).all()
    one = ((q.float().reshape(4, 3, 32) * d.unsqueeze(-1)).reshape(4, 96) - x).abs()
    assert float((back - x).abs().max()) < float(one.max()) / 50  # the second plane does refine


@native
@pytest.mark.parametrize("qtype", ACT8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_act16_is_within_d_over_508_of_the_float_activations_rows_1_to_65(qtype, dtype, threads):
    """Ragged as the act8 test: 3 blocks, 37 columns, row tails of 1-3, a second row chunk."""
    qw, wd = make_weight(qtype, 37, 96, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(37, generator=g).to(dtype)
    for m in (1, 2, 3, 4, 5, 9, 15, 17, 65):
        x = (torch.randn(m, 96, generator=g) * 4).to(dtype)
        check_act16(qw, wd, x, bias if m % 2 else None, threads)


@native
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(ACT8),
    m=st.integers(1, 12),
    n=st.integers(1, 20),
    blocks=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    xkind=st.sampled_from(["normal", "tiny", "huge", "sparse", "constant"]),
    threads=st.sampled_from([1, 2]),
)
def test_act16_property_random_blocks_and_activations(qtype, m, n, blocks, seed, xkind, threads):
    """Arbitrary block bytes and activations tiny, huge, mostly zero or constant (residual 0)."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    qw = quant.QuantWeight(torch.from_numpy(random_blocks(qtype, n, blocks, rng)), qtype, k)
    wd = quant.dequantize(qw).double().numpy()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    x = {"tiny": x * 1e-30, "huge": x * 1e30, "sparse": x * torch.from_numpy(rng.random((m, k)) < 0.05)}.get(
        xkind, torch.full((m, k), float(rng.standard_normal())) if xkind == "constant" else x
    )
    check_act16(qw, wd, x, None, threads)


@native
@pytest.mark.parametrize("qtype", sorted(quant.BLOCK_BYTES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_equals_dequantize_then_matmul_rows_1_to_300(qtype, dtype, threads):
    """101 columns: two full 48-column panels and a ragged one of 5 (inside its first 16)."""
    k = 2 * quant.BLOCK_WEIGHTS[qtype] if qtype.endswith("_k") else 160
    qw, wd = make_weight(qtype, 101, k, seed=3)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(101, generator=g).to(dtype)
    for m in (1, 7, 8, 9, 16, 17, 64, 100, 300):
        x = torch.randn(m, k, generator=g).to(dtype)
        check_panel(qw, wd, x, bias if m % 2 else None, threads)


def random_blocks(qtype: str, n: int, nb: int, rng) -> np.ndarray:
    """Random block bytes (any quant byte, -128 included for Q8_0), finite float16 scales of
    mixed magnitude and sign (minima for Q4_1), some zero."""
    bb = quant.BLOCK_BYTES[qtype]
    data = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    scale = rng.standard_normal((n, nb, 2)) * 10.0 ** rng.integers(-4, 1, (n, nb, 2))
    scale[rng.random((n, nb, 2)) < 0.1] = 0
    data[..., 0:4] = scale.astype(np.float16).view(np.uint8).reshape(n, nb, 4)
    if qtype == "q8_0":  # d, then 32 quants: restore the two bytes the minimum overwrote
        data[..., 2:4] = rng.integers(0, 256, (n, nb, 2), dtype=np.uint8)
    return data.reshape(n, -1)


@native
@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(ACT8),
    m=st.integers(1, 20),
    n=st.integers(1, 20),
    blocks=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
    xkind=st.sampled_from(["normal", "tiny", "huge", "sparse", "constant"]),
    threads=st.sampled_from([1, 2]),
)
def test_act8_property_random_blocks_and_activations(qtype, m, n, blocks, seed, bf16, xkind, threads):
    """Arbitrary block bytes (every quant value, Q8_0's -128 included) and activations that are
    tiny, huge, mostly zero (zero blocks: d = 0) or constant (every q = +-127)."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    data = random_blocks(qtype, n, blocks, rng)
    qw = quant.QuantWeight(torch.from_numpy(data), qtype, k)
    wd = quant.dequantize(qw).double().numpy()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    if xkind == "tiny":
        x = x * 1e-30
    elif xkind == "huge":
        x = x * 1e30
    elif xkind == "sparse":
        x = x * torch.from_numpy(rng.random((m, k)) < 0.05)
    elif xkind == "constant":
        x = torch.full((m, k), float(rng.standard_normal()))
    check_act8(qw, wd, x.to(torch.bfloat16) if bf16 else x, None, threads)


@native
def test_act8_and_float_modes_agree_to_the_activation_rounding():
    """Both modes on the same weight: the int8 activations move each product by at most half a
    step (d_x / 2 per element), so the results differ by at most (d_x / 2) @ |W|^T."""
    qw, wd = make_weight("q4_1", 64, 576, seed=5)
    x = torch.randn(3, 576)
    _, d = quant.quantize_activations(x)
    bound = (d.double().repeat_interleave(32, dim=1).numpy() / 2) @ np.abs(wd).T
    diff = (quant.linear(x, qw, kernel="act8") - quant.linear(x, qw, kernel="tile")).double()
    assert (diff.abs().numpy() <= bound * 1.001 + 1e-6).all()
    assert float(diff.abs().max()) > 0  # the modes do differ: the int8 path really ran


@native
@pytest.mark.parametrize("kernel", ["tile", "act8", "act16", "panel", "vnni"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_give_an_empty_result_for_every_kernel(kernel, dtype):
    if kernel == "vnni" and quant.act8_isa() != "avx512-vnni":
        pytest.skip("the vnni kernel needs AVX-512 VNNI")
    qw, _ = make_weight("q4_1", 5, 64, seed=0)
    y = quant.linear(torch.empty(0, 64, dtype=dtype), qw, kernel=kernel)
    assert y.shape == (0, 5) and y.dtype == dtype


def test_pick_kernel_follows_the_mode_the_rows_and_the_type(monkeypatch):
    monkeypatch.setenv(quant.AMX_ENV, "0")  # the routes without AMX (test_quant_amx.py: with)
    monkeypatch.setenv(quant.VNNI_ENV, "0")  # and the float panels (test_quant_vnni.py: VNNI)
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    assert quant.activation_mode() == "int8"
    assert [quant.pick_kernel(r, "q4_1") for r in (1, quant.PANEL_ROWS - 1)] == ["act8", "act8"]
    assert quant.pick_kernel(quant.PANEL_ROWS, "q4_1") == "panel"
    assert [quant.pick_kernel(1, t) for t in ("q4_k", "q6_k")] == ["act8", "act8"]
    assert quant.pick_kernel(1, "q5_k") == "tile"  # no int8 kernel for Q5_K
    assert [quant.head_kernel(r, "q8_0") for r in (1, quant.PANEL_ROWS)] == ["act16", None]
    assert quant.head_kernel(1, "q6_k") == "act16"
    assert quant.head_kernel(1, "q5_k") == "tile"
    # Q8_0's and Q4_1's int8 kernels read the x4 copy below the panel rows; the panels the GGUF
    # bytes, unless a Q4_1 weight holds only x4; everything else the GGUF bytes
    q8, _ = make_weight("q8_0", 4, 32, seed=0)
    q41, _ = make_weight("q4_1", 4, 32, seed=0)
    q40, _ = make_weight("q4_0", 4, 32, seed=0)
    assert [quant.weight_attr(q8, r) for r in (1, quant.PANEL_ROWS)] == ["x4", "data"]
    assert quant.weight_attr(q8, 1, "act16") == "x4"
    assert quant.weight_attr(q8, 1, "act8_gguf") == "data"
    assert [quant.weight_attr(q41, r) for r in (1, quant.PANEL_ROWS)] == ["x4", "data"]
    assert quant.weight_attr(q41, 1, "act16_gguf") == "data"
    assert quant.weight_attr(q40, 1) == "data"
    q41.drop_gguf()
    assert quant.weight_attr(q41, quant.PANEL_ROWS) == "x4"
    assert quant.weight_attr(q41, 1, "tile") == "data"
    monkeypatch.setenv(quant.X4_ENV, "0")  # the comparison switch: Q4_1 on the GGUF kernels
    assert quant.weight_attr(q41, 1) == "data"
    assert quant.weight_attr(q8, 1) == "x4"
    monkeypatch.delenv(quant.X4_ENV)
    monkeypatch.setenv(quant.ACT_ENV, "float")
    assert quant.weight_attr(q8, 1) == "data"
    assert quant.head_kernel(1, "q8_0") == "tile"
    assert quant.pick_kernel(1, "q8_0") == "tile"
    assert quant.pick_kernel(300, "q8_0") == "panel"
    monkeypatch.delenv(quant.ACT_ENV)
    want = "int8" if quant.act8_isa() == "avx512-vnni" else "float"
    assert quant.activation_mode() == want


def test_bad_activation_mode_is_a_clear_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(quant.ACT_ENV, "int4")
    with pytest.raises(ValueError, match="KVSERVE_QUANT_ACT='int4'.*float.*int8"):
        quant.activation_mode()
    qw, _ = make_weight("q8_0", 4, 32, seed=0)
    with pytest.raises(ValueError, match="KVSERVE_QUANT_ACT"):
        quant.linear(torch.randn(1, 32), qw)
    from kvserve.model_executor.model_loader import load_model
    from tests.model_executor.helpers import llama_config, save_tiny

    save_tiny(tmp_path, llama_config())
    with pytest.raises(ValueError, match="KVSERVE_QUANT_ACT='int4'"):  # at load, before any request
        load_model(tmp_path, torch.float32, "cpu", quantization="int8")
    monkeypatch.setenv(quant.ACT_ENV, "float")
    with pytest.raises(ValueError, match="kernel 'act8'.*q5_k"):
        quant.linear(torch.randn(1, 256), make_weight("q5_k", 4, 256, seed=0)[0], kernel="act8")
    with pytest.raises(ValueError, match="kernel 'act16'.*q5_k"):
        quant.linear(torch.randn(1, 256), make_weight("q5_k", 4, 256, seed=0)[0], kernel="act16")
    with pytest.raises(ValueError, match="kernel 'fast'"):
        quant.linear(torch.randn(1, 32), qw, kernel="fast")


SUBPROCESS_CHECK = """
import torch
from kvserve.ops import quant
from tests.ops.test_quant_act8 import check_act16, check_act8, check_panel
from tests.ops.test_quant_gemm import make_weight
assert quant.act8_isa() == {isa!r}, quant.act8_isa()
g = torch.Generator().manual_seed(0)
for qtype in quant.ACT8_TYPES:
    k = 512 if qtype.endswith("_k") else 160
    qw, wd = make_weight(qtype, 13, k, seed=7)
    for m in (1, 3, 6):
        for k8, k16 in (("act8", "act16"), ("act8_gguf", "act16_gguf")):  # Q8_0, Q4_1: x4, then GGUF
            check_act8(qw, wd, torch.randn(m, k, generator=g) * 3, torch.randn(13, generator=g), 1, k8)
            check_act16(qw, wd, torch.randn(m, k, generator=g) * 3, torch.randn(13, generator=g), 1, k16)
    if qtype == "q4_1":  # the panels on the x4 copy alone
        qw.drop_gguf()
        check_panel(qw, wd, torch.randn(20, 160, generator=g), torch.randn(13, generator=g), 2)
        assert qw.layout == "x4"
# the float-activation kernels of every type (the default mode where the kernels lack AVX-512
# VNNI): the register tile below PANEL_ROWS rows, the panels from there
import os
from tests.ops.test_quant_gemm import check_linear
os.environ[quant.ACT_ENV] = "float"
for qtype in quant.BLOCK_BYTES:
    for m in (3, quant.PANEL_ROWS + 4):
        for dtype in (torch.float32, torch.bfloat16):
            assert quant.pick_kernel(m, qtype, dtype) == ("tile" if m < quant.PANEL_ROWS else "panel")
            check_linear(qtype, m, 13, 256, seed=m, dtype=dtype)
print("ok")
"""


@native
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_act8_fallback_builds_equal_the_reference(isa):
    """The AVX2 (maddubs, Q8_0's sign trick) and scalar dot products, built for an older target
    (this host runs both), give the same results as the VNNI kernel's reference; so do those
    builds' float-activation kernels (tile, panels) for every weight type."""
    if isa == "avx2" and not cpu.has_avx2:
        pytest.skip("needs AVX2 (this CPU cannot run the AVX2 build)")
    from kvserve.ops import library
    from tests.ops import native_builds

    if os.environ.get(library.EXTRA_CFLAGS_ENV) or "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("a sanitizer run (its own flags; the compiler must not run under ASan)")
    # both targets at once (the AVX2 one is usually left by the -Werror test already)
    flags = native_builds.ACT8_FALLBACK_FLAGS
    failed = native_builds.build(list(flags.values()), ["quant_gemm.c"])[flags[isa]]
    assert not failed, failed
    r = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_CHECK.format(isa=isa)],
        env=native_builds.env(flags[isa]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
