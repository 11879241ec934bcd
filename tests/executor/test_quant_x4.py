"""The x4 layout of Q8_0 weights (``quant_gemm.pack_x4``, ``csrc/quant_x4.h``) and its int8
kernels, beyond the float64 reference checks of test_quant_act8.py (which run them as
``kernel="act8"`` / ``"act16"`` on every Q8_0 case there, and the GGUF-layout kernels as
``act8_gguf`` / ``act16_gguf``): where each byte goes, that a row's result depends on neither the
batch it came in, the thread count nor the prefetch distance, and the streaming-read ceiling
of benchmarks/int8_gemv.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_executor.layers import quant_gemm
from tests.executor.test_quant_act8 import check_act8, check_act16, random_blocks

native = pytest.mark.skipif(not quant_gemm.available(), reason="quant_gemm kernels unavailable")


def q8_weight(n: int, nb: int, seed: int) -> quant_gemm.QuantWeight:
    rng = np.random.default_rng(seed)
    return quant_gemm.QuantWeight(torch.from_numpy(random_blocks("q8_0", n, nb, rng)), "q8_0", 32 * nb)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("nb", [1, 3])
def test_pack_x4_puts_each_quant_and_scale_where_the_layout_says(n, nb):
    qw = q8_weight(n, nb, seed=n * 10 + nb)
    packed = quant_gemm.pack_x4(qw.data, qw.in_features).numpy()
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


def test_x4_copy_is_made_once_and_only_for_q8_0(monkeypatch):
    qw = q8_weight(6, 2, seed=0)
    assert qw.x4 is qw.x4
    q41 = quant_gemm.QuantWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 32)
    with pytest.raises(ValueError, match="only Q8_0.*q4_1"):
        q41.x4  # noqa: B018
    monkeypatch.setenv(quant_gemm.ACT_ENV, "float")
    fresh = q8_weight(6, 2, seed=0)
    quant_gemm.prepare(fresh)
    assert fresh._x4 is None  # the float mode never reads it
    monkeypatch.setenv(quant_gemm.ACT_ENV, "int8")
    quant_gemm.prepare(fresh)
    assert (fresh._x4 is not None) == quant_gemm.available()


def _rows_alone_and_threads(qw, x, kernel):
    """The kernel on all rows at 1 and 2 threads, and on each row alone."""
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            out.append(quant_gemm.linear(x, qw, kernel=kernel))
        finally:
            torch.set_num_threads(1)
    alone = torch.cat([quant_gemm.linear(x[r : r + 1], qw, kernel=kernel) for r in range(x.shape[0])])
    return out[0], out[1], alone


@native
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 15),
    n=st.integers(1, 23),
    nb=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    kernel=st.sampled_from(["act8", "act16"]),
    bf16=st.booleans(),
)
def test_x4_row_result_is_independent_of_batch_and_threads(m, n, nb, seed, kernel, bf16):
    """Bit for bit: a row's outputs do not depend on which 4-row tile it sat in, on the tile's
    size, on the thread split of the groups, or on a ragged last group."""
    qw = q8_weight(n, nb, seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 32 * nb, generator=g) * 3).to(torch.bfloat16 if bf16 else torch.float32)
    one, two, alone = _rows_alone_and_threads(qw, x, kernel)
    assert torch.equal(one, two) and torch.equal(one, alone)


@native
@pytest.mark.parametrize("kernel", ["act8", "act16"])
def test_x4_prefetch_distance_does_not_change_results(kernel):
    qw = q8_weight(203, 18, seed=4)  # 51 groups: several prefetch distances in range
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    want = quant_gemm.linear(x, qw, kernel=kernel)
    old = quant_gemm.set_x4_prefetch(0)
    try:
        for nbytes in (0, 64, 2448, 1 << 20):
            quant_gemm.set_x4_prefetch(nbytes)
            assert torch.equal(quant_gemm.linear(x, qw, kernel=kernel), want), nbytes
    finally:
        quant_gemm.set_x4_prefetch(old)
    assert quant_gemm.set_x4_prefetch(old) == old


@native
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152 // 64, 576)])
def test_x4_on_the_model_shapes_equals_the_reference(n, k):
    """The default model's GEMV shapes (the LM head's rows cut to 768): act8 and act16 within
    test_quant_act8's float64 bounds, at 1 and 2 rows."""
    from tests.executor.test_quant_gemm import make_weight

    qw, wd = make_weight("q8_0", n, k, seed=n + k)
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
    assert quant_gemm.stream_read(data, threads, prefetch) == want
    assert quant_gemm.stream_read(data[:0], threads, prefetch) == 0


@native
@pytest.mark.parametrize("kernel", ["act8", "act16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x4_zero_rows_or_zero_outputs_give_empty_results(kernel, dtype):
    qw = q8_weight(5, 2, seed=1)
    y = quant_gemm.linear(torch.empty(0, 64, dtype=dtype), qw, kernel=kernel)
    assert y.shape == (0, 5) and y.dtype == dtype
    empty = quant_gemm.QuantWeight(torch.empty(0, 68, dtype=torch.uint8), "q8_0", 64)
    y = quant_gemm.linear(torch.randn(3, 64).to(dtype), empty, kernel=kernel)
    assert y.shape == (3, 0)
