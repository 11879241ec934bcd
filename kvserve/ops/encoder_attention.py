"""Bidirectional attention of an encoder step on CPU (C/OpenMP; the algorithm is in
``kvserve/csrc/encoder_attention.c``): every sequence of the step attends its own tokens, read in
place from the fused q/k/v projection, with no padding, gather or mask.

If the kernel cannot be built or ``KVSERVE_NATIVE=0`` is set, ``supports`` is False and the
caller keeps its torch path (padded ``scaled_dot_product_attention``).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

#: Largest head_dim of the kernel (``EA_MAX_D``); head_dim must also be a multiple of 8.
MAX_HEAD_DIM = 256

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    f"encoder_attention_{sfx}": [_p, _i64, _p, _i64, _p, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int]
    for sfx in DTYPE_SUFFIX.values()
}
_LIB = NativeLibrary(
    "kv_encoder_attention",
    "encoder_attention.c",
    _SIGNATURES,
    restypes={name: ctypes.c_int for name in _SIGNATURES},
)


def available() -> bool:
    """True when the kernel is built and loaded (and ``KVSERVE_NATIVE`` is not ``0``)."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """True when the kernel is built and takes this dtype (float32 / bfloat16) and head size
    (a multiple of 8, at most ``MAX_HEAD_DIM``)."""
    return dtype in DTYPE_SUFFIX and head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM and _LIB.available()


def encoder_attention(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, head_dim: int, scale: float
) -> torch.Tensor:
    """Bidirectional attention of packed sequences.

    Args:
        qkv: ``[T, 3 * H]`` CPU float32 / bfloat16, rows contiguous (``H = num_heads *
            head_dim``): each row's q, then k, then v, head ``h`` at ``h * head_dim``.
        cu_seqlens: int64 ``[S + 1]``: sequence ``s`` is rows ``cu_seqlens[s] ..
            cu_seqlens[s + 1] - 1``; starts at 0, non-decreasing, ends at most at ``T`` (rows
            past its end are padding: their outputs are 0).
        scale: the score scale (``head_dim ** -0.5`` for BERT).

    Returns:
        ``[T, H]`` in ``qkv``'s dtype: ``softmax(scale * q k^T) v`` per sequence and head.

    Raises:
        ValueError: a shape, dtype or ``cu_seqlens`` that breaks the contract, or ``supports``
            False; RuntimeError: the kernel could not allocate its score buffer.
    """
    T = qkv.shape[0] if qkv.dim() == 2 else -1
    H = num_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != 3 * H or qkv.stride(1) != 1 or not qkv.is_cpu:
        raise ValueError(f"encoder_attention: qkv must be a CPU [T, 3 * {H}] tensor, got {tuple(qkv.shape)}")
    if not supports(qkv.dtype, head_dim):
        raise ValueError(f"encoder_attention: unsupported dtype {qkv.dtype} or head_dim {head_dim}")
    cu = cu_seqlens
    if (
        cu.dtype != torch.int64
        or cu.dim() != 1
        or cu.numel() < 1
        or not cu.is_contiguous()
        or int(cu[0]) != 0
        or not 0 <= int(cu[-1]) <= T
        or bool((cu[1:] < cu[:-1]).any())
    ):
        raise ValueError(f"encoder_attention: cu_seqlens must be int64 from 0 to at most {T}, non-decreasing")
    out = torch.empty(T, H, dtype=qkv.dtype)
    failed = _LIB.call(
        f"encoder_attention_{DTYPE_SUFFIX[qkv.dtype]}",
        qkv,
        qkv.stride(0),
        cu,
        cu.numel() - 1,
        out,
        H,
        num_heads,
        head_dim,
        float(scale),
        torch.get_num_threads(),
    )
    if failed:
        raise RuntimeError("encoder_attention: could not allocate the score buffer")
    out[int(cu[-1]) :].zero_()
    return out
