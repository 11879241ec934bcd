"""Native decode attention over an int8 KV cache: the integer dot-product path (AVX-512 VNNI)
and the float path (codes widened to float32, as CPUs without VNNI run it) against float64
attention over the dequantized codes, for the shapes the kernel takes.

Bounds: the float path keeps float32 sums: within 1e-5 of the output's largest magnitude. The
integer path rounds each query head (times the softmax scale) to int16, |error| <= max|q| /
65534 an element, so a score moves by at most d = max|q| * max over keys of k_scale sum|k| /
65534 and the softmax weights by a factor within exp(+-2 d); per 16 keys it rounds the weights
times the value scales to int16 (<= their largest / 65534 each), which moves the output by at
most 16 / 65534 of the largest value |code| * v_scale. So |out - ref| <= vmax (expm1(2 d) +
16 / 65534), plus the float32 sums' 1e-5: ~250 times below the int8 codes' own rounding of the
scores (half a step of 1/127 of a row's largest). bfloat16 queries and outputs: 1e-2 of the
largest output (the output's rounding).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model_executor.layers import kv_quant
from kvserve.ops import attention as paged_attention
from kvserve.ops import cpu

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="native attention kernel not built")


@pytest.fixture(params=["dot", "float"])
def path(request):
    """Runs a test on the integer path (skipped where the library lacks VNNI) or the float path."""
    on = paged_attention.set_q8_dot(request.param == "dot")
    if request.param == "dot" and not on:
        pytest.skip("library built without AVX-512 VNNI/BW")
    yield request.param
    paged_attention.set_q8_dot(True)


def _cache(KH, NB, BS, D, gen, raw=False):
    """int8 cache [2, KH, NB, BS, D + 2]: quantized normal values, or (raw) every code byte and
    a float16 scale drawn at random (codes -128 included, which the quantizer never writes)."""
    cache = torch.empty(2, KH, NB, BS, D + 2, dtype=torch.int8)
    rows = cache.view(-1, D + 2)
    if raw:
        rows[:, :D] = torch.randint(-128, 128, (rows.shape[0], D), generator=gen, dtype=torch.int8)
        scale = torch.rand(rows.shape[0], generator=gen) * 0.02 + 1e-3
        rows[:, D:].view(torch.float16)[:, 0] = scale.to(torch.float16)
    else:
        rows[:] = kv_quant.quantize(torch.randn(rows.shape[0], D, generator=gen) * 2, torch.int8)
    return cache


def _reference(q, cache, table, kstart, kend, scale):
    """float64 attention over the dequantized cache, rows b with keys kstart[b] .. kend[b] - 1."""
    B, KH, G, D = q.shape
    BS = cache.shape[3]
    deq = kv_quant.dequantize(cache, torch.int8, torch.float64)
    ref = torch.zeros(B, KH, G, D, dtype=torch.float64)
    for b in range(B):
        pos = torch.arange(int(kstart[b]), int(kend[b]))
        if len(pos) == 0:
            continue
        blk = table[b][pos // BS - int(kstart[b]) // BS]
        K, V = deq[0][:, blk, pos % BS], deq[1][:, blk, pos % BS]  # [KH, L, D]
        s = torch.einsum("hgd,hld->hgl", q[b].double(), K) * scale
        ref[b] = torch.einsum("hgl,hld->hgd", s.softmax(-1), V)
    return ref


def _run(B, KH, G, D, BS, lengths, qdt, seed=0, raw=False, qmag=1.0):
    """Kernel output and float64 reference for rows of (kstart, length) ``lengths``, and the
    absolute error the integer path may add (the module doc's bound)."""
    gen = torch.Generator().manual_seed(seed)
    nb_row = max(-(-(s + n) // BS) for s, n in lengths)  # blocks a row's keys may span
    NB = B * nb_row + 3
    cache = _cache(KH, NB, BS, D, gen, raw)
    perm = torch.randperm(NB, generator=gen)
    table = torch.stack([perm[b * nb_row : (b + 1) * nb_row] for b in range(B)])
    kstart = torch.tensor([s for s, _ in lengths])
    kend = torch.tensor([s + n for s, n in lengths])
    # table row b lists the blocks from kstart[b] // BS on
    q = (torch.randn(B, KH, G, D, generator=gen) * qmag).to(qdt)
    out = paged_attention.paged_decode_attention(q, cache.view(torch.int8), table, kstart, kend, D**-0.5)
    ref = _reference(q, cache, table, kstart, kend, D**-0.5)
    codes = cache[..., :D].double()
    scales = cache[..., D:].contiguous().view(torch.float16).double()[..., 0]
    d = (q.double().abs().max() * D**-0.5) * (codes[0].abs().sum(-1) * scales[0]).max() / 65534
    vmax = (codes[1].abs().amax(-1) * scales[1]).max()
    dot_bound = float(vmax * (torch.expm1(2 * d) + 16 / 65534))
    return out, ref, dot_bound


def _check(out, ref, path, qdt, dot_bound, dot_rel=1e-4):
    """bfloat16: within 1e-2 of the largest output; float path: 1e-5; integer path: the proven
    bound and ``dot_rel`` of the largest output (the worst case is far from typical: measured
    errors are ~2.5x below 1e-4 at scores of order 1, ~2x below 6e-4 with a peaked softmax)."""
    err = float((out.double() - ref).abs().max())
    big = float(ref.abs().max())
    assert big > 0.1
    if qdt == torch.bfloat16:
        assert err < 1e-2 * big, (err, big)
    elif path == "float":
        assert err < 1e-5 * big, (err, big)
    else:
        assert err < min(1e-5 * big + dot_bound, dot_rel * big), (err, big, dot_bound)


# (KH, G, D, BS): every vector head_dim class (D % 64 == 0, D % 32 == 0, odd D / 16, D = 16,
# the largest 256), block sizes 1 .. 32, GQA ratios 1 .. 16; head_dim 24 is the scalar loop.
SHAPES = [
    (3, 3, 64, 16),
    (2, 4, 128, 4),
    (1, 8, 256, 32),
    (2, 16, 64, 1),
    (1, 2, 32, 3),
    (2, 1, 48, 5),
    (1, 5, 80, 16),
    (2, 3, 16, 7),
    (1, 2, 24, 4),
]


@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("KH,G,D,BS", SHAPES)
def test_int8_decode_attention_matches_float64_on_the_dequantized_cache(path, KH, G, D, BS, qdt):
    """Odd context lengths, rows starting mid-block, a single key, no keys (zeros), a row of
    exactly 16 keys; five rows in one call."""
    lengths = [(0, 77), (3, 130), (BS + 1, 1), (0, 16), (5, 0)]
    out, ref, dot_bound = _run(5, KH, G, D, BS, lengths, qdt)
    assert torch.equal(out[4].float(), torch.zeros_like(out[4].float()))  # no keys: zeros
    _check(out, ref, path, qdt, dot_bound)


@pytest.mark.parametrize("B", [1, 7])
def test_int8_decode_attention_at_long_contexts_and_extreme_codes(path, B):
    """Every int8 code (-128 .. 127) at random scales, large queries (peaked softmax), head_dim
    256 and 16 query heads (the integer sums' widest case), 1 to 2049 keys."""
    lengths = [(0, 2049), (17, 1000), (0, 1), (31, 513), (0, 64), (2, 333), (100, 1500)][:B]
    out, ref, dot_bound = _run(B, 1, 16, 256, 16, lengths, torch.float32, seed=1, raw=True, qmag=30.0)
    _check(out, ref, path, torch.float32, dot_bound, dot_rel=6e-4)


def test_int8_paths_agree_and_rows_equal_their_single_row_calls(path):
    """A batch's rows (e.g. a speculative verify chunk: one sequence's consecutive positions)
    equal each row decoded alone, bit for bit: each row is its own work item."""
    B, KH, G, D, BS = 4, 3, 3, 64, 16
    gen = torch.Generator().manual_seed(2)
    cache = _cache(KH, 20, BS, D, gen)
    table = torch.randperm(20, generator=gen)[:12].repeat(B, 1)
    kstart = torch.zeros(B, dtype=torch.int64)
    kend = torch.arange(150, 150 + B)
    q = torch.randn(B, KH, G, D, generator=gen)
    qc = cache.view(torch.int8)
    out = paged_attention.paged_decode_attention(q, qc, table, kstart, kend, 0.125)
    for b in range(B):
        one = paged_attention.paged_decode_attention(
            q[b : b + 1], qc, table[b : b + 1], kstart[b : b + 1], kend[b : b + 1], 0.125
        )
        assert torch.equal(one[0], out[b])


def test_set_q8_dot_is_on_exactly_where_the_cpu_has_vnni():
    """Off is always honoured; on only where the library (built for this CPU) has AVX-512 VNNI
    and BW, which is then the default."""
    flags = (cpu.cpuinfo_field("flags") or "").split()
    assert paged_attention.set_q8_dot(False) is False
    assert paged_attention.set_q8_dot(True) is ("avx512_vnni" in flags and "avx512bw" in flags)
