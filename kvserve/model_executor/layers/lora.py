"""The batched LoRA linear: ``out[t] += (x[t] @ A[s_t]) @ B[s_t]`` for every row ``t`` whose
slot ``s_t >= 0``, all adapters of a step at once.

Segment-gathered, in the style of Punica's SGMV (Chen et al., "Punica: Multi-Tenant LoRA
Serving", 2023): once per step the rows with an adapter are grouped by slot
(``LoRAMapping``: one permutation and a list of ``(slot, start, end)`` segments); each target
linear then gathers those rows once, runs two small matmuls per *active slot* (shrink to the
rank, expand to the output; a loop over at most ``max_loras`` slots, never over requests or
tokens) into one scratch buffer with a zero row at its end, gathers that back into batch order
(base rows read the zero row) and adds it to the output: CPU ``index_add_`` is several times
slower than ``index_select`` at decode-sized shapes, so it is kept for steps where few rows
have an adapter (``SCATTER_BELOW``). When
every row has an adapter and the rows are already in slot order both gathers are skipped. ``scale`` is folded into ``B`` at load. Plain torch ops: float32 and bfloat16, CPU and
CUDA alike.

Stacked form, for small steps (``use_stacked``: ``rows x k <= STACKED_MAX_ROW_SLOTS``, ``k`` =
highest active slot + 1): every row runs through slots ``0..k-1`` at once,
``out.addmm_((x @ A_cat[:, :k*R]) * M, B_cat[:k*R])`` with ``A_cat [in, S*R]`` a view of the
manager's ``[in, S, R]`` storage and ``M`` the step's row mask (ones in the row's slot columns,
zeros for other slots and base rows, so those add exactly 0 and no gather is needed; applied
as a fill of the zero columns, so another slot's inf is dropped, not turned into nan; freed
slots are zeroed by the manager, so ``B_cat``'s rows of slots no row uses are finite): 3 torch
calls per linear instead of ~2 per slot plus gathers. Why the limit: the form does ``k``-fold
shrink and expand FLOPs, which its fewer calls pay for only while ``rows x k`` is small
(``STACKED_MAX_ROW_SLOTS``; the crossover is in docs/benchmarks.md, CPU kernels).

Compute dtype (``lora_compute_dtype``): on CPU the torch forms of a bfloat16 or float16 model
upcast the gathered rows once, run both matmuls in float32 and cast the delta back once before
adding it; the slots are float32 there (``lora_slot_dtype``), or bfloat16 ones widened per call
when the native kernel (which widens them in registers) exists. Why: without AVX512-BF16/AMX, torch's small bfloat16 matmuls
take an unpacked path several times slower than float32 at these shapes (rank 16,
``[n, 576] @ [576, 48]`` then ``[n, 48] @ [48, 960]``), and a float32 delta added straight into
a bfloat16 output is slower again than casting it first. The rows and the rank are small,
so the extra casts cost little; the deltas are also more exact than bfloat16 ones.

Native form, for CPU steps (``use_native``: ``rows <= NATIVE_MAX_ROWS``, no limit by default, and the C kernel
built, ``kvserve.ops.lora``): one C call per linear streams each active
slot's ``A`` and ``B`` once per 8 rows of that slot, keeping the rows' partial sums in
registers, and reads only each fused part's diagonal block of ``B`` (``parts``: the output
column bounds of q/k/v or gate/up; without them the whole block-diagonal ``B``, zeros included,
as the torch forms do). Why: at decode sizes the op is a stream over the slots' weights, which
torch's small matmuls read at a fraction of the memory bandwidth, each with its own dispatch
cost (docs/benchmarks.md, CPU kernels).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.ops import lora as lora_kernel

#: Scatter the deltas with ``index_add_`` when fewer than 1 in ``SCATTER_BELOW`` rows has an
#: adapter (it touches only those rows); otherwise gather them into batch order and add densely.
SCATTER_BELOW = 4

#: Run the stacked form while ``rows * stacked slots`` is at most this (``use_stacked``).
STACKED_MAX_ROW_SLOTS = 32

#: Run the native kernel for steps of at most this many rows (``use_native``; 0 = never): it
#: beats the torch forms from decode steps up to a full 2048-token chunked-prefill step
#: (docs/benchmarks.md, CPU kernels). Its work is linear in the rows (chunks of 8 rows per slot,
#: each slot's weights re-read per chunk from cache), so there is no size at which the torch
#: forms win: no limit by default; tests set it to force the torch forms.
NATIVE_MAX_ROWS = sys.maxsize


def lora_compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the torch forms compute LoRA deltas in for a model (or slots) of ``dtype`` on
    ``device``: float32 on CPU for bfloat16/float16 (see the module docstring), else ``dtype``."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def lora_slot_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype ``LoRAManager`` keeps the slots of a ``dtype`` model on ``device`` in: the model
    dtype, except float32 on CPU for a bfloat16 model without the native kernel and for a
    float16 one (``lora_compute_dtype``). Why bfloat16 slots with the kernel: the adapters are
    validated and cached in the model dtype, so bfloat16 slots hold exactly the values float32
    ones would, the kernel widens them exactly in registers (bit-identical deltas), and a
    decode step streams half the bytes; the torch forms (large steps) widen them per call."""
    cdt = lora_compute_dtype(dtype, device)
    if cdt != dtype and dtype == torch.bfloat16 and lora_kernel.available():
        return dtype
    return cdt


