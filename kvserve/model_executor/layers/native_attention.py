"""Optional native (C, OpenMP) decode attention reading K/V in place from the paged cache.

The pure-torch decode path gathers every sequence's K/V blocks into a padded tensor and then
runs ``scaled_dot_product_attention``: the cache is read once, written once and read again.
On CPU that path is memory-bound; this kernel reads each K/V row exactly once, straight from
its block, for all query heads that share it (GQA).

The fast path (``head_dim % 16 == 0``, up to 16 query heads per KV head) uses GCC vector
extensions (16 floats: AVX-512 with ``-march=native``, 2 x AVX2 otherwise): queries kept in
registers, one horizontal sum per (key, query head), a vectorised exp (degree-6 polynomial
after range reduction, relative error ~1e-7), value accumulators in registers. Other shapes
use a plain scalar loop. There is one version per cache dtype, float32 and bfloat16 (K/V and
queries widened to float32 on load, the output rounded to nearest even on store); all
arithmetic is float32.

The C source below is compiled on first use with the system C compiler
(``cc -O3 -march=native -fopenmp``) into ``<cache root>/native/<hash>/`` (atomically, like the
model cache) and loaded with ``ctypes`` (the GIL is released during the call). If there is no
compiler, compilation fails or ``KVSERVE_NATIVE=0`` is set, ``available()`` is False; callers
use the torch path then, and for other dtypes (``supports_dtype``) and devices.

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

_PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));

static inline float hsum16(v16 v) {
    v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline v16 vmax(v16 a, v16 b) {
    v16i m = a > b;
    return (v16)(((v16i)a & m) | ((v16i)b & ~m));
}

/* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor in r, times 2^n. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){} - 87.0f;
    x = vmax(x, lo);
    const v16 magic = (v16){} + 12582912.0f;           /* 1.5 * 2^23: round to nearest */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693145751953125f;                   /* ln2 split hi/lo */
    r = r - n * 1.428606765330187045e-06f;
    v16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)e;
}

/* Element access for the two storage dtypes. bfloat16 is the top half of a float32, so
   widening is a 16-bit shift; narrowing rounds to nearest even (NaN inputs are not expected). */
static inline v16 ld16_f32(const float* p) { return *(const v16*)p; }
static inline void st16_f32(float* p, v16 x) { *(v16*)p = x; }
static inline float ld1_f32(const float* p) { return *p; }
static inline void st1_f32(float* p, float x) { *p = x; }

static inline v16 ld16_bf16(const uint16_t* p) {
    return (v16)(__builtin_convertvector(*(const v16h*)p, v16u) << 16);
}
static inline void st16_bf16(uint16_t* p, v16 x) {
    v16u u = (v16u)x;
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    *(v16h*)p = __builtin_convertvector(u, v16h);
}
static inline float ld1_bf16(const uint16_t* p) {
    uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline void st1_bf16(uint16_t* p, float x) {
    uint32_t u; memcpy(&u, &x, 4); *p = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define MAXG 16
#define MAXC 16   /* D / 16 chunks: head_dim <= 256 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
"""

