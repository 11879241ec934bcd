"""The batched LoRA op against a per-row reference, and the step mapping it runs on."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.lora.ops import LoRAMapping, add_lora
from tests.golden import TEST_DEVICE


def _reference(out, x, a, b, row_slots):
    ref = out.clone().double()
    for t, s in enumerate(row_slots):
        if s >= 0:
            ref[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    return ref


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    rank=st.integers(1, 8),
    fin=st.integers(1, 24),
    fout=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_add_lora_equals_per_row_reference(rows, rank, fin, fout, seed):
    g = torch.Generator().manual_seed(seed)
    T, S = len(rows), 4
    x = torch.randn(T, fin, generator=g)
    out = torch.randn(T, fout, generator=g)
    a = torch.randn(S, fin, rank, generator=g)
    b = torch.randn(S, rank, fout, generator=g)
    ref = _reference(out, x, a, b, rows)
    mapping = LoRAMapping.build(np.asarray(rows))
    if all(s < 0 for s in rows):
        assert mapping is None
        return
    add_lora(out, x, a, b, mapping)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_add_lora_few_adapter_rows_scatter_path():
    rows = [-1] * 30 + [1, -1, 0]  # 2 of 33 rows: the index_add_ path
    g = torch.Generator().manual_seed(2)
    x, out = torch.randn(33, 8, generator=g), torch.randn(33, 6, generator=g)
    a, b = torch.randn(2, 8, 3, generator=g), torch.randn(2, 3, 6, generator=g)
    ref = _reference(out, x, a, b, rows)
    add_lora(out, x, a, b, LoRAMapping.build(np.asarray(rows)))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_dtypes_on_test_device(dtype):
    g = torch.Generator().manual_seed(1)
    rows = [2, -1, 0, 0, 2, 1, -1, 3]
    T, S, fin, fout, r = len(rows), 4, 32, 48, 16
    x = torch.randn(T, fin, generator=g)
    out = torch.randn(T, fout, generator=g)
    a = torch.randn(S, fin, r, generator=g) * 0.1
    b = torch.randn(S, r, fout, generator=g) * 0.1
    ref = _reference(out, x, a, b, rows)
    dev = TEST_DEVICE
    o = out.to(dev, dtype)
    add_lora(
        o, x.to(dev, dtype), a.to(dev, dtype), b.to(dev, dtype), LoRAMapping.build(np.asarray(rows), dev)
    )
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    torch.testing.assert_close(o.double().cpu(), ref, **tol)
    # the base rows are untouched, bit for bit
    assert torch.equal(o[1].cpu(), out[1].to(dtype)) and torch.equal(o[6].cpu(), out[6].to(dtype))


def test_mapping_groups_rows_by_slot_in_batch_order():
    m = LoRAMapping.build(np.asarray([1, -1, 0, 1, 0, -1]))
    assert m.rows.tolist() == [2, 4, 0, 3]
    assert m.inverse.tolist() == [2, 4, 0, 3, 1, 4]  # base rows -> 4, the zero row
    assert m.segments == [(0, 0, 2), (1, 2, 4)]
    assert not m.contiguous and m.active_slots() == [0, 1]
    assert LoRAMapping.build(np.asarray([0, 0, 1])).contiguous
    assert not LoRAMapping.build(np.asarray([1, 0])).contiguous
    assert LoRAMapping.build(np.asarray([-1, -1])) is None


def test_mapping_slice_keeps_each_rows_slot():
    m = LoRAMapping.build(np.asarray([1, -1, 0, 1, 0, -1]))
    s = m.slice(2, 5)
    assert s.row_slots.tolist() == [0, 1, 0] and s.rows.tolist() == [0, 2, 1]
    assert m.slice(5, 6) is None


def test_add_lora_refuses_mismatched_shapes():
    m = LoRAMapping.build(np.asarray([0, 0]))
    with pytest.raises(ValueError, match="mapping has 2 rows"):
        add_lora(torch.zeros(3, 4), torch.zeros(3, 5), torch.zeros(1, 5, 2), torch.zeros(1, 2, 4), m)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora(torch.zeros(2, 4), torch.zeros(2, 5), torch.zeros(1, 6, 2), torch.zeros(1, 2, 4), m)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    rank=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_add_lora_bfloat16_rows_with_float32_slots_round_once(rows, rank, seed):
    """The CPU bfloat16 path (``lora_compute_dtype``): bfloat16 ``x``/``out``, float32 ``A``/``B``.
    The delta is computed in float32 from the bfloat16 rows and rounded once with the sum: each
    value is within two bfloat16 roundings of the exact result; base rows stay bit for bit."""
    from kvserve.lora.ops import lora_compute_dtype

    assert lora_compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert lora_compute_dtype(torch.float32, "cpu") == torch.float32
    assert lora_compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    T, S, fin, fout = len(rows), 4, 24, 20
    x = torch.randn(T, fin, generator=g).bfloat16()
    out = torch.randn(T, fout, generator=g).bfloat16()
    a = torch.randn(S, fin, rank, generator=g) * 0.2
    b = torch.randn(S, rank, fout, generator=g) * 0.2
    mapping = LoRAMapping.build(np.asarray(rows))
    if mapping is None:
        return
    ref = _reference(out, x, a, b, rows)
    before = out.clone()
    add_lora(out, x, a, b, mapping)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    # one rounding of the delta to bfloat16, one of the sum (2**-8 relative each)
    bound = 2.0**-8 * (ref.abs() + (ref - before.double()).abs()) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    base = [t for t, s in enumerate(rows) if s < 0]
    assert torch.equal(out[base], before[base])
