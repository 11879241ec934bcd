"""``gemm``: the panel-packed CPU GEMM against a float64 ``F.linear`` reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.ops import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no C compiler / KVSERVE_NATIVE=0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (100, 37), (48, 16), (7, 3), (1, 1)])
def test_matches_reference(dtype, n, k):
    """Every row-block edge (1-8 rows left over; 9-16 rows in two balanced blocks, 10 = 5 + 5,
    15 = 8 + 7, that share the next panel's prefetch), padded last panels and the bias."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    pw = gemm.PanelWeight(w)
    assert pw.panels.shape == (-(-n // 48), k, 48) and pw.shape == (n, k)
    assert torch.equal(pw.unpack(), w)
    for m in [1, 2, 3, 7, 8, 9, 10, 12, 15, 16, 17, 24, 61]:
        x = torch.randn(m, k, generator=g).to(dtype)
        for bias in (None, b):
            ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = gemm.linear(x, pw, bias)
            assert got.shape == (m, n) and got.dtype == dtype
            # float32: sums in another order only; bfloat16: the output rounded once to bf16
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert (got.double() - ref).abs().max() <= tol * ref.abs().max() + 1e-6


def test_bfloat16_rounds_like_torch():
    """bfloat16 products of exactly representable sums round to the same bf16 as torch."""
    w = torch.tensor([[1.0, 2.0, 0.5], [3.0, -1.0, 0.25]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 4.0]], dtype=torch.bfloat16)
    got = gemm.linear(x, gemm.PanelWeight(w))
    assert torch.equal(got, torch.nn.functional.linear(x, w))


def test_empty_input_and_noncontiguous_x():
    w = torch.randn(50, 20)
    pw = gemm.PanelWeight(w)
    assert gemm.linear(torch.empty(0, 20), pw).shape == (0, 50)
    x = torch.randn(20, 6).t()  # [6, 20], not contiguous
    torch.testing.assert_close(gemm.linear(x, pw), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    pw = gemm.PanelWeight(torch.randn(10, 4))
    with pytest.raises(ValueError, match="native linear"):
        gemm.linear(torch.randn(3, 5), pw)
    with pytest.raises(ValueError, match="native linear"):
        gemm.linear(torch.randn(3, 4, dtype=torch.float64), pw)
    with pytest.raises(ValueError, match="native linear"):
        gemm.linear(torch.randn(3, 4), pw, torch.randn(9))
    with pytest.raises(ValueError, match="PanelWeight"):
        gemm.PanelWeight(torch.randn(4))
    with pytest.raises(ValueError, match="PanelWeight"):
        gemm.PanelWeight(torch.randn(4, 4, dtype=torch.float16))


def test_bfloat16_weights_are_panels_for_small_steps_where_a_bfloat16_dot_product_exists(monkeypatch):
    """Without AMX or AVX512-BF16 oneDNN emulates bfloat16 (slowly): bfloat16 weights get
    panels there for every step; where the CPU has AVX512-BF16 but the build lacks the
    dot-product kernel (its speed unknown), panels for steps of up to BF16_DOT_MAX_ROWS rows and
    oneDNN above (with the kernel: tests/ops/test_gemm_bf16dot.py)."""
    import kvserve.ops.cpu
    from kvserve.model_executor.layers import linear
    from kvserve.ops import gemm_amx, gemm_bf16dot

    if not gemm.available():
        pytest.skip("no C compiler")
    monkeypatch.setattr(gemm_amx, "available", lambda: False)
    w = torch.randn(96, 64).to(torch.bfloat16)
    monkeypatch.setattr(kvserve.ops.cpu, "has_avx512f", True)  # (read once, at import)
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx512f"})
    assert gemm.packs_bfloat16()
    packed = linear.prepack_weight(w)
    assert isinstance(packed, gemm.PanelWeight) and packed.dtype == torch.bfloat16
    x = torch.randn(5, 64).to(torch.bfloat16)
    want = (x.float() @ w.float().T).to(torch.bfloat16)
    torch.testing.assert_close(linear.linear(x, packed), want, rtol=0.02, atol=0.05)
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    # a dot product of unknown speed (the kernel not built: dot_speed() is 0.0 then)
    monkeypatch.setattr(gemm_bf16dot, "built", lambda: False)
    assert not gemm.packs_bfloat16() and not gemm_bf16dot.dot_beats_fma()
    # with the dot product: panels for decode-sized steps, oneDNN's copy above
    packed = linear.prepack_weight(w)
    assert isinstance(packed, gemm.PanelWeight) and packed.max_rows == gemm.BF16_DOT_MAX_ROWS
    assert packed.takes(packed.max_rows) and not packed.takes(packed.max_rows + 1)
    calls = []
    real = gemm.linear
    monkeypatch.setattr(gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (packed.max_rows, packed.max_rows + 1):
        x = torch.randn(m, 64).to(torch.bfloat16)
        want = (x.float() @ w.float().T).to(torch.bfloat16)
        torch.testing.assert_close(linear.linear(x, packed), want, rtol=0.02, atol=0.05)
    assert calls == [packed.max_rows]


def test_float32_weights_are_panels_exactly_where_the_cpu_has_avx512f(monkeypatch):
    """With AVX2 only, the panel kernel's 24 accumulators of 16 floats spill out of the 16
    vector registers and oneDNN's GEMM is several times faster: ``prepack_weight`` keeps a
    float32 weight a plain tensor (and bfloat16 on oneDNN), and ``kvserve doctor`` says so.
    With AVX-512F the panels take both. Either way ``linear`` gives the float64 product."""
    import kvserve.ops.cpu
    from kvserve.entrypoints import doctor
    from kvserve.model_executor.layers import linear
    from kvserve.ops import gemm_amx

    monkeypatch.setattr(gemm_amx, "available", lambda: False)
    monkeypatch.setattr(kvserve.ops.cpu, "cpu_flags", lambda: {"avx2", "fma"})
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    want = x.double() @ w.double().T + b.double()

    monkeypatch.setattr(kvserve.ops.cpu, "has_avx512f", False)
    assert not gemm.beats_onednn() and not gemm.packs_bfloat16()
    plain = linear.prepack_weight(w)
    assert plain is w
    assert not isinstance(linear.prepack_weight(w.bfloat16()), gemm.PanelWeight)
    paths = doctor._paths({"avx2", "fma"})["linear"]
    assert paths["float32"].startswith("oneDNN via torch"), paths
    assert paths["bfloat16"].startswith("oneDNN"), paths

    monkeypatch.setattr(kvserve.ops.cpu, "has_avx512f", True)
    assert gemm.beats_onednn() and gemm.packs_bfloat16()
    packed = linear.prepack_weight(w)
    assert isinstance(packed, gemm.PanelWeight) and packed.large is None and packed.max_rows is None
    assert torch.equal(packed.unpack(), w)
    assert isinstance(linear.prepack_weight(w.bfloat16()), gemm.PanelWeight)
    assert doctor._paths({"avx512f"})["linear"]["float32"] == "kvserve panel GEMM (AVX-512)"

    for weight in (plain, packed):
        torch.testing.assert_close(linear.linear(x, weight, b).double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    m=st.integers(2, 48),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_bit_identical_whatever_the_row_count(n, k, m, bf16, seed):
    """Why speculative greedy output equals decoding without it: a verify chunk's rows (k + 1
    rows in one GEMM) must give exactly what each row gives alone (a decode), in float32 and
    bfloat16 (the prefetches and the balanced row blocks of up to 48 rows must not change sums)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    pw = gemm.PanelWeight(w)
    together = gemm.linear(x, pw, b)
    for i in range(m):
        assert torch.equal(together[i : i + 1], gemm.linear(x[i : i + 1], pw, b)), i


@pytest.mark.parametrize("n, k", [(96, 1), (96, 5), (50, 1)])
def test_panels_are_their_own_copy(n, k):
    """Whole panels (``n`` a multiple of 48) are packed without the padded temporary, and even
    where the transpose is a no-op (one input feature) the panels never alias the weight."""
    w = torch.randn(n, k)
    pw = gemm.PanelWeight(w)
    before = w.clone()
    w.add_(1.0)
    assert torch.equal(pw.unpack(), before)
