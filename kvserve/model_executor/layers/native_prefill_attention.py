"""Optional native (C, OpenMP) prefill attention reading K/V in place from the paged cache.

The torch path attends each multi-token chunk with its own ``scaled_dot_product_attention``
call per layer (torch's CPU flash kernel), after gathering the chunk's cached context into a
padded copy and building a bool mask when the chunk has earlier context (chunked prefill,
prefix caching) or a sliding window. This kernel attends every chunk of a step in one call
per layer, straight from the cache blocks, all query heads of a KV head sharing each K/V read
(GQA).

Algorithm: flash attention (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact
Attention with IO-Awareness", NeurIPS 2022): keys are visited in steps of 16 with a running
per-row maximum ``m``, normaliser ``l`` and unnormalised output ``O``; for every step with
scores ``s_j = scale * q.k_j``::

    m' = max(m, max_j s_j);  a = exp(m - m');  p_j = exp(s_j - m')
    l  = a * l + sum_j p_j;  O = a * O + sum_j p_j v_j;  m = m'

and the output is ``O / l``. Scores, softmax and sums are float32.

Work items are (chunk, KV head, tile of 16 query rows), grouped by (chunk, KV head) -- the
groups longest first, a group's tiles from the last -- and shared out dynamically over the
OpenMP threads (consecutive items of a thread mostly read one group's K/V, still in its L2;
the cheapest come last). Inside an item the 16 rows of one query head are the 16 lanes of a
vector: the item's queries are transposed once (``[D][16 rows]``), so 16 keys give 16 score
vectors (no horizontal sums) and the softmax is lane-wise (per row: vertical maxima and sums
over the 16 keys). All G query heads of the KV head use each key step's K/V, read once.
Key steps are aligned to the tile's first position, so a tile has exactly one diagonal step;
steps past the tile's last row are never visited, and masks are only evaluated on the
diagonal step, on steps crossing a window edge and on steps reaching below the first key.

Two inner kernels:

* AVX-512 (float32; bfloat16 without AMX or with head_dim not a multiple of 32): scores by
  broadcast-FMAs ``k_j[d] x q^T[d]`` into 16 register accumulators; ``O`` row-major, P.V by
  register tiles of rows x head_dim (``p`` broadcast, each ``v_j`` vector loaded once per
  tile). bfloat16 q is widened once per item, K and V once per step; ``vdpbf16ps`` for the
  scores (as in the decode kernel) measured 15 % slower here, compute-bound.
* AMX (bfloat16, head_dim a multiple of 32, CPU and process with AMX tiles; ``USE_AMX``):
  both products on tiles, transposed so rows stay lanes: ``S^T = K . Q^T`` and
  ``O^T += V^T . P^T``, in key steps of 32 (a full tile depth for ``P^T``). ``P`` is rounded to bfloat16 for the second product, as torch's CPU
  flash attention does for bfloat16 (error measured on par with torch's bfloat16 SDPA);
  ``O^T`` is kept in float32. Rescaling is lazy (as in FlashAttention-4's conditional
  rescaling): a row's reference maximum moves only when a step's scores exceed it by more
  than ``PF_LAZY`` (e^8: ``p`` <= ~3e3, exact in float32), so most steps add ``V^T . P^T``
  to ``O^T`` on the tiles, and only the others rescale it with AVX-512. Each chunk's keys are
  gathered once per call and KV head (K rows and V^T, ``pf_gather``; at most ``GATHER_BYTES``
  at a time) instead of copied and transposed by every tile that reads them. Both together,
  30 calls of the step below: 4 chunks of 512 tokens 80.6 -> 69.3 ms; 11 chunks of ~186 after
  512 cached tokens each 192.6 -> 162.0 ms; 11 fresh chunks of ~186 unchanged (~41 ms).

Outputs are rounded to nearest even on the bfloat16 store. On the 2-core machine of this
project (``benchmarks/attention_prefill_micro.py``: a SmolLM2-135M step of 11 chunks of ~186
tokens, 9 heads / 3 KV heads, head_dim 64, block size 16, 30 layers) this took 71 ms instead
of torch's 160 ms in float32 (187 vs 83 GFLOP/s, 2.3x) and 37 ms instead of 92 ms in bfloat16
(359 vs 145 GFLOP/s, 2.5x; 1.4x on the AVX-512 path); after 256 cached tokens per chunk
(chunked prefill: torch gathers and masks) 1.8x and 2.0x.

Built on first use by ``native_lib`` (which says how). If it cannot be built or
``KVSERVE_NATIVE=0`` is set, ``available()`` is False; callers keep the torch path then, and
for other dtypes, devices and shapes (``supports``: ``head_dim`` a multiple of 16, at most 256).

Kernel contract (``q`` rows may be any stride apart; everything else contiguous; q, cache and
out of one dtype, float32 or bfloat16; indices int64)::

    q        [T, H, D]          query rows of all chunks, H = KH * G (heads h*G .. h*G+G-1
                                share KV head h)
    cache    [2, KH, NB, BS, D] one layer's cache ([0] = K, [1] = V), the chunks' own K/V
                                already written
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

from kvserve.model_executor.layers import amx_gemm
from kvserve.model_executor.layers.native_lib import DTYPE_SUFFIX, NativeLibrary

#: Largest head_dim of the kernel (16 vectors of 16 floats per row).
MAX_HEAD_DIM = 256


_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    f"kv_paged_prefill_attention_{sfx}": [
        _p,
        _i64,
        _p,
        _p,
        _i64,
        _p,
        _p,
        _p,
        _i64,
        _i64,
        _p,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        ctypes.c_int,
        _i64,
        ctypes.c_int,
        _p,
    ]
    for sfx in DTYPE_SUFFIX.values()
}
_LIB = NativeLibrary(
    "kv_prefill_attention",
    "prefill_attention.c",
    _SIGNATURES,
)

#: bfloat16 with head_dim a multiple of 32 on AMX tiles when this CPU and process have them
#: (False: the AVX-512 path, e.g. to compare the two).
USE_AMX = True
#: AMX path: most bytes of keys gathered (K rows and V^T, per chunk and KV head) at once; a call
#: whose chunks need more takes them in batches (a chunk alone may exceed it).
GATHER_BYTES = 64 << 20


def amx_available() -> bool:
    """True when the kernel is built and this process may use AMX tiles (Linux grants them per
    process: ``amx_gemm.available()`` asks)."""
    return _LIB.available() and amx_gemm.available()


_ERRORS = {
    1: "q_start must be non-decreasing within [0, T]",
    2: "pos0 must be >= 0 and the chunk's positions below 2**31 - 16",
    3: "kstart must be >= 0, a multiple of the block size and at most the chunk's first attended key",
    4: "table is too narrow for the chunk's keys",
    5: "table holds a block id outside the cache",
    6: "head_dim must be a multiple of 16 and at most 256",
    7: "out of memory",
}
_ERROR_ARG = {1: "q_start", 2: "pos0", 3: "kstart", 4: "table", 5: "table", 6: "q", 7: "out"}


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
            the chunks' K/V already written.
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
    if q.dtype != kv_cache.dtype or q.dtype not in DTYPE_SUFFIX:
        raise ValueError(
            f"native prefill attention: q and kv_cache must be float32 or bfloat16 of one dtype, "
            f"got q {q.dtype} and kv_cache {kv_cache.dtype}."
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
        or kv_cache.shape[4] != D
        or not kv_cache.is_contiguous()
    ):
        raise ValueError(
            f"native prefill attention: kv_cache must be a contiguous [2, KH, NB, BS, {D}] tensor, "
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
    kernel = _LIB.fn(f"kv_paged_prefill_attention_{DTYPE_SUFFIX[q.dtype]}")
    kernel(
        q.data_ptr(),
        q.stride(0),
        kv_cache.data_ptr(),
        table.data_ptr(),
        table.shape[1],
        q_start.data_ptr(),
        pos0.data_ptr(),
        kstart.data_ptr(),
        C,
        int(window),
        out.data_ptr(),
        T,
        KH,
        H // KH,
        D,
        NB,
        BS,
        float(scale),
        int(q.dtype == torch.bfloat16 and D % 32 == 0 and USE_AMX and amx_available()),
        int(GATHER_BYTES),
        torch.get_num_threads(),
        ctypes.addressof(status),
    )
    if status[0]:
        code = int(status[0])
        raise ValueError(
            f"native prefill attention: {_ERROR_ARG.get(code, 'arguments')}: "
            f"{_ERRORS.get(code, f'error {code}')} (chunk {int(status[1])})"
        )
    return out
