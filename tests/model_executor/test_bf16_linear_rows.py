"""A bfloat16 linear gives each row the same result whatever the step's row count.

Why: greedy output with speculation on must equal speculation off. Off, a single-sequence decode
step is a 1-row GEMM; on, the same row sits inside a (k+1)-row verify chunk. oneDNN's 1-row
bfloat16 kernel sums in another order than its 2+-row one (in_features 1536: about one output
in 600 rounds to a neighbouring bfloat16), which flipped near-tie tokens of SmolLM2-135M in
``kvserve bench spec-decode --dtype bfloat16``. Where ``prepack_weight`` switches kernels at a
row count, a row rounds alike on each side of the switch (not across it: docs/DESIGN.md).
"""

import pytest
import torch

from kvserve.model_executor.models.llama import linear, prepack_weight


def _onednn_weight(w: torch.Tensor):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not available")
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"oneDNN cannot reorder a bfloat16 weight here: {e}")


@pytest.mark.parametrize("pack", ["onednn", "prepack"])
@pytest.mark.parametrize("in_f,out_f", [(1536, 576), (576, 1536)])
def test_row_result_independent_of_row_count(pack, in_f, out_f):
    """Within one kernel's row range: ``prepack_weight`` may switch kernels at a row count
    (AMX tiles up to ``gemm_amx.MAX_ROWS``; panels up to ``PanelWeight.max_rows`` with
    AVX512-BF16), and on each side of the switch every row count gives a row the same result."""
    from kvserve.ops import gemm, gemm_amx

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
    wp = _onednn_weight(w) if pack == "onednn" else prepack_weight(w)
    x = (
        torch.nn.functional.silu(torch.randn(64, in_f, generator=g)) * torch.randn(64, in_f, generator=g)
    ).bfloat16()
    switch = 64
    if isinstance(wp, gemm.PanelWeight) and wp.max_rows is not None:
        switch = wp.max_rows
    elif isinstance(wp, gemm_amx.AmxWeight):
        switch = min(64, gemm_amx.MAX_ROWS)
    if pack == "onednn" and gemm_amx.available():
        # oneDNN's AMX GEMM runs a tail of rows (past its last full row block) with another
        # kernel, so a row's rounding depends on the call's row count beyond row 0; kvserve never
        # sends it steps of up to gemm_amx.MAX_ROWS rows on such a CPU (AmxWeight does those).
        # What ``linear`` itself guarantees: the 1-row call rounds as the first row of any call.
        for m in (2, 5, 9, 17, 64):
            assert torch.equal(linear(x[:1], wp)[0], linear(x[:m], wp)[0]), f"{m} rows"
        return
    small = linear(x[:switch], wp)
    for i in range(switch):
        one = linear(x[i : i + 1], wp)
        assert one.shape == (1, out_f)
        assert torch.equal(one[0], small[i]), f"row {i}: 1-row result differs from the {switch}-row one"
    for m in (2, 5, 9):  # verify-chunk sizes
        if m <= switch:
            assert torch.equal(linear(x[:m], wp), small[:m])
    if switch < 64:  # past the switch: the larger kernel agrees with itself
        full = linear(x, wp)
        assert torch.equal(linear(x[: switch + 1], wp), full[: switch + 1])
