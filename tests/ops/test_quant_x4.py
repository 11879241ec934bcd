"""The x4 layout of Q8_0 and Q4_1 weights (``quant.pack_x4``, ``csrc/quant_x4.h``) and its
int8 kernels, beyond the float64 reference checks of test_quant_act8.py (which run them as
``kernel="act8"`` / ``"act16"`` on every Q8_0 and Q4_1 case there, and the GGUF-layout kernels as
``act8_gguf`` / ``act16_gguf``): where each byte goes, the float64 reference on ragged shapes
(K not a multiple of 128, N not a multiple of 4) at 1..PANEL_ROWS - 1 rows and 1-2 threads, that
a row's result depends on neither the batch it came in, the thread count nor the prefetch
distance, the Q4_1 weight that keeps only its x4 copy (panels, rebuilt GGUF bytes, ``prepare``),
and the streaming-read ceiling (``quant.stream_read``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import quant
from tests.ops.test_quant_act8 import check_act8, check_act16, check_panel, random_blocks

native = pytest.mark.skipif(not quant.available(), reason="quant kernels unavailable")


def q8_weight(n: int, nb: int, seed: int) -> quant.QuantWeight:
    rng = np.random.default_rng(seed)
    return quant.QuantWeight(torch.from_numpy(random_blocks("q8_0", n, nb, rng)), "q8_0", 32 * nb)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("nb", [1, 3])
def test_pack_x4_puts_each_quant_and_scale_where_the_layout_says(n, nb):
    qw = q8_weight(n, nb, seed=n * 10 + nb)
    packed = quant.pack_x4(qw.data, "q8_0", qw.in_features).numpy()
    g = (n + 3) // 4
    assert packed.dtype == np.uint8 and packed.shape == (g * nb * 136,)
    blocks = qw.data.numpy().reshape(n, nb, 34)
    quants, scales = packed[: g * nb * 128], packed[g * nb * 128 :]
    for r in range(4 * g):
        gi, i = divmod(r, 4)
        for j in range(nb):
            at = (gi * nb + j) * 4 + i
            got_q = quants[at * 32 : at * 32 + 32].astype(np.int32) - 128
            got_d = scales[at * 2 : at * 2 + 2]
            if r < n:
                assert (got_q == blocks[r, j, 2:].view(np.int8)).all(), (r, j)
                assert (got_d == blocks[r, j, :2]).all(), (r, j)
            else:  # padding rows: zero quants, zero scale
                assert (got_q == 0).all() and (got_d == 0).all(), (r, j)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("nb", [1, 3])
def test_pack_x4_q4_1_puts_each_nibble_byte_and_scale_where_the_layout_says(n, nb):
    rng = np.random.default_rng(n * 10 + nb)
    qw = quant.QuantWeight(torch.from_numpy(random_blocks("q4_1", n, nb, rng)), "q4_1", 32 * nb)
    packed = quant.pack_x4(qw.data, "q4_1", qw.in_features).numpy()
    g = (n + 3) // 4
    assert packed.dtype == np.uint8 and packed.shape == (g * nb * 80,)
    blocks = qw.data.numpy().reshape(n, nb, 20)
    quants, scales = packed[: g * nb * 64], packed[g * nb * 64 :]
    for r in range(4 * g):
        gi, i = divmod(r, 4)
        for j in range(nb):
            at = (gi * nb + j) * 4 + i
            got_q = quants[at * 16 : at * 16 + 16]
            s = (gi * nb + j) * 16
            got_d, got_m = scales[s + 2 * i : s + 2 * i + 2], scales[s + 8 + 2 * i : s + 8 + 2 * i + 2]
            if r < n:
                assert (got_q == blocks[r, j, 4:]).all(), (r, j)
                assert (got_d == blocks[r, j, 0:2]).all() and (got_m == blocks[r, j, 2:4]).all(), (r, j)
            else:  # padding rows: zero quants, zero scale and minimum
                assert (got_q == 0).all() and (got_d == 0).all() and (got_m == 0).all(), (r, j)


@pytest.mark.parametrize("qtype", quant.X4_TYPES)
@pytest.mark.parametrize("n", [1, 4, 7, 9])
def test_unpack_x4_gives_back_the_gguf_bytes(qtype, n):
    rng = np.random.default_rng(n)
    data = torch.from_numpy(random_blocks(qtype, n, 5, rng))
    packed = quant.pack_x4(data, qtype, 160)
    assert torch.equal(quant.unpack_x4(packed, qtype, n, 160), data)
    with pytest.raises(ValueError, match="q4_0 has no x4 layout"):
        quant.pack_x4(data, "q4_0", 160)


def test_x4_copy_is_made_once_and_only_for_q8_0_and_q4_1(monkeypatch):
    qw = q8_weight(6, 2, seed=0)
    assert qw.x4 is qw.x4
    q41 = quant.QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 32)
    assert q41.x4 is q41.x4 and q41.layout == "gguf+x4"
    q40 = quant.QuantWeight(torch.zeros(4, 18, dtype=torch.uint8), "q4_0", 32)
    with pytest.raises(ValueError, match="only.*q8_0.*q4_1.*not q4_0"):
        q40.x4  # noqa: B018
    monkeypatch.setenv(quant.ACT_ENV, "float")
    fresh = q8_weight(6, 2, seed=0)
    quant.prepare(fresh)
    assert fresh._x4 is None  # the float mode never reads it
    monkeypatch.setenv(quant.ACT_ENV, "int8")
    quant.prepare(fresh)
    assert (fresh._x4 is not None) == quant.available()


def _rows_alone_and_threads(qw, x, kernel):
    """The kernel on all rows at 1 and 2 threads, and on each row alone."""
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            out.append(quant.linear(x, qw, kernel=kernel))
        finally:
            torch.set_num_threads(1)
    alone = torch.cat([quant.linear(x[r : r + 1], qw, kernel=kernel) for r in range(x.shape[0])])
    return out[0], out[1], alone


@native
@settings(max_examples=40, deadline=None)
@given(
    qtype=st.sampled_from(quant.X4_TYPES),
    m=st.integers(1, 15),
    n=st.integers(1, 23),
    nb=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(["act8", "act16"]),
    bf16=st.booleans(),
)
def test_x4_row_result_is_independent_of_batch_and_threads(qtype, m, n, nb, seed, kernel, bf16):
    """Bit for bit: a row's outputs do not depend on which 4-row tile it sat in, on the tile's
    size, on the thread split of the groups, or on a ragged last group."""
    rng = np.random.default_rng(seed)
    qw = quant.QuantWeight(torch.from_numpy(random_blocks(qtype, n, nb, rng)), qtype, 32 * nb)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 32 * nb, generator=g) * 3).to(torch.bfloat16 if bf16 else torch.float32)
    one, two, alone = _rows_alone_and_threads(qw, x, kernel)
    assert torch.equal(one, two) and torch.equal(one, alone)


@native
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, quant.PANEL_ROWS - 1),
    n=st.integers(1, 41),
    nb=st.integers(1, 13),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
    bf16=st.booleans(),
)
def test_x4_q4_1_equals_float64_of_the_int8_activations_on_ragged_shapes(m, n, nb, seed, threads, bf16):
    """act8 / act16 on the Q4_1 x4 copy within test_quant_act8's float64 bounds, for K = 32..416
    (mostly not a multiple of 128), N not a multiple of 4, every row count below the panels, 1-2
    threads; and equal to the GGUF-layout kernels' result up to float32 rounding of the sums."""
    rng = np.random.default_rng(seed)
    k = 32 * nb
    qw = quant.QuantWeight(torch.from_numpy(random_blocks("q4_1", n, nb, rng)), "q4_1", k)
    wd = quant.dequantize(qw).double().numpy()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32) * 3)
    x = x.to(torch.bfloat16) if bf16 else x
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(x.dtype)
    check_act8(qw, wd, x, bias, threads)
    check_act16(qw, wd, x, None, threads)
    assert qw.layout == "gguf+x4"  # the x4 kernels ran (the copy made on first use)


