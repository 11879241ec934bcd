"""Prefill attention on CPU straight from the paged KV cache: every multi-token chunk of a step
in one call per layer (C/OpenMP; flash attention on AVX-512, or on AMX tiles for bfloat16 where
the CPU and process have them: ``USE_AMX``). The algorithm, work split and measurements are in
``kvserve/csrc/prefill_attention.c``.

If the kernel cannot be built or ``KVSERVE_NATIVE=0`` is set, ``available()`` is False; callers
keep the torch path then, and for other dtypes, devices and shapes (``supports``: ``head_dim`` a
multiple of 16, at most 256).

Kernel contract (``q`` rows may be any stride apart; everything else contiguous; q, cache and
out of one dtype, float32 or bfloat16, or a quantized cache of ``attention.QUANT_KIND``; indices
int64)::

    q        [T, H, D]          query rows of all chunks, H = KH * G (heads h*G .. h*G+G-1
                                share KV head h)
    cache    [2, KH, NB, BS, D] one layer's cache ([0] = K, [1] = V), the chunks' own K/V
                                already written; quantized: [2, KH, NB, BS, D + 2], rows of
                                codes and a float16 scale (``layers.kv_quant``), widened to
                                float32 per key step (the AVX-512 path, never AMX)
    table    [C, NBMAX]         row c: block ids of block indices kstart[c]//BS, +1, ...
    q_start  [C + 1]            chunk c = rows q_start[c] .. q_start[c+1]-1 (non-decreasing)
    pos0     [C]                position of chunk c's first row (its cached context length)
    kstart   [C]                first key position the table covers (a multiple of BS, at
                                most max(0, pos0[c] - window + 1), 0 without a window)
    window   int                0: causal; W > 0: a row at position p attends keys p-W+1 .. p
    out      [T, H, D]          rows of the chunks written, others untouched

A row at position ``p`` attends keys ``max(0, p - W + 1) <= k <= p`` (all ``k <= p`` for
``W = 0``), as the torch path's masks. The kernel checks the chunk geometry (row ranges, key
starts, table width, block ids in range) before touching memory; the wrapper raises
``ValueError`` for a violation.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops import attention as paged_attention
from kvserve.ops import gemm_amx
from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

#: Largest head_dim of the kernel (16 vectors of 16 floats per row).
MAX_HEAD_DIM = 256


_p, _i64 = ctypes.c_void_p, ctypes.c_int64
# (q, qs, cache, table, nbmax, q_start, pos0, kstart, nc, window, out, T, KH, G, D, NB, BS, scale,
#  amx, gather_bytes, nthreads, status): the prototype in csrc/prefill_attention_dtype.h
_ARGS = [_p, _i64, _p, _p, _i64, _p, _p, _p, _i64, _i64, _p, *[_i64] * 6, ctypes.c_float, ctypes.c_int, _i64]
_SIGNATURES = {
    f"kv_paged_prefill_attention_{sfx}": [*_ARGS, ctypes.c_int, _p] for sfx in DTYPE_SUFFIX.values()
}
# the same over a quantized cache, the codes' kind last (csrc/prefill_attention_dtype.h)
_SIGNATURES.update(
    {
        f"kv_paged_prefill_attention_q8_{sfx}": [*_ARGS, ctypes.c_int, _p, ctypes.c_int]
        for sfx in DTYPE_SUFFIX.values()
    }
)
_LIB = NativeLibrary(
    "kv_prefill_attention",
    "prefill_attention.c",
    _SIGNATURES,
)

#: bfloat16 with head_dim a multiple of 32 on AMX tiles when this CPU and process have them
#: (False: the AVX-512 path, e.g. to compare the two): on unless ``$KVSERVE_ATTENTION_AMX`` is
#: ``0`` (``paged_attention.AMX_ENV``, read once there for both attention kernels).
USE_AMX = paged_attention.USE_AMX
#: AMX path: most bytes of keys gathered (K rows and V^T, per chunk and KV head) at once; a call
#: whose chunks need more takes them in batches (a chunk alone may exceed it).
GATHER_BYTES = 64 << 20


def amx_available() -> bool:
    """True when the kernel is built and this process may use AMX tiles (Linux grants them per
    process: ``gemm_amx.available()`` asks)."""
    return _LIB.available() and gemm_amx.available()


_ERRORS = {
    1: "q_start must be non-decreasing within [0, T]",
    2: "pos0 must be >= 0 and the chunk's positions below 2**31 - 16",
    3: "kstart must be >= 0, a multiple of the block size and at most the chunk's first attended key",
    4: "table is too narrow for the chunk's keys",
    5: "table holds a block id outside the cache",
    6: "head_dim must be a multiple of 16 and at most 256",
    7: "out of memory",
    8: "unknown quantized cache kind",
}
_ERROR_ARG = {1: "q_start", 2: "pos0", 3: "kstart", 4: "table", 5: "table", 6: "q", 7: "out", 8: "kv_cache"}


def available() -> bool:
    """True when the native kernel is compiled and loaded."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """True for the shapes and dtypes the kernel takes: float32 or bfloat16, ``head_dim`` a
    multiple of 16 up to ``MAX_HEAD_DIM``, ``num_heads`` a multiple of ``num_kv_heads``."""
    return (
        dtype in DTYPE_SUFFIX
        and head_dim % 16 == 0
        and 0 < head_dim <= MAX_HEAD_DIM
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    q_start: torch.Tensor,
    pos0: torch.Tensor,
    kstart: torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``C`` multi-token chunks straight from the paged cache.

    Args:
        q: ``[T, H, D]``, float32 or bfloat16; heads contiguous within a row (``stride(1) == D``,
            ``stride(2) == 1``), rows any stride ``>= H * D`` apart (e.g. a view of the fused
            q/k projection).
        kv_cache: ``[2, KH, NB, BS, D]`` contiguous (one layer), ``q``'s dtype, ``H % KH == 0``;
            the chunks' K/V already written. Or a quantized cache ``[2, KH, NB, BS, D + 2]`` of
            an ``attention.QUANT_KIND`` dtype (rows of codes and a float16 scale,
            ``model_executor.layers.kv_quant``), read in place.
        table: int64 ``[C, NBMAX]``; row ``c`` lists the block ids of block indices
            ``kstart[c] // BS`` onwards.
        q_start: int64 ``[C + 1]``: chunk ``c`` is rows ``q_start[c] .. q_start[c+1] - 1``.
        pos0: int64 ``[C]``: position of chunk ``c``'s first row (tokens before it are cached).
        kstart: int64 ``[C]``: first key position of ``table[c]`` (see the module doc).
        scale: softmax scale (``D ** -0.5`` for Llama).
        window: sliding window in tokens, 0 for none.
        out: optional contiguous ``[T, H, D]`` of ``q``'s dtype to write into (rows outside the
            chunks are left as they are).
    Returns:
        ``out`` (allocated when not given).
    Raises:
        RuntimeError: the kernel is not available (check ``available()`` first).
        ValueError: naming the argument: unsupported or mixed dtypes, tensors off CPU, wrong
            shapes or layouts, index tensors not int64, an unsupported head_dim, a negative
            window, or chunk geometry the kernel refuses (see the module doc).
    """
    if not _LIB.available():
        raise RuntimeError(f"native prefill attention unavailable: {_LIB.failure_reason()}")
    quant = kv_cache.dtype in paged_attention.QUANT_KIND
    if (not quant and q.dtype != kv_cache.dtype) or q.dtype not in DTYPE_SUFFIX:
        raise ValueError(
            f"native prefill attention: q must be float32 or bfloat16 and kv_cache of q's dtype or "
            f"a quantized one (int8, float8), got q {q.dtype} and kv_cache {kv_cache.dtype}."
        )
    if q.device.type != "cpu" or kv_cache.device.type != "cpu":  # raw pointers: host memory only
        raise ValueError(
            f"native prefill attention is CPU-only, got q on {q.device} and kv_cache on {kv_cache.device}."
        )
    if q.dim() != 3:
        raise ValueError(f"native prefill attention: q must be [T, H, D], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[4] != D + (2 if quant else 0)
        or not kv_cache.is_contiguous()
    ):
        raise ValueError(
            f"native prefill attention: kv_cache must be a contiguous [2, KH, NB, BS, "
            f"{D + 2 if quant else D}] tensor, "
            f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    _, KH, NB, BS, _ = kv_cache.shape
    if BS == 0:  # (the kernel divides by it)
        raise ValueError("native prefill attention: kv_cache's block size (dim 3) must be >= 1")
    if KH == 0 or H % KH:
        raise ValueError(
            f"native prefill attention: q's {H} heads are not a multiple of kv_cache's {KH} KV heads"
        )
    if not supports(H, KH, D, q.dtype):
        raise ValueError(
            f"native prefill attention: q head_dim {D} must be a multiple of 16, at most {MAX_HEAD_DIM}"
        )
    if q.stride(2) != 1 or q.stride(1) != D or (T > 1 and q.stride(0) < H * D):
        raise ValueError(
            f"native prefill attention: q must be [T, H, D] with contiguous rows (any row stride "
            f">= H*D), got strides {q.stride()}"
        )
    for name, t, dims in (
        ("table", table, 2),
        ("q_start", q_start, 1),
        ("pos0", pos0, 1),
        ("kstart", kstart, 1),
    ):
        if t.dtype != torch.int64 or not t.is_cpu or not t.is_contiguous() or t.dim() != dims:
            raise ValueError(
                f"native prefill attention: {name} must be a contiguous {dims}-D CPU tensor of int64, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}, strides {t.stride()}"
            )
    C = table.shape[0]
    if q_start.shape[0] != C + 1 or pos0.shape[0] != C or kstart.shape[0] != C:
        raise ValueError(
            f"native prefill attention: for {C} chunks (table rows) q_start must have {C + 1} entries "
            f"and pos0, kstart {C}; got {q_start.shape[0]}, {pos0.shape[0]}, {kstart.shape[0]}"
        )
    if not 0 <= int(window) < 2**31:  # (an int32 in the kernel's lane masks)
        raise ValueError(f"native prefill attention: window must be >= 0 and below 2**31, got {window}")
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype)
    elif out.shape != (T, H, D) or out.dtype != q.dtype or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(
            f"native prefill attention: out must be a contiguous CPU {q.dtype} tensor of shape "
            f"{(T, H, D)}, got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    status = (ctypes.c_int64 * 2)()
    _LIB.call(
        f"kv_paged_prefill_attention_{'q8_' if quant else ''}{DTYPE_SUFFIX[q.dtype]}",
        q,
        q.stride(0),
        kv_cache.view(torch.int8) if quant else kv_cache,
        table,
        table.shape[1],
        q_start,
        pos0,
        kstart,
        C,
        int(window),
        out,
        T,
        KH,
        H // KH,
        D,
        NB,
        BS,
        float(scale),
        int(q.dtype == torch.bfloat16 and D % 32 == 0 and not quant and USE_AMX and amx_available()),
        int(GATHER_BYTES),
        torch.get_num_threads(),
        ctypes.addressof(status),
        *((paged_attention.QUANT_KIND[kv_cache.dtype],) if quant else ()),
    )
    if status[0]:
        code = int(status[0])
        raise ValueError(
            f"native prefill attention: {_ERROR_ARG.get(code, 'arguments')}: "
            f"{_ERRORS.get(code, f'error {code}')} (chunk {int(status[1])})"
        )
    return out
