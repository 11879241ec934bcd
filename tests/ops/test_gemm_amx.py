"""The AMX bfloat16 GEMM (``gemm_amx``) against a float32 reference, and ``linear.linear``'s
dispatch between it and oneDNN by step size."""

import pytest
import torch

from kvserve.model_executor.layers import linear
from kvserve.ops import gemm_amx

pytestmark = pytest.mark.skipif(not gemm_amx.available(), reason="no AMX tiles on this CPU/kernel")


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
    packed = gemm_amx.AmxWeight(w)
    assert torch.equal(packed.unpack(), w)
    assert _rel_err(gemm_amx.linear(x, packed, b), _reference(x, w, b)) < 1e-2
    assert _rel_err(gemm_amx.linear(x, packed), _reference(x, w)) < 1e-2


def test_strided_input_and_threads():
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(96, 10).bfloat16().T  # [10, 96], not contiguous
    packed = gemm_amx.AmxWeight(w)
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert _rel_err(gemm_amx.linear(x, packed), _reference(x, w)) < 1e-2
    finally:
        torch.set_num_threads(old)


def test_llama_linear_dispatches_by_rows():
    """Up to ``MAX_ROWS`` rows run on the tiles, more on the large-step weight; both agree."""
    w = torch.randn(128, 64).bfloat16()
    packed = linear.prepack_weight(w)
    assert isinstance(packed, gemm_amx.AmxWeight)
    for m in (gemm_amx.MAX_ROWS, gemm_amx.MAX_ROWS + 1):
        x = torch.randn(m, 64).bfloat16()
        assert _rel_err(linear.linear(x, packed), _reference(x, w)) < 1e-2


def test_bad_inputs_name_the_mismatch():
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_amx.AmxWeight(torch.randn(8, 40).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_amx.AmxWeight(torch.randn(8, 64))
    packed = gemm_amx.AmxWeight(torch.randn(8, 64).bfloat16())
    with pytest.raises(ValueError, match="do not fit"):
        gemm_amx.linear(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(ValueError, match="do not fit"):
        gemm_amx.linear(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="do not fit"):
        gemm_amx.linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(7).bfloat16())
    with pytest.raises(ValueError, match="do not fit"):
        gemm_amx.linear(
            torch.randn(2, 64).bfloat16(), packed, torch.zeros(8, dtype=torch.bfloat16, device="meta")
        )


def test_gemm_amx_switch_packs_bfloat16_weights_as_without_amx(monkeypatch):
    """``KVSERVE_GEMM_AMX=0`` (``gemm_amx.USE_FOR_GEMM``): ``prepack_weight`` packs a bfloat16
    weight as on a CPU without AMX (the panels, with oneDNN's copy for large steps where the
    bfloat16 dot product is fast), and ``linear`` on it is within bfloat16's bound of the float64
    product at decode and prefill sizes: products of bfloat16 values are exact in float32, their
    float32 sums (K = 128) err by at most K eps32 sum |x w|, and the output rounds once to
    bfloat16 (2^-8 relative)."""
    import os
    import subprocess
    import sys

    import numpy as np

    from kvserve.ops import gemm

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    assert isinstance(linear.prepack_weight(w), gemm_amx.AmxWeight)
    monkeypatch.setattr(gemm_amx, "USE_FOR_GEMM", False)
    packed = linear.prepack_weight(w)
    if gemm.beats_onednn():  # (every AMX CPU has AVX-512F)
        assert isinstance(packed, gemm.PanelWeight)
    wd = w.double().numpy()
    for rows in (1, 20, 100):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        xd = x.double().numpy()
        ref = xd @ wd.T
        tol = 128 * float(np.finfo(np.float32).eps) * (np.abs(xd) @ np.abs(wd).T) + 2.0**-8 * np.abs(ref)
        err = np.abs(linear.linear(x, packed).double().numpy() - ref)
        assert (err <= tol).all(), (rows, float((err / tol).max()))
    # the variable is what sets it (read at import), as KVSERVE_ATTENTION_AMX for both attentions
    check = (
        "from kvserve.ops import gemm_amx, prefill_attention\n"
        "assert not gemm_amx.USE_FOR_GEMM and not prefill_attention.USE_AMX\n"
    )
    env = {**os.environ, gemm_amx.GEMM_ENV: "0", "KVSERVE_ATTENTION_AMX": "0"}
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