# One kernel body, instantiated per storage dtype (``ELEM`` / ``SFX`` are macros set before
# each copy): ``kv_paged_decode_attention_f32`` and ``kv_paged_decode_attention_bf16``.
# Arithmetic is float32 in both.
_KERNEL = r"""
static void CAT(generic_, SFX)(const ELEM* q, const ELEM* cache, const int64_t* table, int64_t nbmax,
                    const int64_t* kstart, const int64_t* kend, ELEM* out,
                    int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                    float scale, int nthreads)
{
    const int64_t v_off = KH * NB * BS * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH;
        const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
        const ELEM* qb = q + w * G * D;
        ELEM* ob = out + w * G * D;
        if (L <= 0) { for (int64_t i = 0; i < G * D; ++i) CAT(st1_, SFX)(ob + i, 0.0f); continue; }
        float* sc = (float*)malloc(sizeof(float) * (size_t)(G * L));
        float* acc = (float*)calloc((size_t)(G * D), sizeof(float));
        const int64_t* tb = table + b * nbmax;
        const int64_t fb = s0 / BS;
        const ELEM* kbase = cache + h * NB * BS * D;
        for (int64_t p = s0; p < s1; ++p) {
            const ELEM* k = kbase + (tb[p / BS - fb] * BS + p % BS) * D;
            for (int64_t g = 0; g < G; ++g) {
                float a = 0.0f;
                for (int64_t d = 0; d < D; ++d) a += CAT(ld1_, SFX)(qb + g * D + d) * CAT(ld1_, SFX)(k + d);
                sc[g * L + (p - s0)] = a * scale;
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float* s = sc + g * L;
            float m = s[0];
            for (int64_t i = 1; i < L; ++i) m = s[i] > m ? s[i] : m;
            float sum = 0.0f;
            for (int64_t i = 0; i < L; ++i) { s[i] = expf(s[i] - m); sum += s[i]; }
            for (int64_t i = 0; i < L; ++i) s[i] /= sum;
        }
        const ELEM* vbase = cache + v_off + h * NB * BS * D;
        for (int64_t p = s0; p < s1; ++p) {
            const ELEM* v = vbase + (tb[p / BS - fb] * BS + p % BS) * D;
            for (int64_t g = 0; g < G; ++g) {
                const float a = sc[g * L + (p - s0)];
                for (int64_t d = 0; d < D; ++d) acc[g * D + d] += a * CAT(ld1_, SFX)(v + d);
            }
        }
        for (int64_t i = 0; i < G * D; ++i) CAT(st1_, SFX)(ob + i, acc[i]);
        free(acc);
        free(sc);
    }
}

void CAT(kv_paged_decode_attention_, SFX)(const ELEM* q, const ELEM* cache, const int64_t* table, int64_t nbmax,
                               const int64_t* kstart, const int64_t* kend, ELEM* out,
                               int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                               float scale, int nthreads)
{
    if (D % 16 || D / 16 > MAXC || G > MAXG) {
        CAT(generic_, SFX)(q, cache, table, nbmax, kstart, kend, out, B, KH, G, D, NB, BS, scale, nthreads);
        return;
    }
    const int64_t C = D / 16;
    const int64_t v_off = KH * NB * BS * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH;
        const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
        ELEM* ob = out + w * G * D;
        if (L <= 0) { for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, (v16){}); continue; }
        const int64_t Lp = (L + 15) & ~(int64_t)15;
        float* sc = (float*)aligned_alloc(64, sizeof(float) * (size_t)(G * Lp));
        v16 qv[MAXG * MAXC];
        const ELEM* qsrc = q + w * G * D;
        for (int64_t i = 0; i < G * C; ++i) qv[i] = CAT(ld16_, SFX)(qsrc + 16 * i) * scale;
        const int64_t* tb = table + b * nbmax;
        const int64_t fb = s0 / BS;
        const ELEM* kbase = cache + h * NB * BS * D;
        for (int64_t p = s0; p < s1; ) {
            const int64_t blk = tb[p / BS - fb];
            const int64_t pend = (p / BS + 1) * BS < s1 ? (p / BS + 1) * BS : s1;
            for (; p < pend; ++p) {
                const ELEM* k = kbase + (blk * BS + p % BS) * D;
                v16 kc[MAXC];
                for (int64_t c = 0; c < C; ++c) kc[c] = CAT(ld16_, SFX)(k + 16 * c);
                for (int64_t g = 0; g < G; ++g) {
                    const v16* qg = qv + g * C;
                    v16 acc = qg[0] * kc[0];
                    for (int64_t c = 1; c < C; ++c) acc += qg[c] * kc[c];
                    sc[g * Lp + (p - s0)] = hsum16(acc);
                }
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float* s = sc + g * Lp;
            for (int64_t i = L; i < Lp; ++i) s[i] = -INFINITY;
            v16 mv = *(v16*)s;
            for (int64_t i = 16; i < Lp; i += 16) { v16 x = *(v16*)(s + i); mv = vmax(x, mv); }
            float m = mv[0];
            for (int i = 1; i < 16; ++i) m = mv[i] > m ? mv[i] : m;
            v16 sumv = (v16){};
            for (int64_t i = 0; i < Lp; i += 16) {
                v16 e = exp16(*(v16*)(s + i) - m);
                *(v16*)(s + i) = e;
                sumv += e;
            }
            const float inv = 1.0f / hsum16(sumv);
            for (int64_t i = 0; i < Lp; i += 16) *(v16*)(s + i) *= inv;
        }
        v16 acc[MAXG * MAXC];
        for (int64_t i = 0; i < G * C; ++i) acc[i] = (v16){};
        const ELEM* vbase = cache + v_off + h * NB * BS * D;
        for (int64_t p = s0; p < s1; ) {
            const int64_t blk = tb[p / BS - fb];
            const int64_t pend = (p / BS + 1) * BS < s1 ? (p / BS + 1) * BS : s1;
            for (; p < pend; ++p) {
                const ELEM* v = vbase + (blk * BS + p % BS) * D;
                v16 vc[MAXC];
                for (int64_t c = 0; c < C; ++c) vc[c] = CAT(ld16_, SFX)(v + 16 * c);
                for (int64_t g = 0; g < G; ++g) {
                    const float a = sc[g * Lp + (p - s0)];
                    v16* ag = acc + g * C;
                    for (int64_t c = 0; c < C; ++c) ag[c] += a * vc[c];
                }
            }
        }
        for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, acc[i]);
        free(sc);
    }
}
"""