@dataclass
class LoRAMapping:
    """Which rows of a step's flattened batch run which adapter slot.

    Attributes:
        row_slots: int64 numpy ``[T]``: the slot of each row, -1 = the base model.
        rows: int64 tensor ``[N]`` (on the model's device): the rows with a slot, grouped by
            slot (stable: batch order within a slot).
        segments: ``(slot, start, end)``: ``rows[start:end]`` run slot ``slot``.
        inverse: int64 tensor ``[T]``: row ``t``'s index in ``rows``, or ``len(rows)`` for a base
            row (the zero row of the op's scratch).
        contiguous: ``rows == arange(T)``: every row has an adapter and they are in slot order,
            so the op reads ``x`` and adds into ``out`` in place.
        segs: int64 CPU tensor ``[len(segments), 3]``: ``segments`` for the native kernel.
    """

    row_slots: np.ndarray
    rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    contiguous: bool
    inverse: torch.Tensor
    segs: torch.Tensor
    #: (rank width, dtype) -> the stacked path's row mask, built once per step (``row_mask``)
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, row_slots: np.ndarray, device: torch.device | str = "cpu") -> LoRAMapping | None:
        """The mapping of ``row_slots`` (int ``[T]``, -1 = base); None when no row has a slot."""
        row_slots = np.asarray(row_slots, dtype=np.int64)
        has = row_slots >= 0
        if not has.any():
            return None
        idx = np.nonzero(has)[0]
        order = np.argsort(row_slots[idx], kind="stable")
        rows = idx[order]
        sorted_slots = row_slots[rows]
        bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [len(rows)]))
        segments = [(int(sorted_slots[a]), int(a), int(b)) for a, b in zip(starts, ends)]
        contiguous = len(rows) == len(row_slots) and bool((rows == np.arange(len(rows))).all())
        inverse = np.full(len(row_slots), len(rows), dtype=np.int64)
        inverse[rows] = np.arange(len(rows))
        return cls(
            row_slots,
            torch.from_numpy(rows).to(device),
            segments,
            contiguous,
            torch.from_numpy(inverse).to(device),
            torch.tensor(segments, dtype=torch.int64),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.row_slots)

    def active_slots(self) -> list[int]:
        """The slots this step uses."""
        return [s for s, _, _ in self.segments]

    @property
    def num_stacked_slots(self) -> int:
        """``k``: the stacked path computes slots ``0 .. k-1`` (the highest active slot + 1)."""
        return self.segments[-1][0] + 1

    def row_mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``M [T, k * width]`` (``k = num_stacked_slots``): 1 in the ``width`` columns of row
        ``t``'s slot, 0 elsewhere and in base rows; cached per ``(width, dtype)`` for the step."""
        key = (width, dtype)
        m = self._masks.get(key)
        if m is None:
            k = self.num_stacked_slots
            onehot = np.zeros((self.num_tokens, k, width), dtype=np.float32)
            has = self.row_slots >= 0
            onehot[np.nonzero(has)[0], self.row_slots[has]] = 1.0
            m = torch.from_numpy(onehot.reshape(self.num_tokens, k * width)).to(self.rows.device, dtype)
            self._masks[key] = m
        return m

    def drop_mask(self, width: int) -> torch.Tensor:
        """bool ``[T, k * width]``: ``row_mask``'s zeros (the columns the stacked form must
        zero: other slots', every column of a base row); cached per ``width`` for the step."""
        key = (width, torch.bool)
        m = self._masks.get(key)
        if m is None:
            m = self.row_mask(width, torch.float32) == 0
            self._masks[key] = m
        return m

    def slice(self, start: int, end: int) -> LoRAMapping | None:
        """The mapping of rows ``[start, end)`` alone (for a layer that runs the batch in chunks)."""
        return LoRAMapping.build(self.row_slots[start:end], self.rows.device)


