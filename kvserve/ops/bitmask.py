"""Structured-output token masks on float32 logits (C/OpenMP; algorithm and measurements in
``kvserve/csrc/bitmask.c``).

- ``apply_token_bitmask_``: disallowed tokens of the constrained rows set to ``-inf``, in place.
- ``greedy_sample_masked``: greedy tokens and their log-probabilities with the mask fused in
  (nothing written), equal to masking then ``elementwise.greedy_sample``.

A mask row is int32 ``[W]`` (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed); tokens
at or past ``32 * W`` are not allowed. ``supported`` says whether the native path applies;
callers fall back to torch (``kvserve.model_executor.layers.bitmask``).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import NativeLibrary

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIB = NativeLibrary(
    "kv_bitmask",
    "bitmask.c",
    {
        "apply_token_bitmask_f32": [_p, _i64, _p, _p, _i64, _i64, _i],
        "greedy_sample_masked_f32": [_p, _i64, _i64, _p, _p, _i64, _p, _p, _i],
    },
)


def available() -> bool:
    """True when the kernels are built and loaded (and ``KVSERVE_NATIVE`` is not ``0``)."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supported(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """True when ``logits`` is a contiguous CPU float32 ``[N, V]`` tensor, ``bitmask`` a
    contiguous CPU int32 ``[R, W]`` one, and the library is available."""
    return (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_cpu
        and logits.is_contiguous()
        and bitmask.dtype == torch.int32
        and bitmask.dim() == 2
        and bitmask.is_cpu
        and bitmask.is_contiguous()
        and _LIB.available()
    )


def _check(
    logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor | None, n: int, bound: int, what: str
):
    if not supported(logits, bitmask):
        raise ValueError(
            f"{what}: need contiguous CPU float32 logits [N, V] and int32 bitmask [R, W], got "
            f"{logits.dtype} {tuple(logits.shape)} on {logits.device} and {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    if index is not None:
        if index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] != n or not index.is_cpu:
            raise ValueError(
                f"{what}: row index must be CPU int64 [{n}], got {index.dtype} {tuple(index.shape)}"
            )
        if n and (int(index.min()) < -1 or int(index.max()) >= bound):
            raise ValueError(f"{what}: row index out of range [0, {bound})")


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: float32 ``[N, V]``, contiguous, CPU.
        rows: int64 ``[R]``: row ``rows[i]`` of ``logits`` takes mask row ``i`` (``None``: ``R == N``,
            row ``i`` takes mask row ``i``). Distinct rows.
        bitmask: int32 ``[R, W]``, contiguous, CPU.
    Raises:
        ValueError: dtypes, shapes, devices or row indices do not fit, or the library is unavailable.
    """
    R, W = bitmask.shape
    _check(logits, bitmask, rows, R, logits.shape[0], "apply_token_bitmask_")
    if rows is None and R != logits.shape[0]:
        raise ValueError(f"apply_token_bitmask_: {R} mask rows for {logits.shape[0]} logits rows")
    if rows is not None and R and int(rows.min()) < 0:
        raise ValueError("apply_token_bitmask_: row index out of range")
    if R == 0:
        return
    rows = None if rows is None else rows.contiguous()
    _LIB.call(
        "apply_token_bitmask_f32",
        logits,
        logits.shape[1],
        rows,
        bitmask,
        R,
        W,
        torch.get_num_threads(),
    )


def greedy_sample_masked(
    logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and log-probabilities of ``logits`` under the masks (``logits`` unchanged).

    Args:
        logits: float32 ``[N, V]``, contiguous, CPU.
        bitmask: int32 ``[R, W]``, contiguous, CPU.
        mask_rows: int64 ``[N]``: the mask row of each logits row, ``-1`` for an unconstrained row.
    Returns:
        ``(tokens int64 [N], logprobs float32 [N])``: argmax over the allowed tokens (ties to the
        lowest index) and ``-logsumexp`` of the allowed logits relative to it; a row with no
        allowed token gives token 0 and NaN, as masking then ``torch.argmax`` would.
    Raises:
        ValueError: dtypes, shapes, devices or row indices do not fit, or the library is unavailable.
    """
    N = logits.shape[0] if logits.dim() == 2 else -1
    _check(logits, bitmask, mask_rows, N, bitmask.shape[0], "greedy_sample_masked")
    tok = torch.empty(N, dtype=torch.int64)
    lp = torch.empty(N, dtype=torch.float32)
    if N:
        mask_rows = mask_rows.contiguous()
        _LIB.call(
            "greedy_sample_masked_f32",
            logits,
            N,
            logits.shape[1],
            bitmask,
            mask_rows,
            bitmask.shape[1],
            tok,
            lp,
            torch.get_num_threads(),
        )
    return tok, lp
