"""oneDNN GEMMs run at a bounded set of row counts (``row_buckets``), and padding changes no
result beyond bfloat16 rounding."""

import pytest
import torch

from kvserve.model_executor.layers.row_buckets import EXACT_ROWS, onednn_rows, pad_rows
from kvserve.model_executor.models.llama import linear


def test_buckets_bound_padding_and_count():
    for rows in range(1, 4097):
        b = onednn_rows(rows)
        assert b >= rows
        if rows <= EXACT_ROWS:
            assert b == rows
        else:
            assert b - rows < rows / 8, rows  # under 1/8 more rows
        assert onednn_rows(b) == b  # a bucket is its own bucket
    # 8 per doubling: 65..2048 rows meet 40 distinct counts (what the 256-entry cache holds)
    assert len({onednn_rows(r) for r in range(65, 2049)}) == 40
    assert onednn_rows(65) == 72 and onednn_rows(513) == 576 and onednn_rows(2048) == 2048


def test_pad_rows_appends_zeros():
    x = torch.randn(70, 8)
    p = pad_rows(x)
    assert p.shape == (72, 8) and torch.equal(p[:70], x) and not p[70:].any()
    y = torch.randn(64, 8)
    assert pad_rows(y) is y


@pytest.mark.parametrize("rows", [17, 65, 100, 513])
def test_padded_onednn_linear_matches_float32(rows):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    try:
        wp = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"oneDNN cannot reorder a bfloat16 weight here: {e}")
    x = torch.randn(rows, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    out = linear(x, wp, b)
    assert out.shape == (rows, 96) and out.is_contiguous()
    ref = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
