"""The native decode kernel against a plain torch reference (random tables, windows, GQA)."""
import pytest
import torch
import torch.nn.functional as F

from kvserve.model_executor.layers import native_attention as na

pytestmark = pytest.mark.skipif(not na.available(), reason=f"native kernel unavailable: {na.failure_reason()}")


@pytest.mark.parametrize("KH,G,D,BS", [(3, 3, 64, 16), (2, 1, 32, 4), (1, 4, 16, 1)])
def test_matches_reference(KH, G, D, BS):
    torch.manual_seed(KH * 100 + G)
    NB, B = 600, 7
    cache = torch.randn(2, KH, NB, BS, D)
    kend = torch.tensor([1, 5, BS, BS + 1, 37, 64, 3 * BS + 5])
    kstart = torch.tensor([0, 0, 0, 1, 30, 0, BS + 2])  # some "windows"
    first = kstart // BS
    nbmax = int(((kend - 1) // BS - first + 1).max())
    table = torch.randperm(NB)[:B * nbmax].view(B, nbmax).contiguous()
    q = torch.randn(B, KH, G, D)
    got = na.paged_decode_attention(q, cache, table, kstart, kend, 0.3)
    for b in range(B):
        pos = torch.arange(int(kstart[b]), int(kend[b]))
        blk = table[b, pos // BS - first[b]]
        K = cache[0][:, blk, pos % BS]  # [KH, L, D]
        V = cache[1][:, blk, pos % BS]
        ref = F.scaled_dot_product_attention(q[b], K, V, scale=0.3)
        assert torch.allclose(got[b], ref, atol=1e-5), (b, (got[b] - ref).abs().max())
