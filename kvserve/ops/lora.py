"""The batched LoRA delta of one fused target linear as one C call (``kvserve/csrc/lora.c``:
algorithm, numerics and why): ``out[t, cols_p] += (x[t] @ A[s_t]_p) @ B[s_t]_p`` for the rows of
a step's ``LoRAMapping`` and each part ``p`` of the fused linear, reading only each part's
diagonal block of the manager's block-diagonal ``B``.

Used by ``kvserve.model_executor.layers.lora.add_lora`` for CPU steps (up to that module's
``NATIVE_MAX_ROWS`` rows: no limit by default); torch otherwise. Activations float32 or
bfloat16, weights (the slots) float32 or bfloat16.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGS = {
    f"lora_add_{xs}_w{ws}": [
        _p,
        _i64,
        _p,
        _i64,
        _p,
        _i64,
        _i64,
        _p,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _p,
        _p,
        _p,
        _i64,
        _i,
    ]
    for xs in DTYPE_SUFFIX.values()
    for ws in DTYPE_SUFFIX.values()
}
_LIB = NativeLibrary("kv_lora", "lora.c", _SIGS, restypes=dict.fromkeys(_SIGS, ctypes.c_int))
#: column bounds (a tuple) -> the int64 tensor the kernel reads; a model has ~4 distinct ones
_COLS: dict[tuple[int, ...], torch.Tensor] = {}


def available() -> bool:
    """Whether the kernel built and loaded (False with ``KVSERVE_NATIVE=0`` or no C compiler)."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supported(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``lora_add`` takes these tensors: CPU, ``x``/``out`` of one float32/bfloat16
    dtype, ``a``/``b`` float32 or bfloat16, every innermost dimension contiguous, and the
    library available."""
    return (
        x.dtype in DTYPE_SUFFIX
        and out.dtype == x.dtype
        and a.dtype in DTYPE_SUFFIX
        and b.dtype == a.dtype
        and x.is_cpu
        and out.is_cpu
        and a.is_cpu
        and b.is_cpu
        and x.stride(1) == 1
        and out.stride(1) == 1
        and a.stride(2) == 1
        and b.stride(2) == 1
        and _LIB.available()
    )


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cols: tuple[int, ...],
    rows: torch.Tensor,
    segs: torch.Tensor,
) -> bool:
    """``out[rows] += delta`` in place (see the module docstring), when the kernel takes these
    tensors (``supported``).

    Args:
        out: ``[T, >= cols[-1]]``, the base linear's output; x: ``[T, in]``.
        a: ``[S, in, P * R]``; b: ``[S, P * R, >= cols[-1]]`` (block-diagonal over the parts).
        cols: ``P + 1`` increasing output column bounds of the parts, from ``>= 0`` to at most
            ``out``'s and ``b``'s widths.
        rows: int64 ``[N]``, the rows with a slot grouped by slot; segs: int64 ``[nseg, 3]``
            ``(slot, start, end)`` over ``rows`` (``LoRAMapping.segments``). Row and slot
            indices are trusted (``LoRAMapping`` builds them in range).
    Returns:
        False, having done nothing, when ``supported`` is False (the caller runs torch).
    Raises:
        ValueError: ``cols`` out of order or range, ``P * R`` not ``a.shape[2]``, or shapes
            that do not fit each other.
        MemoryError: no memory for the kernel's scratch rows (nothing written).
    """
    if not supported(out, x, a, b):
        return False
    ct = _COLS.get(cols)
    if ct is None:
        if len(cols) < 2 or cols[0] < 0 or any(hi <= lo for lo, hi in zip(cols, cols[1:])):
            raise ValueError(f"native lora_add: cols must be >= 2 increasing bounds from >= 0, got {cols}")
        ct = _COLS[cols] = torch.tensor(cols, dtype=torch.int64)
    P = len(cols) - 1
    S, fin, w = a.shape
    if (
        w % P
        or x.shape[1] != fin
        or tuple(b.shape[:2]) != (S, w)
        or cols[-1] > out.shape[1]
        or cols[-1] > b.shape[2]
        or out.shape[0] != x.shape[0]
        or rows.dtype != torch.int64
        or segs.dtype != torch.int64
        or not (rows.is_contiguous() and segs.is_contiguous())
    ):
        raise ValueError(
            f"native lora_add: out {tuple(out.shape)}, x {tuple(x.shape)}, A {tuple(a.shape)}, "
            f"B {tuple(b.shape)}, part columns {cols}, rows {rows.dtype}, segs {segs.dtype}: do not fit "
            "(A's rank columns split evenly over the parts, the parts within out's and B's widths)"
        )
    # the kernel returns 1 when out of memory
    if _LIB.call(
        f"lora_add_{DTYPE_SUFFIX[x.dtype]}_w{DTYPE_SUFFIX[a.dtype]}",
        x,
        x.stride(0),
        out,
        out.stride(0),
        a,
        a.stride(0),
        a.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        fin,
        P,
        w // P,
        ct,
        rows,
        segs,
        segs.shape[0],
        torch.get_num_threads(),
    ):
        raise MemoryError(f"native lora_add: no memory for the scratch rows ({fin} + {w} floats per row)")
    return True
