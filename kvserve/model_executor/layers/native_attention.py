"""Optional native (C, OpenMP) decode attention reading K/V in place from the paged cache.

The pure-torch decode path gathers every sequence's K/V blocks into a padded tensor and then
runs ``scaled_dot_product_attention``: the cache is read once, written once and read again.
On CPU that path is memory-bound; this kernel reads each K/V row exactly once, straight from
its block, for all query heads that share it (GQA).

The C source below is compiled on first use with the system C compiler
(``cc -O3 -march=native -fopenmp``) into ``<cache root>/native/<hash>/`` (atomically, like the
model cache) and loaded with ``ctypes`` (the GIL is released during the call). If there is no
compiler, compilation fails, ``KVSERVE_NATIVE=0`` is set, or the tensors are not float32 on
CPU, ``available()`` is False and callers use the torch path.

Kernel contract (float32, all contiguous)::

    q      [B, KH, G, D]    queries, G = num_heads // num_kv_heads
    cache  [2, KH, NB, BS, D]  one layer's cache ([0] = K, [1] = V)
    table  [B, NBMAX] int64 row b: block ids of block indices kstart[b]//BS, kstart[b]//BS + 1, ...
    kstart [B] int64         first key position attended (0, or the window start)
    kend   [B] int64         one past the last key position (= query position + 1)
    out    [B, KH, G, D]
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void kv_paged_decode_attention(const float* q, const float* cache, const int64_t* table, int64_t nbmax,
                               const int64_t* kstart, const int64_t* kend, float* out,
                               int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                               float scale, int nthreads)
{
    const int64_t v_off = KH * NB * BS * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH;
        const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
        const float* qb = q + w * G * D;
        float* ob = out + w * G * D;
        for (int64_t i = 0; i < G * D; ++i) ob[i] = 0.0f;
        if (L <= 0) continue;
        float* sc = (float*)malloc(sizeof(float) * (size_t)(G * L));
        const int64_t* tb = table + b * nbmax;
        const int64_t fb = s0 / BS;
        const float* kbase = cache + h * NB * BS * D;
        /* pass 1: scores */
        for (int64_t p = s0; p < s1; ) {
            const int64_t blk = tb[p / BS - fb];
            const int64_t pend = (p / BS + 1) * BS < s1 ? (p / BS + 1) * BS : s1;
            for (; p < pend; ++p) {
                const float* k = kbase + (blk * BS + p % BS) * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float* qg = qb + g * D;
                    float acc = 0.0f;
                    #pragma omp simd reduction(+:acc)
                    for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
                    sc[g * L + (p - s0)] = acc * scale;
                }
            }
        }
        /* softmax per query head */
        for (int64_t g = 0; g < G; ++g) {
            float* s = sc + g * L;
            float m = s[0];
            for (int64_t i = 1; i < L; ++i) m = s[i] > m ? s[i] : m;
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int64_t i = 0; i < L; ++i) { s[i] = expf(s[i] - m); sum += s[i]; }
            const float inv = 1.0f / sum;
            #pragma omp simd
            for (int64_t i = 0; i < L; ++i) s[i] *= inv;
        }
        /* pass 2: weighted values */
        const float* vbase = cache + v_off + h * NB * BS * D;
        for (int64_t p = s0; p < s1; ) {
            const int64_t blk = tb[p / BS - fb];
            const int64_t pend = (p / BS + 1) * BS < s1 ? (p / BS + 1) * BS : s1;
            for (; p < pend; ++p) {
                const float* v = vbase + (blk * BS + p % BS) * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float a = sc[g * L + (p - s0)];
                    float* og = ob + g * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) og[d] += a * v[d];
                }
            }
        }
        free(sc);
    }
}
"""

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_failed: Optional[str] = None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return sys.platform


def _build(out_dir: Path) -> Path:
    from kvserve.model_executor.gguf_convert import cache_root

    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((_SOURCE + cc + _cpu_key()).encode()).hexdigest()[:16]
    final = out_dir / key
    lib = final / "kv_attention.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-native-", dir=out_dir))
    try:
        (tmp / "kv_attention.c").write_text(_SOURCE)
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC",
                        "-o", str(tmp / "kv_attention.so"), str(tmp / "kv_attention.c"), "-lm"],
                       check=True, capture_output=True, timeout=120)
        try:
            os.rename(tmp, final)
        except OSError:
            if not lib.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, building it on first use; ``None`` if unavailable."""
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        if os.environ.get("KVSERVE_NATIVE", "1") == "0":
            _failed = "disabled by KVSERVE_NATIVE=0"
            return None
        try:
            from kvserve.model_executor.gguf_convert import cache_root

            lib = ctypes.CDLL(str(_build(cache_root() / "native")))
            fn = lib.kv_paged_decode_attention
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
            fn.restype = None
            _lib = lib
        except Exception as e:  # no compiler, compile error, load error: torch path
            _failed = f"{type(e).__name__}: {e}"
    return _lib


def available() -> bool:
    """True when the native kernel is compiled and loaded."""
    return load() is not None


def failure_reason() -> Optional[str]:
    return _failed


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
                           kstart: torch.Tensor, kend: torch.Tensor, scale: float,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention for ``B`` single-token queries straight from the paged cache.

    Args:
        q: float32 ``[B, KH, G, D]`` contiguous.
        kv_cache: float32 ``[2, KH, NB, BS, D]`` contiguous (one layer).
        table: int64 ``[B, NBMAX]``; row ``b`` lists the blocks of block indices
            ``kstart[b] // BS`` onwards.
        kstart, kend: int64 ``[B]``: keys ``kstart[b] <= pos < kend[b]`` are attended.
    Returns:
        float32 ``[B, KH, G, D]``.
    Raises:
        RuntimeError: the kernel is not available (check ``available()`` first).
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"native attention unavailable: {_failed}")
    B, KH, G, D = q.shape
    _, _, NB, BS, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(q)
    lib.kv_paged_decode_attention(q.data_ptr(), kv_cache.data_ptr(), table.data_ptr(), table.shape[1],
                                  kstart.data_ptr(), kend.data_ptr(), out.data_ptr(),
                                  B, KH, G, D, NB, BS, float(scale), torch.get_num_threads())
    return out
