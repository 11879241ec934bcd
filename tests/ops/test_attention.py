"""The native decode kernel against a plain torch reference (random tables, windows, GQA)."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops import attention as na

pytestmark = pytest.mark.skipif(
    not na.available(), reason=f"native kernel unavailable: {na.failure_reason()}"
)


@pytest.fixture(autouse=True, params=["avx512", "amx"])
def kernel_path(request):
    """Every test on both bfloat16 paths: AVX-512 and AMX tiles (skipped where this CPU or
    process has none; float32 never takes the AMX path, so it is run once)."""
    if request.param == "amx":
        if "dtype" in request.fixturenames and request.getfixturevalue("dtype") != torch.bfloat16:
            pytest.skip("float32 has no AMX path")
        if not na.set_amx(True):
            pytest.skip("no AMX tiles on this CPU or in this process")
    else:
        na.set_amx(False)
    yield request.param
    na.set_amx(na.USE_AMX)


# bfloat16 K/V/q are widened exactly and summed in float32, so the only extra error is the
# output's rounding to bfloat16: half an ulp, 2**-9 relative, of values of magnitude <~ 3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3 * 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "KH,G,D,BS",
    [
        (3, 3, 64, 16),
        (2, 1, 32, 4),
        (1, 4, 16, 1),
        (2, 2, 24, 4),
        (2, 4, 128, 16),
        (1, 1, 64, 8),
        (2, 8, 128, 16),
    ],
)
def test_matches_reference(KH, G, D, BS, dtype):
    # D=24 is not a multiple of 16: the scalar path; (3, 64), (4, 128) ... take the kernel copies
    # specialised for their (G, head_dim), (2, 32) and (4, 16) the general one.
    torch.manual_seed(KH * 100 + G)
    NB, B = 600, 7
    cache = torch.randn(2, KH, NB, BS, D).to(dtype)
    kend = torch.tensor([1, 5, BS, BS + 1, 37, 64, 3 * BS + 5])
    kstart = torch.tensor([0, 0, 0, 1, 30, 0, BS + 2])  # some "windows"
    first = kstart // BS
    nbmax = int(((kend - 1) // BS - first + 1).max())
    table = torch.randperm(NB)[: B * nbmax].view(B, nbmax).contiguous()
    q = torch.randn(B, KH, G, D).to(dtype)
    got = na.paged_decode_attention(q, cache, table, kstart, kend, 0.3)
    assert got.dtype == dtype
    for b in range(B):
        pos = torch.arange(int(kstart[b]), int(kend[b]))
        blk = table[b, pos // BS - first[b]]
        K = cache[0][:, blk, pos % BS].float()  # [KH, L, D]
        V = cache[1][:, blk, pos % BS].float()
        ref = F.scaled_dot_product_attention(q[b].float(), K, V, scale=0.3)
        err = (got[b].float() - ref).abs().max()
        assert err <= TOLERANCE[dtype], (b, float(err))


def test_rejects_mixed_or_unsupported_dtypes():
    cache = torch.zeros(2, 1, 4, 4, 16)
    table = torch.zeros(1, 1, dtype=torch.long)
    ks, ke = torch.tensor([0]), torch.tensor([1])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        na.paged_decode_attention(torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16), cache, table, ks, ke, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        na.paged_decode_attention(
            torch.zeros(1, 1, 1, 16, dtype=torch.float16), cache.half(), table, ks, ke, 1.0
        )


def test_index_dtype_and_layout_are_checked():
    """int32 indices (read as int64 they crashed the process) and a q whose rows are not
    contiguous (read as if they were) are refused by name."""
    if not na.available():
        pytest.skip("native kernel unavailable")
    cache = torch.zeros(2, 1, 4, 4, 16)
    q = torch.zeros(1, 1, 1, 16)
    table = torch.zeros(1, 1, dtype=torch.long)
    ks, ke = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="table must be a contiguous CPU tensor of int64"):
        na.paged_decode_attention(q, cache, table.int(), ks, ke, 1.0)
    with pytest.raises(ValueError, match="kend must be"):
        na.paged_decode_attention(q, cache, table, ks, ke.int(), 1.0)
    with pytest.raises(ValueError, match="out must be"):
        na.paged_decode_attention(q, cache, table, ks, ke, 1.0, out=torch.zeros(1, 1, 1, 8))
    strided_q = torch.zeros(2, 1, 16, 2)[..., 0].unsqueeze(2)  # [2, 1, 1, 16], elements 2 apart
    with pytest.raises(ValueError, match="q must be"):
        na.paged_decode_attention(strided_q, cache, table.repeat(2, 1), ks.repeat(2), ke.repeat(2), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_q_rows_may_be_strided(dtype):
    """q taken straight from a fused [T, H + KH, D] projection (rows (H + KH) * D apart) gives
    the same output as its contiguous copy."""
    if not na.available():
        pytest.skip("native kernel unavailable")
    g = torch.Generator().manual_seed(3)
    B, KH, G, D, BS, NB = 3, 2, 3, 64, 4, 12
    cache = torch.randn(2, KH, NB, BS, D, generator=g).to(dtype)
    fused = torch.randn(B, (KH * G + KH) * D, generator=g).to(dtype)
    q = fused[:, : KH * G * D].view(B, KH, G, D)
    assert not q.is_contiguous()
    table = torch.randperm(NB, generator=g)[: B * 4].view(B, 4).contiguous()
    ks = torch.tensor([0, 2, 5])
    ke = torch.tensor([16, 9, 11])
    a = na.paged_decode_attention(q, cache, table, ks, ke, 0.125)
    b = na.paged_decode_attention(q.contiguous(), cache, table, ks, ke, 0.125)
    assert torch.equal(a, b)


def _row_alone(q, cache, table, kstart, kend, scale, r):
    """The kernel on row ``r`` of a batch by itself (a decode of that position): ``[KH, G, D]``."""
    return na.paged_decode_attention(
        q[r : r + 1].contiguous(),
        cache,
        table[r : r + 1].contiguous(),
        kstart[r : r + 1],
        kend[r : r + 1],
        scale,
    )[0]


def _reference(q_row, cache, blk, pos, BS, scale):
    """torch attention of ``q_row`` [KH, G, D] over keys ``pos`` held in blocks ``blk``, float32."""
    K, V = (cache[i][:, blk, pos % BS].float() for i in (0, 1))
    return F.scaled_dot_product_attention(q_row.float(), K, V, scale=scale)


def _verify_batch(g, seqs, KH, G, D, BS, NB, dtype, shared_blocks=False):
    """Rows of ``seqs`` = [(kstart, first query position, rows)]: a verify chunk each, the
    table rows padded with zeros past their blocks (as the model runner pads them)."""
    cache = torch.randn(2, KH, NB, BS, D, generator=g).to(dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    rows = []
    for i, (ks, pos, n) in enumerate(seqs):
        blocks = perm[: (pos + n) // BS + 1] if shared_blocks else perm[i * 40 : (i + 1) * 40]
        rows += [(ks, p + 1, blocks[ks // BS : p // BS + 1]) for p in range(pos, pos + n)]
    nbmax = max(len(t) for _, _, t in rows)
    table = torch.zeros(len(rows), nbmax, dtype=torch.long)
    for r, (_, _, t) in enumerate(rows):
        table[r, : len(t)] = torch.tensor(t)
    kstart = torch.tensor([ks for ks, _, _ in rows])
    kend = torch.tensor([ke for _, ke, _ in rows])
    q = torch.randn(len(rows), KH, G, D, generator=g).to(dtype)
    return q, cache, table, kstart, kend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "KH,G,D,BS", [(3, 3, 64, 16), (2, 4, 128, 16), (1, 2, 32, 4), (2, 5, 48, 8), (1, 6, 32, 32)]
)
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_verify_chunk_rows_equal_each_row_alone(KH, G, D, BS, dtype, threads):
    """A verify chunk's rows (one sequence's consecutive positions: the kernel reads their keys
    once for all of them) give bit for bit what each row gives alone as a decode, across
    16-key block boundaries, for chunks of 1-20 rows (split into work items of up to 16) and a
    window's kstart; every row also matches the torch reference."""
    g = torch.Generator().manual_seed(KH * 31 + G + threads)
    seqs = [(0, 5, 9), (0, 14, 3), (0, 31, 1), (BS, 40, 20), (0, 0, 4), (0, 63, 2)]
    q, cache, table, kstart, kend = _verify_batch(g, seqs, KH, G, D, BS, 600, dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = na.paged_decode_attention(q, cache, table, kstart, kend, 0.3)
        for b in range(q.shape[0]):
            assert torch.equal(got[b], _row_alone(q, cache, table, kstart, kend, 0.3, b)), b
    finally:
        torch.set_num_threads(old)
    for b in range(q.shape[0]):
        pos = torch.arange(int(kstart[b]), int(kend[b]))
        ref = _reference(q[b], cache, table[b, pos // BS - int(kstart[b]) // BS], pos, BS, 0.3)
        assert (got[b].float() - ref).abs().max() <= TOLERANCE[dtype], b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rows_of_other_sequences_never_read_each_others_blocks(dtype):
    """Consecutive rows with consecutive kend but other blocks (two sequences whose lengths
    differ by one), or sharing only a prefix of blocks, each read their own table row."""
    g = torch.Generator().manual_seed(5)
    KH, G, D, BS = 3, 3, 64, 16
    # the same positions as one chunk, but each row another sequence's blocks
    q, cache, table, kstart, kend = _verify_batch(
        g, [(0, 40, 1), (0, 41, 1), (0, 42, 1)], KH, G, D, BS, 300, dtype
    )
    # and rows sharing their blocks (a prefix-cached pair) except where a table differs
    q2, _, table2, kstart2, kend2 = _verify_batch(
        g, [(0, 20, 3)], KH, G, D, BS, 300, dtype, shared_blocks=True
    )
    table2[2, 1] = int(table2[2, 1]) + 1  # row 2's second block is another one
    for qq, tt, ks, ke in ((q, table, kstart, kend), (q2, table2, kstart2, kend2)):
        got = na.paged_decode_attention(qq, cache, tt, ks, ke, 0.3)
        for b in range(qq.shape[0]):
            pos = torch.arange(0, int(ke[b]))
            ref = _reference(qq[b], cache, tt[b, pos // BS], pos, BS, 0.3)
            assert (got[b].float() - ref).abs().max() <= TOLERANCE[dtype], b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("KH,G,D,BS", [(2, 16, 256, 16), (2, 4, 64, 8), (2, 16, 64, 16), (1, 3, 64, 32)])
def test_verify_chunks_beside_empty_rows_shared_prefixes_and_long_contexts(KH, G, D, BS, dtype):
    """The grouping's edges, each row bit for bit what it gives alone (and, through single rows,
    what the batch gives with too few items a thread to group): a chunk of 18 rows over more
    than 4096 keys (two work items of 9), an empty row (kend == kstart) right after it and at
    the end, a window start inside a block, a chunk followed by a row of another sequence whose
    blocks are the chunk's own (prefix-cached: it may join, reading the same memory), then by
    one whose blocks differ inside the chunk's keys (it may not), a sliding window's rows (kend
    and kstart rising together, the same table row: they may not), and table rows padded with
    zeros well past their blocks."""
    g = torch.Generator().manual_seed(D + G)
    NB = 4600 // BS + 40
    cache = torch.randn(2, KH, NB, BS, D, generator=g).to(dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    a, b = perm[: 4518 // BS + 1], perm[4518 // BS + 1 : 4518 // BS + 13]
    other = list(b)
    other[13 // BS + 1] = perm[-1]  # differs from b inside the keys b's rows read
    # (kstart, kend, the sequence's blocks by absolute block index)
    rows = [(0, p + 1, a) for p in range(4500, 4518)] + [(7, 7, a)]
    rows += [(13, p + 1, b) for p in range(60, 65)] + [(13, 66, b), (13, 67, other), (0, 1, a)]
    rows += [(p - 19, p + 1, a) for p in range(100, 104)] + [(0, 0, a)]  # a window of 20
    table = torch.zeros(len(rows), 4520 // BS + 8, dtype=torch.long)
    for r, (ks, ke, blocks) in enumerate(rows):
        t = blocks[ks // BS : (ke - 1) // BS + 1] if ke > ks else []
        table[r, : len(t)] = torch.tensor(t, dtype=torch.long)
    kstart = torch.tensor([ks for ks, _, _ in rows])
    kend = torch.tensor([ke for _, ke, _ in rows])
    q = torch.randn(len(rows), KH, G, D, generator=g).to(dtype)
    scale = D**-0.5
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 11 groups x 2 KV heads: grouped
        got = na.paged_decode_attention(q, cache, table, kstart, kend, scale)
        torch.set_num_threads(8)  # < 4 items a thread: single rows
        single = na.paged_decode_attention(q, cache, table, kstart, kend, scale)
        torch.set_num_threads(1)
        for r in range(len(rows)):
            alone = _row_alone(q, cache, table, kstart, kend, scale, r)
            assert torch.equal(got[r], alone) and torch.equal(single[r], alone), r
    finally:
        torch.set_num_threads(old)
    for r, (ks, ke, blocks) in enumerate(rows):
        if ke == ks:
            assert not got[r].any(), r
            continue
        pos = torch.arange(ks, ke)
        ref = _reference(q[r], cache, torch.tensor(blocks)[pos // BS], pos, BS, scale)
        assert (got[r].float() - ref).abs().max() <= TOLERANCE[dtype], r


def test_amx_switch_takes_another_path(kernel_path):
    """``set_amx`` really switches kernels where AMX exists: the two bfloat16 paths sum in other
    orders, so over 8 sequences x 5 verify rows and 450 keys some outputs differ in their last
    bit, while both stay within the reference tolerance (checked above). Where the CPU has no
    AMX, ``set_amx(True)`` reports False and the kernel keeps one path."""
    if kernel_path != "amx":
        pytest.skip("compares the two paths once")
    g = torch.Generator().manual_seed(3)
    q, cache, table, kstart, kend = _verify_batch(
        g, [(0, 445 + i, 5) for i in range(8)], 3, 3, 64, 16, 400, torch.bfloat16
    )
    amx = na.paged_decode_attention(q, cache, table, kstart, kend, 0.125)
    assert na.set_amx(False) is False
    avx = na.paged_decode_attention(q, cache, table, kstart, kend, 0.125)
    assert not torch.equal(amx, avx)
    assert (amx.float() - avx.float()).abs().max() <= 2 * TOLERANCE[torch.bfloat16]