_SOURCE = (_PRELUDE
           + "#define ELEM float\n#define SFX f32\n" + _KERNEL + "#undef ELEM\n#undef SFX\n"
           + "#define ELEM uint16_t\n#define SFX bf16\n" + _KERNEL + "#undef ELEM\n#undef SFX\n")

#: torch dtype -> exported kernel symbol.
_SYMBOLS = {torch.float32: "kv_paged_decode_attention_f32", torch.bfloat16: "kv_paged_decode_attention_bf16"}

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
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            for name in _SYMBOLS.values():
                fn = getattr(lib, name)
                fn.argtypes = [p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
                fn.restype = None
            _lib = lib
        except Exception as e:  # no compiler, compile error, load error: torch path
            _failed = f"{type(e).__name__}: {e}"
    return _lib


def available() -> bool:
    """True when the native kernel is compiled and loaded."""
    return load() is not None


def supports_dtype(dtype: torch.dtype) -> bool:
    """True for the storage dtypes the kernel has a version of (float32, bfloat16)."""
    return dtype in _SYMBOLS


def failure_reason() -> Optional[str]:
    return _failed


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
                           kstart: torch.Tensor, kend: torch.Tensor, scale: float,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention for ``B`` single-token queries straight from the paged cache.

    Args:
        q: ``[B, KH, G, D]`` contiguous, float32 or bfloat16 (``supports_dtype``).
        kv_cache: ``[2, KH, NB, BS, D]`` contiguous (one layer), same dtype as ``q``.
        table: int64 ``[B, NBMAX]``; row ``b`` lists the blocks of block indices
            ``kstart[b] // BS`` onwards.
        kstart, kend: int64 ``[B]``: keys ``kstart[b] <= pos < kend[b]`` are attended.
    Returns:
        ``[B, KH, G, D]`` in ``q``'s dtype (accumulated in float32).
    Raises:
        RuntimeError: the kernel is not available (check ``available()`` first).
        ValueError: unsupported dtype, or ``q`` and ``kv_cache`` dtypes differ.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"native attention unavailable: {_failed}")
    if q.dtype != kv_cache.dtype or not supports_dtype(q.dtype):
        raise ValueError(f"native attention takes float32 or bfloat16 q and cache of one dtype, "
                         f"got q {q.dtype} and cache {kv_cache.dtype}.")
    if q.device.type != "cpu" or kv_cache.device.type != "cpu":  # raw pointers: host memory only
        raise ValueError(f"native attention is CPU-only, got q on {q.device} and cache on {kv_cache.device}.")
    B, KH, G, D = q.shape
    _, _, NB, BS, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(q)
    getattr(lib, _SYMBOLS[q.dtype])(q.data_ptr(), kv_cache.data_ptr(), table.data_ptr(), table.shape[1],
                                  kstart.data_ptr(), kend.data_ptr(), out.data_ptr(),
                                  B, KH, G, D, NB, BS, float(scale), torch.get_num_threads())
    return out
