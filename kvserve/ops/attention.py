"""Decode attention on CPU straight from the paged KV cache (C/OpenMP kernel; algorithm and
measurements in ``kvserve/csrc/decode_attention.c``).

Reads each K/V row once, for all query heads that share it (GQA), instead of the torch path's
gather into a padded tensor. One version per cache dtype (float32, bfloat16; sums float32).
If the kernel cannot be built or ``KVSERVE_NATIVE=0`` is set, ``available()`` is False and
callers use the torch path, as they do for other dtypes (``supports_dtype``) and devices.

Kernel contract (all contiguous; q, cache and out of one dtype, float32 or bfloat16)::

    q      [B, KH, G, D]    queries, G = num_heads // num_kv_heads
    cache  [2, KH, NB, BS, D]  one layer's cache ([0] = K, [1] = V)
    table  [B, NBMAX] int64 row b: block ids of block indices kstart[b]//BS, kstart[b]//BS + 1, ...
    kstart [B] int64         first key position attended (0, or the window start)
    kend   [B] int64         one past the last key position (= query position + 1)
    out    [B, KH, G, D]
"""

from __future__ import annotations

import ctypes

import torch

from kvserve import envs
from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

#: Quantized cache storage dtypes the kernel reads (rows of head_dim codes + a float16 scale,
#: ``model_executor.layers.kv_quant``) -> their kind code in the C kernel.
QUANT_KIND: dict[torch.dtype, int] = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
# (q, qs, cache, table, nbmax, kstart, kend, out, B, KH, G, D, NB, BS, scale, nthreads): the
# prototype in csrc/decode_attention_dtype.h
_ARGS = [_p, _i64, _p, _p, _i64, _p, _p, _p, *[_i64] * 6, ctypes.c_float, ctypes.c_int]
# the same with the codes' kind before nthreads (csrc/decode_attention_q8_dtype.h)
_Q8_ARGS = [*_ARGS[:-1], ctypes.c_int, ctypes.c_int]
_LIB = NativeLibrary(
    "kv_attention",
    "decode_attention.c",
    {
        **{f"kv_paged_decode_attention_{sfx}": _ARGS for sfx in DTYPE_SUFFIX.values()},
        **{f"kv_paged_decode_attention_q8_{sfx}": _Q8_ARGS for sfx in DTYPE_SUFFIX.values()},
        "kv_decode_attention_set_amx": [ctypes.c_int],
        "kv_decode_attention_set_q8_dot": [ctypes.c_int],
    },
    restypes={
        "kv_decode_attention_set_amx": ctypes.c_int,
        "kv_decode_attention_set_q8_dot": ctypes.c_int,
        **{f"kv_paged_decode_attention_q8_{sfx}": ctypes.c_int for sfx in DTYPE_SUFFIX.values()},
    },
)


#: Env var: ``0`` keeps bfloat16 decode and prefill attention (``prefill_attention``) on
#: the AVX-512 path, as on a CPU without AMX (A/B comparisons, tests of that path).
AMX_ENV = "KVSERVE_ATTENTION_AMX"
#: bfloat16 with head_dim 32 or 64 on AMX tiles where this CPU and process have them (the
#: kernel's ``da_item_amx``: a verify chunk's rows cost about what one row costs; False: the
#: AVX-512 path). Read when the library is first found available; ``set_amx`` changes it later.
USE_AMX: bool = envs.KVSERVE_ATTENTION_AMX
_amx_state: bool | None = None


def available() -> bool:
    """True when the native kernel is compiled and loaded."""
    if not _LIB.available():
        return False
    if _amx_state is None:
        set_amx(USE_AMX)
    return True


def set_amx(on: bool) -> bool:
    """Turn the AMX path on or off for every later call (also the one-call decode step's);
    returns whether it is on: only where the library was built with AMX and the process may use
    the tiles (``gemm_amx.available()`` asks Linux for them). The library must be available."""
    global _amx_state
    from kvserve.ops import gemm_amx

    _amx_state = bool(_LIB.call("kv_decode_attention_set_amx", int(bool(on) and gemm_amx.available())))
    return _amx_state


def set_q8_dot(on: bool) -> bool:
    """Turn the integer dot-product path of int8 caches on (the default) or off for every later
    call; returns whether it is on: only where the library was built with AVX-512 VNNI and BW
    (off, or on other CPUs, int8 codes are widened to float32 as float8 ones are). The library
    must be available. For A/B comparisons and tests of the float path."""
    return bool(_LIB.call("kv_decode_attention_set_q8_dot", int(bool(on))))


def supports_dtype(dtype: torch.dtype) -> bool:
    """True for the storage dtypes the kernel has a version of (float32, bfloat16)."""
    return dtype in DTYPE_SUFFIX


