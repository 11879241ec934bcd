"""The batched LoRA op against a per-row reference, and the step mapping it runs on."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.model_executor.layers.lora import LoRAMapping, add_lora
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
    from kvserve.model_executor.layers.lora import lora_compute_dtype

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


def _padded_slots(g, S, fin, fout, rmax, ranks, cdt, stale_slot=None):
    """Slots laid out as ``LoRAManager`` lays them out (``A`` stored ``[in, S, R]``), slot ``s``
    of rank ``ranks[s]`` zero-padded to ``rmax``; ``stale_slot`` holds weights no row uses."""
    a = torch.zeros(fin, S, rmax, dtype=cdt).permute(1, 0, 2)
    b = torch.zeros(S, rmax, fout, dtype=cdt)
    for s, r in enumerate(ranks):
        if r or s == stale_slot:
            r = r or rmax
            a[s, :, :r] = (torch.randn(fin, r, generator=g) * 0.3).to(cdt)
            b[s, :r, :] = (torch.randn(r, fout, generator=g) * 0.3).to(cdt)
    return a, b


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 300),
    used=st.lists(st.integers(-1, 3), min_size=1, max_size=4),
    ranks=st.lists(st.integers(1, 8), min_size=4, max_size=4),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
# out0 and the delta cancel in some rows: the two forms' sums are near zero there
@example(T=300, used=[1, 0], ranks=[8, 5, 5, 7], bf16=True, seed=4989)
def test_stacked_equals_segment_equals_float64_reference(T, used, ranks, bf16, seed):
    """Random slot assignments with base rows (-1), slots no row uses (one holding stale
    weights), ranks below ``max_lora_rank``, 1..300 rows, float32 and bfloat16 models (float32
    slots, as on CPU): both forms agree with a float64 reference and with each other, and base
    rows stay bit for bit."""
    g = torch.Generator().manual_seed(seed)
    S, fin, fout, rmax = 4, 20, 12, 8
    dt = torch.bfloat16 if bf16 else torch.float32
    row_slots = np.asarray([used[int(i)] for i in torch.randint(len(used), (T,), generator=g)])
    stale = next((s for s in range(S) if s not in used), None)
    a, b = _padded_slots(g, S, fin, fout, rmax, ranks, torch.float32, stale_slot=stale)
    x = torch.randn(T, fin, generator=g).to(dt)
    out0 = torch.randn(T, fout, generator=g).to(dt)
    mapping = LoRAMapping.build(row_slots)
    if mapping is None:
        assert (row_slots < 0).all()
        return
    ref = _reference(out0, x, a, b, row_slots)
    res = {}
    for path in ("segment", "stacked"):
        out = out0.clone()
        add_lora(out, x, a, b, mapping, path=path)
        assert out.dtype == dt
        res[path] = out
        if dt == torch.float32:
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
        else:  # two bfloat16 roundings (the delta, the sum)
            bound = 2.0**-8 * (ref.abs() + (ref - out0.double()).abs()) + 1e-6
            assert bool(((out.double() - ref).abs() <= bound).all())
        base = row_slots < 0
        assert torch.equal(out[base], out0[base])
    if dt == torch.float32:
        torch.testing.assert_close(res["stacked"], res["segment"], rtol=1e-5, atol=1e-5)
    else:  # each within its bound of the reference, so within twice it of each other (a
        # bound on the summands' size: where out0 and the delta cancel, the sum is near zero)
        diff = (res["stacked"].double() - res["segment"].double()).abs()
        assert bool((diff <= 2.0**-7 * (ref.abs() + (ref - out0.double()).abs()) + 2e-6).all())


def test_stacked_views_are_views_of_the_manager_layout():
    from kvserve.model_executor.layers.lora import stacked_views

    a = torch.zeros(6, 3, 4).permute(1, 0, 2)  # [S=3, in=6, R=4] over [in, S, R] storage
    b = torch.zeros(3, 4, 5)
    a_cat, b_cat = stacked_views(a, b)
    assert a_cat.shape == (6, 12) and b_cat.shape == (12, 5)
    assert a_cat.data_ptr() == a.data_ptr() and b_cat.data_ptr() == b.data_ptr()
    a[1, 2, 3] = 7.0  # slot 1's column 3 is A_cat's column 1 * 4 + 3
    b[2, 1, 4] = 5.0
    assert a_cat[2, 7] == 7.0 and b_cat[9, 4] == 5.0


def test_row_mask_marks_each_rows_slot_columns_up_to_the_highest_active_slot():
    m = LoRAMapping.build(np.asarray([1, -1, 0, 1]))
    assert m.num_stacked_slots == 2
    mask = m.row_mask(2, torch.float32)
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    assert m.row_mask(2, torch.float32) is mask  # built once per step
    assert LoRAMapping.build(np.asarray([-1, 2])).row_mask(1, torch.float32).tolist() == [
        [0, 0, 0],
        [0, 0, 1],
    ]


def test_add_lora_chooses_stacked_for_small_steps_and_segments_for_large():
    from kvserve.model_executor.layers.lora import STACKED_MAX_ROW_SLOTS, use_stacked

    assert use_stacked(LoRAMapping.build(np.arange(8) % 4))
    assert not use_stacked(LoRAMapping.build(np.zeros(8, dtype=np.int64)))  # two matmuls already
    assert use_stacked(LoRAMapping.build(np.asarray([0, -1, 0])))
    big = np.arange(STACKED_MAX_ROW_SLOTS + 4) % 4
    assert not use_stacked(LoRAMapping.build(big))
    with pytest.raises(ValueError, match="path must be"):
        m = LoRAMapping.build(np.asarray([0]))
        add_lora(
            torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 3, 1), torch.zeros(1, 1, 2), m, path="x"
        )