def stacked_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_cat [in, S * R]`` and ``B_cat [S * R, out]``: every slot's ``A`` side by side along
    the rank and every slot's ``B`` stacked along it (slot ``s`` owns columns / rows
    ``[s * R, (s + 1) * R)``). Views when ``a`` is stored ``[in, S, R]`` (``a.permute(1, 0, 2)``,
    as ``LoRAManager`` allocates it) and ``b`` is contiguous; otherwise copies."""
    S, fin, R = a.shape
    return a.permute(1, 0, 2).reshape(fin, S * R), b.reshape(S * R, b.shape[2])


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    mapping: LoRAMapping,
    path: str | None = None,
    parts: tuple[int, ...] | None = None,
) -> None:
    """``out[t] += (x[t] @ a[s_t]) @ b[s_t]`` in place for the rows of ``mapping``.

    Args:
        out: ``[T, out_features]``, the base linear's output (written in place).
        x: ``[T, in_features]``, the linear's input, in ``out``'s dtype.
        a: ``[slots, in_features, R]``; b: ``[slots, R, out_features]`` (scale folded in);
            slots never loaded are zeros. On ``x``'s device, in the slot dtype
            (``lora_slot_dtype``: ``x``'s, or float32); every form computes in
            ``lora_compute_dtype`` (float32 on CPU), the delta rounded to ``out``'s dtype once.
        mapping: the step's rows per slot; ``mapping.num_tokens == T``.
        path: ``"native"``, ``"stacked"`` or ``"segment"`` to force one (tests, benchmarks);
            None chooses: ``use_native``, else ``use_stacked``.
        parts: the output column bounds of a fused linear's parts (``(0, q, q + kv, q + 2 kv)``
            for qkv: ``P + 1`` increasing ints), whose rank columns are ``a.shape[2] / P`` wide
            each, ``b`` block-diagonal over them (``LoRAManager``'s layout): the native form then
            skips ``b``'s zero blocks. None: one part, all of ``b``.
    Raises:
        ValueError: mismatched shapes (checked cheaply: row counts and feature sizes), an
            unknown ``path``, or ``"native"`` forced where the kernel does not apply.
    """
    T = x.shape[0]
    if mapping.num_tokens != T or out.shape[0] != T:
        raise ValueError(f"add_lora: mapping has {mapping.num_tokens} rows, x {T}, out {out.shape[0]}")
    if a.shape[1] != x.shape[1] or b.shape[2] != out.shape[1] or a.shape[2] != b.shape[1]:
        raise ValueError(
            f"add_lora: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit x {tuple(x.shape)} -> "
            f"out {tuple(out.shape)}"
        )
    if path is None or path == "native":
        if (path is not None or T <= NATIVE_MAX_ROWS) and lora_kernel.lora_add(
            out, x, a, b, (0, out.shape[1]) if parts is None else parts, mapping.rows, mapping.segs
        ):
            return
        if path is not None:
            raise ValueError(
                f"add_lora: path='native' but the kernel does not take out {out.dtype} on {out.device}, "
                f"x {x.dtype} strides {x.stride()}, A {a.dtype} strides {a.stride()}, B {b.dtype} "
                f"(not supported: CPU float32/bfloat16, innermost dimensions contiguous, the library "
                f"built: {lora_kernel.failure_reason() or 'yes'})"
            )
        path = "stacked" if use_stacked(mapping) else "segment"
    if path == "stacked":
        _add_lora_stacked(out, x, a, b, mapping)
    elif path == "segment":
        _add_lora_segments(out, x, a, b, mapping)
    else:
        raise ValueError(f"add_lora: path must be 'native', 'stacked', 'segment' or None, got {path!r}")


def use_native(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the step runs the native kernel: at most ``NATIVE_MAX_ROWS`` rows and tensors it
    takes (``lora_kernel.supported``: CPU, float32/bfloat16, the library built)."""
    return x.shape[0] <= NATIVE_MAX_ROWS and lora_kernel.supported(out, x, a, b)


def use_stacked(mapping: LoRAMapping) -> bool:
    """Whether the step runs the stacked form: ``T * k <= STACKED_MAX_ROW_SLOTS`` (``T`` rows,
    ``k`` = highest active slot + 1), i.e. while the ``k``-fold shrink and expand FLOPs of
    computing every slot for every row cost less than the segment form's per-slot torch calls
    and gathers; and not when the segment form is two matmuls already (one slot, every row on
    it)."""
    if mapping.contiguous and len(mapping.segments) == 1:
        return False
    return mapping.num_tokens * mapping.num_stacked_slots <= STACKED_MAX_ROW_SLOTS


def _add_lora_stacked(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping
) -> None:
    # every row through slots 0..k-1 at once; the mask zeroes the columns of other slots (and
    # every column of a base row), so no gather or scatter: 3 torch calls (+ casts) per linear
    cdt = lora_compute_dtype(a.dtype, a.device)
    R = a.shape[2]
    a_cat, b_cat = stacked_views(a, b)
    w = mapping.num_stacked_slots * R
    aw, bw = a_cat[:, :w], b_cat[:w]
    if aw.dtype != cdt:  # bfloat16 slots: widened exactly (``lora_slot_dtype``)
        aw, bw = aw.to(cdt), bw.to(cdt)
    xs = x if x.dtype == cdt else x.to(cdt)
    h = torch.mm(xs, aw)
    # filled, not multiplied by the 0/1 mask: another slot's columns may overflow to inf for
    # this row (an adapter of huge but finite weights), and inf * 0 = nan would reach the row
    h.masked_fill_(mapping.drop_mask(R), 0.0)
    if cdt == out.dtype:
        out.addmm_(h, bw)
    else:
        out.add_(torch.mm(h, bw).to(out.dtype))


def _add_lora_segments(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping
) -> None:
    T = x.shape[0]
    cdt = lora_compute_dtype(a.dtype, a.device)
    same = cdt == out.dtype
    if a.dtype != cdt:  # bfloat16 slots: widened exactly (``lora_slot_dtype``), per slot used

        def ab(s: int) -> tuple[torch.Tensor, torch.Tensor]:
            return a[s].to(cdt), b[s].to(cdt)
    else:

        def ab(s: int) -> tuple[torch.Tensor, torch.Tensor]:
            return a[s], b[s]

    if mapping.contiguous:
        xs = x if x.dtype == cdt else x.to(cdt)
        for s, lo, hi in mapping.segments:
            a_s, b_s = ab(s)
            if same:
                out[lo:hi].addmm_(torch.mm(xs[lo:hi], a_s), b_s)
            else:  # one segment's delta at a time: the float32 temporary stays small
                out[lo:hi].add_(torch.mm(torch.mm(xs[lo:hi], a_s), b_s).to(out.dtype))
        return
    xs = x.index_select(0, mapping.rows)
    if xs.dtype != cdt:
        xs = xs.to(cdt)
    n = xs.shape[0]
    mid = torch.empty(n, a.shape[2], dtype=cdt, device=x.device)
    delta = torch.empty(n + 1, b.shape[2], dtype=cdt, device=out.device)
    for s, lo, hi in mapping.segments:
        a_s, b_s = ab(s)
        torch.mm(xs[lo:hi], a_s, out=mid[lo:hi])
        torch.mm(mid[lo:hi], b_s, out=delta[lo:hi])
    if n * SCATTER_BELOW < T:  # few adapter rows (e.g. one adapter prompt in a big prefill)
        out.index_add_(0, mapping.rows, delta[:n] if same else delta[:n].to(out.dtype))
    else:
        delta[n].zero_()
        if not same:  # cast the n + 1 rows before the gather to T rows
            delta = delta.to(out.dtype)
        out.add_(delta.index_select(0, mapping.inverse))