def supports_cache_dtype(dtype: torch.dtype) -> bool:
    """True for the cache storage dtypes the kernel reads: the query dtypes, and the quantized
    rows (codes + float16 scale) of ``QUANT_KIND``."""
    return dtype in DTYPE_SUFFIX or dtype in QUANT_KIND


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    kstart: torch.Tensor,
    kend: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention for ``B`` single-token queries straight from the paged cache.

    Args:
        q: ``[B, KH, G, D]``, float32 or bfloat16 (``supports_dtype``); each row ``q[b]``
            contiguous, rows any stride apart (e.g. the q heads of a fused q/k projection).
        kv_cache: ``[2, KH, NB, BS, D]`` contiguous (one layer), same dtype as ``q``; or a
            quantized cache ``[2, KH, NB, BS, D + 2]`` of a ``QUANT_KIND`` dtype (rows of
            codes and a float16 scale, ``model_executor.layers.kv_quant``), read in place by
            ``kv_paged_decode_attention_q8_*`` (csrc/decode_attention_q8_dtype.h).
        table: int64 ``[B, NBMAX]``; row ``b`` lists the blocks of block indices
            ``kstart[b] // BS`` onwards.
        kstart, kend: int64 ``[B]``: keys ``kstart[b] <= pos < kend[b]`` are attended.
            The caller guarantees that ``table`` is wide enough for them (not checked: it would
            cost a reduction per layer and step).
    Returns:
        ``[B, KH, G, D]`` in ``q``'s dtype (accumulated in float32).
    Raises:
        RuntimeError: the kernel is not available (check ``available()`` first).
        ValueError: unsupported dtype, ``q`` and ``kv_cache`` dtypes differ, tensors off CPU or
            not contiguous (q: rows not contiguous), or index tensors not int64.
    """
    if not _LIB.available():
        raise RuntimeError(f"native attention unavailable: {_LIB.failure_reason()}")
    quant = kv_cache.dtype in QUANT_KIND
    if (not quant and q.dtype != kv_cache.dtype) or not supports_dtype(q.dtype):
        raise ValueError(
            f"native attention takes float32 or bfloat16 q and a cache of q's dtype or a quantized "
            f"one (int8, float8), got q {q.dtype} and cache {kv_cache.dtype}."
        )
    if q.device.type != "cpu" or kv_cache.device.type != "cpu":  # raw pointers: host memory only
        raise ValueError(f"native attention is CPU-only, got q on {q.device} and cache on {kv_cache.device}.")
    for name, t in (("kv_cache", kv_cache), ("table", table), ("kstart", kstart), ("kend", kend)):
        if not t.is_contiguous() or not t.is_cpu or (name != "kv_cache" and t.dtype != torch.int64):
            raise ValueError(
                f"native attention: {name} must be a contiguous CPU tensor"
                f"{'' if name == 'kv_cache' else ' of int64'}, got "
                f"{t.dtype} on {t.device}, strides {t.stride()}"
            )
    B, KH, G, D = q.shape
    if q.stride()[1:] != (G * D, D, 1) or (B > 1 and q.stride(0) < KH * G * D):
        raise ValueError(
            f"native attention: q must be [B, KH, G, D] with contiguous rows (any row "
            f"stride >= KH*G*D), got strides {q.stride()}"
        )
    _, _, NB, BS, W = kv_cache.shape
    if W != D + (2 if quant else 0):
        raise ValueError(
            f"native attention: cache rows of {W} elements for head_dim {D} "
            f"({'codes + 2 scale bytes' if quant else 'head_dim'} expected)"
        )
    if out is None:
        out = torch.empty(B, KH, G, D, dtype=q.dtype)
    elif out.shape != (B, KH, G, D) or out.dtype != q.dtype or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(
            f"native attention: out must be a contiguous CPU {q.dtype} tensor of shape "
            f"{(B, KH, G, D)}, got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    cache = kv_cache.view(torch.int8) if quant else kv_cache
    args = (
        q,
        q.stride(0),
        cache,
        table,
        table.shape[1],
        kstart,
        kend,
        out,
        B,
        KH,
        G,
        D,
        NB,
        BS,
        float(scale),
    )
    if quant:
        kernel = f"kv_paged_decode_attention_q8_{DTYPE_SUFFIX[q.dtype]}"
        if _LIB.call(kernel, *args, QUANT_KIND[kv_cache.dtype], torch.get_num_threads()):
            raise MemoryError("native attention: no memory for the attention scores")
        return out
    _LIB.call(f"kv_paged_decode_attention_{DTYPE_SUFFIX[q.dtype]}", *args, torch.get_num_threads())
    return out
