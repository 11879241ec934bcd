"""The native decode kernel against a plain torch reference (random tables, windows, GQA)."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers import native_attention as na

pytestmark = pytest.mark.skipif(
    not na.available(), reason=f"native kernel unavailable: {na.failure_reason()}"
)

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
