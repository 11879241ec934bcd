"""The native form of the batched LoRA op (``kvserve/csrc/lora.c``) against a float64
reference, against the torch forms, and what it refuses."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_executor.layers import lora as ops
from kvserve.model_executor.layers.lora import LoRAMapping, add_lora
from kvserve.ops import lora as lora_kernel

pytestmark = pytest.mark.skipif(
    not lora_kernel.available(), reason=f"no native LoRA kernel: {lora_kernel.failure_reason()}"
)


def _manager_slots(g, S, fin, widths, R, wdt, garbage_off_diagonal, slot_major=False):
    """Slots laid out as ``LoRAManager`` lays them out: ``A`` stored ``[in, S, P * R]`` (or
    ``[S, in, P * R]`` with ``slot_major``, as where the kernel runs), ``B``
    ``[S, P * R, sum(widths)]`` block-diagonal over the parts. With ``garbage_off_diagonal``
    the off-diagonal blocks hold large values (a kernel that reads them is caught); returns
    ``a``, ``b`` and ``b_clean`` (those blocks zero), and the parts' column bounds."""
    P = len(widths)
    bounds = tuple(int(c) for c in np.concatenate(([0], np.cumsum(widths))))
    if slot_major:
        a = (torch.randn(S, fin, P * R, generator=g) * 0.3).to(wdt)
    else:
        a = (torch.randn(fin, S, P * R, generator=g) * 0.3).to(wdt).permute(1, 0, 2)
    b_clean = torch.zeros(S, P * R, bounds[-1])
    for p in range(P):
        b_clean[:, p * R : (p + 1) * R, bounds[p] : bounds[p + 1]] = (
            torch.randn(S, R, widths[p], generator=g) * 0.3
        )
    b_clean = b_clean.to(wdt)
    b = b_clean.clone()
    if garbage_off_diagonal:
        off = torch.ones_like(b, dtype=torch.bool)
        for p in range(P):
            off[:, p * R : (p + 1) * R, bounds[p] : bounds[p + 1]] = False
        b[off] = 1e4
    return a, b, b_clean, bounds


def _reference(out, x, a, b, row_slots):
    ref = out.double().clone()
    for t, s in enumerate(row_slots):
        if s >= 0:
            ref[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    return ref


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    P=st.integers(1, 3),
    R=st.integers(1, 40),
    fin=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=3, max_size=3),
    x_bf16=st.booleans(),
    w_bf16=st.booleans(),
    threads=st.sampled_from([1, 2]),
    slot_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_add_lora_equals_float64_reference_reading_only_diagonal_blocks(
    rows, P, R, fin, widths, x_bf16, w_bf16, threads, slot_major, seed
):
    """Ranks and widths around the kernel's 16-column vectors and 8-row tiles (tails, several
    tiles per slot), 1-3 parts, every activation/weight dtype pair, 1 and 2 threads, both
    layouts of ``A``: the delta
    is the float64 one rounded once, the off-diagonal blocks of ``B`` are never read, and rows
    without a slot stay bit for bit."""
    g = torch.Generator().manual_seed(seed)
    S = 4
    xdt = torch.bfloat16 if x_bf16 else torch.float32
    wdt = torch.bfloat16 if w_bf16 else torch.float32
    a, b, b_clean, bounds = _manager_slots(g, S, fin, widths[:P], R, wdt, P > 1, slot_major)
    T = len(rows)
    x = torch.randn(T, fin, generator=g).to(xdt)
    out0 = torch.randn(T, bounds[-1], generator=g).to(xdt)
    mapping = LoRAMapping.build(np.asarray(rows))
    if mapping is None:
        return
    ref = _reference(out0, x, a, b_clean, rows)
    out = out0.clone()
    keep = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        add_lora(out, x, a, b, mapping, path="native", parts=bounds)
    finally:
        torch.set_num_threads(keep)
    err = (out.double() - ref).abs()
    if xdt == torch.float32:
        bound = 1e-5 * ref.abs() + 1e-4
    else:  # one rounding of the sum to bfloat16
        bound = 2.0**-8 * ref.abs() + 1e-4
    assert bool((err <= bound).all()), float((err - bound).max())
    base = np.asarray(rows) < 0
    assert torch.equal(out[base], out0[base])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 3), min_size=1, max_size=300),
    P=st.integers(1, 3),
    R=st.integers(1, 40),
    fin=st.integers(1, 80),
    widths=st.lists(st.integers(1, 150), min_size=3, max_size=3),
    x_bf16=st.booleans(),
    w_bf16=st.booleans(),
    threads=st.sampled_from([2, 3]),
    seed=st.integers(0, 2**16),
)
def test_native_split_over_threads_is_bit_identical_to_one_thread(
    rows, P, R, fin, widths, x_bf16, w_bf16, threads, seed
):
    """Small steps on several threads split each chunk's shrink (16-column blocks) and expand
    (48-column blocks) over the threads (``lora_add_split``, up to 32 chunks not a multiple of
    the threads; otherwise whole chunks per thread): the same FMA chains per element, so the result equals the one-thread
    kernel's bit for bit -- 1-38 chunks (both forms), parts wider than a 48-column block,
    ranks and widths off the vector sizes."""
    g = torch.Generator().manual_seed(seed)
    xdt = torch.bfloat16 if x_bf16 else torch.float32
    wdt = torch.bfloat16 if w_bf16 else torch.float32
    a, b, _, bounds = _manager_slots(g, 4, fin, widths[:P], R, wdt, garbage_off_diagonal=False)
    mapping = LoRAMapping.build(np.asarray(rows))
    if mapping is None:
        return
    x = torch.randn(len(rows), fin, generator=g).to(xdt)
    out0 = torch.randn(len(rows), bounds[-1], generator=g).to(xdt)
    got = {}
    keep = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            got[n] = out0.clone()
            add_lora(got[n], x, a, b, mapping, path="native", parts=bounds)
    finally:
        torch.set_num_threads(keep)
    assert torch.equal(got[1], got[threads])
    # the kernel wrote something (a bfloat16 output can round a small delta away: start from 0)
    delta = torch.zeros_like(out0)
    add_lora(delta, x, a, b, mapping, path="native", parts=bounds)
    assert bool(delta.any())


