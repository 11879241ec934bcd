"""The AMX bfloat16 GEMM (``amx_gemm``) against a float32 reference, and ``llama.linear``'s
dispatch between it and oneDNN by step size."""

import pytest
import torch

from kvserve.model_executor.layers import amx_gemm
from kvserve.model_executor.models import llama

pytestmark = pytest.mark.skipif(not amx_gemm.available(), reason="no AMX tiles on this CPU/kernel")


def _reference(x, w, b=None):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


def _rel_err(y, ref):
    return float(((y.float() - ref).abs() / (ref.abs() + 1.0)).max())


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (33, 32), (576, 1536)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 59, 64, 300])
def test_matches_float_reference(n, k, m):
    """Every row count (padding to 16 and 32 rows, blocks of 256 rows) and column count
    (partial 32-column groups); bias added. Inputs are bfloat16, so the products are exact
    and the error is the float32 sums' and the output's bfloat16 rounding (2**-8)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = amx_gemm.AmxWeight(w)
    assert torch.equal(packed.unpack(), w)
    assert _rel_err(amx_gemm.linear(x, packed, b), _reference(x, w, b)) < 1e-2
    assert _rel_err(amx_gemm.linear(x, packed), _reference(x, w)) < 1e-2


def test_strided_input_and_threads():
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(96, 10).bfloat16().T  # [10, 96], not contiguous
    packed = amx_gemm.AmxWeight(w)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert _rel_err(amx_gemm.linear(x, packed), _reference(x, w)) < 1e-2
    finally:
        torch.set_num_threads(old)


def test_llama_linear_dispatches_by_rows():
    """Up to ``MAX_ROWS`` rows run on the tiles, more on the large-step weight; both agree."""
    w = torch.randn(128, 64).bfloat16()
    packed = llama.prepack_weight(w)
    assert isinstance(packed, amx_gemm.AmxWeight)
    for m in (amx_gemm.MAX_ROWS, amx_gemm.MAX_ROWS + 1):
        x = torch.randn(m, 64).bfloat16()
        assert _rel_err(llama.linear(x, packed), _reference(x, w)) < 1e-2


def test_bad_inputs_name_the_mismatch():
    with pytest.raises(ValueError, match="multiple of 32"):
        amx_gemm.AmxWeight(torch.randn(8, 40).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        amx_gemm.AmxWeight(torch.randn(8, 64))
    packed = amx_gemm.AmxWeight(torch.randn(8, 64).bfloat16())
    with pytest.raises(ValueError, match="do not fit"):
        amx_gemm.linear(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(ValueError, match="do not fit"):
        amx_gemm.linear(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="do not fit"):
        amx_gemm.linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(7).bfloat16())
    with pytest.raises(ValueError, match="do not fit"):
        amx_gemm.linear(
            torch.randn(2, 64).bfloat16(), packed, torch.zeros(8, dtype=torch.bfloat16, device="meta")
        )