@native
@pytest.mark.parametrize("n,k", [(37, 96), (13, 416), (101, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_1_keeping_only_x4_runs_every_kernel_and_rebuilds_the_gguf_bytes(n, k, dtype, monkeypatch):
    """After drop_gguf: the panels read the x4 copy (bit-identical to the GGUF panels, within the
    float64 bound), act8 is unchanged, and a kernel of the GGUF layout (tile) rebuilds ``data``
    byte for byte. (The int8 mode forced: CPUs without AVX-512 VNNI default to float
    activations, whose few-row kernel reads the GGUF bytes.)"""
    from tests.ops.test_quant_gemm import make_weight

    monkeypatch.setenv(quant.ACT_ENV, "int8")
    qw, wd = make_weight("q4_1", n, k, seed=n + k)
    original = qw.data.clone()
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(r, k, generator=g).to(dtype) for r in (1, 5, quant.PANEL_ROWS, 40)]
    bias = torch.randn(n, generator=g).to(dtype)
    want = [quant.linear(x, qw, bias) for x in xs]  # act8 on x4, panels on the GGUF bytes
    qw.drop_gguf()
    assert qw.layout == "x4" and qw._data is None
    assert qw.resident_bytes == qw.x4.numel() == ((n + 3) // 4) * (k // 32) * 80
    for x, y in zip(xs, want):
        assert torch.equal(quant.linear(x, qw, bias), y), x.shape
    assert qw.layout == "x4"
    check_panel(qw, wd, xs[-1], bias, 2)
    tile = quant.linear(xs[0], qw, kernel="tile")  # reads data: rebuilt from x4
    assert qw.layout == "gguf+x4" and torch.equal(qw.data, original)
    qw2, _ = make_weight("q4_1", n, k, seed=n + k)
    assert torch.equal(tile, quant.linear(xs[0], qw2, kernel="tile"))


def test_prepare_keeps_only_x4_for_q4_1_gemm_weights_in_the_int8_mode(monkeypatch):
    from tests.ops.test_quant_gemm import make_weight

    def fresh(qtype):
        return make_weight(qtype, 8, 64, seed=1)[0]

    monkeypatch.setenv(quant.ACT_ENV, "int8")
    w = fresh("q4_1")
    quant.prepare(w)
    assert w.layout == ("x4" if quant.available() else "gguf")
    w = fresh("q4_1")
    quant.prepare(w, gemm_only=False)  # also an embedding table: the lookup reads data
    assert w.layout == ("gguf+x4" if quant.available() else "gguf")
    w = fresh("q8_0")
    quant.prepare(w)  # Q8_0's panels read data: both copies
    assert w.layout == ("gguf+x4" if quant.available() else "gguf")
    monkeypatch.setenv(quant.X4_ENV, "0")
    w = fresh("q4_1")
    quant.prepare(w)
    assert w.layout == "gguf"
    assert quant.kernel_weight(w, 1) is w.data  # act8 on the GGUF layout
    monkeypatch.delenv(quant.X4_ENV)
    monkeypatch.setenv(quant.ACT_ENV, "float")
    w = fresh("q4_1")
    quant.prepare(w)
    assert w.layout == "gguf"


@native
@pytest.mark.parametrize("qtype", quant.X4_TYPES)
@pytest.mark.parametrize("kernel", ["act8", "act16"])
def test_x4_prefetch_distance_does_not_change_results(qtype, kernel):
    rng = np.random.default_rng(4)  # 51 groups: several prefetch distances in range
    qw = quant.QuantWeight(torch.from_numpy(random_blocks(qtype, 203, 18, rng)), qtype, 576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    want = quant.linear(x, qw, kernel=kernel)
    old = quant.set_x4_prefetch(0)
    try:
        for nbytes in (0, 64, 2448, 1 << 20):
            quant.set_x4_prefetch(nbytes)
            assert torch.equal(quant.linear(x, qw, kernel=kernel), want), nbytes
    finally:
        quant.set_x4_prefetch(old)
    assert quant.set_x4_prefetch(old) == old


@native
@pytest.mark.parametrize("qtype", quant.X4_TYPES)
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152 // 64, 576)])
def test_x4_on_the_model_shapes_equals_the_reference(qtype, n, k):
    """The default model's GEMV shapes (the LM head's rows cut to 768): act8 and act16 within
    test_quant_act8's float64 bounds, at 1 and 2 rows."""
    from tests.ops.test_quant_gemm import make_weight

    qw, wd = make_weight(qtype, n, k, seed=n + k)
    g = torch.Generator().manual_seed(6)
    for m in (1, 2):
        check_act8(qw, wd, torch.randn(m, k, generator=g), None, 2)
        check_act16(qw, wd, torch.randn(m, k, generator=g), None, 2)


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 256])
def test_stream_read_xors_every_64_bit_word_of_the_full_lines(threads, prefetch):
    rng = np.random.default_rng(threads + prefetch)
    data = torch.from_numpy(rng.integers(0, 256, 64 * 37 + 5, dtype=np.uint8))
    want = int(np.bitwise_xor.reduce(data.numpy()[: 64 * 37].view(np.uint64)))
    assert quant.stream_read(data, threads, prefetch) == want
    assert quant.stream_read(data[:0], threads, prefetch) == 0


@native
@pytest.mark.parametrize("kernel", ["act8", "act16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", quant.X4_TYPES)
def test_x4_zero_rows_or_zero_outputs_give_empty_results(kernel, dtype, qtype):
    rng = np.random.default_rng(1)
    qw = quant.QuantWeight(torch.from_numpy(random_blocks(qtype, 5, 2, rng)), qtype, 64)
    y = quant.linear(torch.empty(0, 64, dtype=dtype), qw, kernel=kernel)
    assert y.shape == (0, 5) and y.dtype == dtype
    rb = quant.row_bytes(qtype, 64)
    empty = quant.QuantWeight(torch.empty(0, rb, dtype=torch.uint8), qtype, 64)
    y = quant.linear(torch.randn(3, 64).to(dtype), empty, kernel=kernel)
    assert y.shape == (3, 0)