@pytest.mark.parametrize("rows", [1, 8, 16, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_equals_segment_form_at_the_default_models_shapes(rows, dtype):
    """The default model's qkv (576 -> 576 + 192 + 192, three parts) and down (1536 -> 576)
    at rank 16 over 4 slots, rows round-robin with base rows, float32 slots (as on CPU): the
    native form agrees with the segment form (float32: to float32 accuracy; bfloat16: within a
    bfloat16 step of the delta and of the sum, as the segment form rounds both)."""
    g = torch.Generator().manual_seed(rows)
    row_slots = np.asarray([(t % 5) - 1 for t in range(rows)])  # -1, 0, 1, 2, 3, -1, ...
    if (row_slots < 0).all():
        row_slots[0] = 2
    mapping = LoRAMapping.build(row_slots)
    for fin, widths in ((576, [576, 192, 192]), (1536, [576])):
        a, b, _, bounds = _manager_slots(g, 4, fin, widths, 16, torch.float32, garbage_off_diagonal=False)
        x = (torch.randn(rows, fin, generator=g) * 0.1).to(dtype)
        out0 = torch.randn(rows, bounds[-1], generator=g).to(dtype)
        seg, nat = out0.clone(), out0.clone()
        add_lora(seg, x, a, b, mapping, path="segment")
        add_lora(nat, x, a, b, mapping, path="native", parts=bounds)
        if dtype == torch.float32:
            torch.testing.assert_close(nat, seg, rtol=1e-5, atol=1e-5)
        else:  # the segment form rounds the delta, then the sum; the kernel the sum only
            diff = (nat.double() - seg.double()).abs()
            bound = 2.0**-7 * (seg.double().abs() + (seg.double() - out0.double()).abs()) + 1e-6
            assert bool((diff <= bound).all())
        assert torch.equal(nat[row_slots < 0], out0[row_slots < 0])


def test_add_lora_chooses_native_for_small_cpu_steps(monkeypatch):
    m = LoRAMapping.build(np.arange(8) % 4)
    x, out = torch.randn(8, 32), torch.zeros(8, 16)
    a, b = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    assert ops.use_native(out, x, a, b)
    assert not ops.use_native(out.half(), x.half(), a.half(), b.half())  # float16: torch forms
    assert not ops.use_native(
        out, x, a.transpose(1, 2).contiguous().transpose(1, 2), b
    )  # A's rank not innermost
    chosen = out.clone()
    add_lora(chosen, x, a, b, m)
    forced = out.clone()
    add_lora(forced, x, a, b, m, path="native")
    assert torch.equal(chosen, forced)
    # no row limit by default: a 2048-token prefill chunk runs the kernel too
    assert ops.use_native(torch.zeros(4096, 16), torch.randn(4096, 32), a, b)
    monkeypatch.setattr(ops, "NATIVE_MAX_ROWS", 7)
    assert not ops.use_native(out, x, a, b)


def test_native_add_lora_refuses_what_it_cannot_take():
    m = LoRAMapping.build(np.asarray([0, 1]))
    x, out = torch.randn(2, 8), torch.zeros(2, 12)
    a, b = torch.randn(2, 8, 4), torch.zeros(2, 4, 12)
    with pytest.raises(ValueError, match="increasing bounds"):
        add_lora(out, x, a, b, m, path="native", parts=(0, 6, 6))
    with pytest.raises(ValueError, match=r"part columns \(0, 13\)"):
        add_lora(out, x, a, b, m, path="native", parts=(0, 13))  # wider than out and B
    with pytest.raises(ValueError, match="part columns"):
        add_lora(out, x, a, b, m, path="native", parts=(0, 4, 8, 12))  # rank 4 over 3 parts
    with pytest.raises(ValueError, match="not supported"):
        add_lora(out.half(), x.half(), a.half(), b.half(), m, path="native")
    with pytest.raises(ValueError, match="not supported"):  # x in another dtype than out
        add_lora(out, x.bfloat16(), a, b, m, path="native")
    assert torch.equal(out, torch.zeros(2, 12))  # nothing written by a refused call


def test_native_bfloat16_slots_give_the_float32_slots_deltas_bit_for_bit():
    """A bfloat16 model's adapters are validated in bfloat16, so its slots may be kept in
    bfloat16 (``lora_slot_dtype``: half the bytes a step streams): the kernel widens them
    exactly, and the deltas equal those of float32 slots holding the same values, bit for bit."""
    assert ops.lora_slot_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert ops.lora_slot_dtype(torch.float32, "cpu") == torch.float32
    assert ops.lora_slot_dtype(torch.float16, "cpu") == torch.float32  # no float16 kernel
    g = torch.Generator().manual_seed(5)
    row_slots = np.asarray([t % 4 - 1 for t in range(21)])
    mapping = LoRAMapping.build(row_slots)
    a16, b16, _, bounds = _manager_slots(
        g, 4, 96, [64, 32, 32], 16, torch.bfloat16, garbage_off_diagonal=True
    )
    a32, b32 = a16.float(), b16.float()
    x = torch.randn(21, 96, generator=g).bfloat16()
    out0 = torch.randn(21, bounds[-1], generator=g).bfloat16()
    o16, o32 = out0.clone(), out0.clone()
    add_lora(o16, x, a16, b16, mapping, path="native", parts=bounds)
    add_lora(o32, x, a32, b32, mapping, path="native", parts=bounds)
    assert torch.equal(o16, o32) and not torch.equal(o16, out0)


def test_torch_forms_widen_bfloat16_slots_to_float32():
    """The torch forms (large steps) on bfloat16 slots compute in float32 as on float32 slots
    holding the same values (the same result up to float32 summation order)."""
    g = torch.Generator().manual_seed(6)
    row_slots = np.asarray([t % 3 for t in range(10)])
    mapping = LoRAMapping.build(row_slots)
    a16, b16, _, _ = _manager_slots(g, 4, 40, [24], 8, torch.bfloat16, garbage_off_diagonal=False)
    x = torch.randn(10, 40, generator=g).bfloat16()
    out0 = torch.randn(10, 24, generator=g).bfloat16()
    for path in ("segment", "stacked"):
        o16, o32 = out0.clone(), out0.clone()
        add_lora(o16, x, a16, b16, mapping, path=path)
        add_lora(o32, x, a16.float(), b16.float(), mapping, path=path)
        diff = (o16.double() - o32.double()).abs()
        bound = 2.0**-7 * (o32.double().abs() + (o32.double() - out0.double()).abs()) + 1e-6
        assert bool((diff <= bound).all()), path
