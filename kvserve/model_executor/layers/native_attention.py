"""Optional native (C, OpenMP) decode attention reading K/V in place from the paged cache.

The pure-torch decode path gathers every sequence's K/V blocks into a padded tensor and then
runs ``scaled_dot_product_attention``: the cache is read once, written once and read again.
On CPU that path is memory-bound; this kernel reads each K/V row exactly once, straight from
its block, for all query heads that share it (GQA).

The fast path (``head_dim % 16 == 0``, up to 16 query heads per KV head) uses GCC vector
extensions (16 floats: AVX-512 with ``-march=native``, 2 x AVX2 otherwise): queries kept in
registers, one horizontal sum per (key, query head), a vectorised exp (degree-6 polynomial
after range reduction, relative error ~1e-7), value accumulators in registers. Cache rows are
reached through a (block, offset) cursor, with the row two blocks ahead prefetched; for
bfloat16 on CPUs with AVX512-BF16 the q.k products use ``vdpbf16ps`` (exact bf16 products,
float32 sums) instead of widening every key. Together these took decode attention over a
DRAM-resident cache from 10.3 to 11.6 GB/s (64 sequences of ~225 tokens) and from 12.9 to
16.9 GB/s (8 of ~525), bfloat16.

Other shapes use a plain scalar loop. There is one version per cache dtype, float32 and
bfloat16 (K/V and queries widened to float32 on load, but for the ``vdpbf16ps`` products; the
output rounded to nearest even on store); all sums are float32.

Built on first use by ``native_lib`` (which says how). If it cannot be built or
``KVSERVE_NATIVE=0`` is set, ``available()`` is False; callers use the torch path then, and for
other dtypes (``supports_dtype``) and devices.

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

from kvserve.model_executor.layers.native_lib import DTYPE_SUFFIX, PRELUDE, NativeLibrary, instantiate

_HELPERS = r"""
#include <immintrin.h>
#define MAXG 16   /* query heads per KV head */
#define MAXC 16   /* D / 16 chunks: head_dim <= 256 */

/* Lane-pair sums of x and y: out lanes from x's pairs (lo, hi halves per group) then y's. */
#define PAIRSUM(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))

/* out[j] = sum of a[j]'s 16 lanes, for j = 0..15: a transposing tree of 15 shuffle-add pairs
   (the leaves end up in bit-reversed order, undone by the last shuffle). */
static inline v16 hsum16x16(const v16* a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = PAIRSUM(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + PAIRSUM(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = PAIRSUM(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + PAIRSUM(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = PAIRSUM(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + PAIRSUM(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    v16 e = PAIRSUM(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
          + PAIRSUM(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
"""

# One kernel body, instantiated per storage dtype (``ELEM`` / ``SFX`` are macros set before
# each copy): ``kv_paged_decode_attention_f32`` and ``kv_paged_decode_attention_bf16``.
# Arithmetic is float32 in both.
_KERNEL = r"""
static void CAT(generic_, SFX)(const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table, int64_t nbmax,
                    const int64_t* kstart, const int64_t* kend, ELEM* out,
                    int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                    float scale, int nthreads)
{
    const int64_t v_off = KH * NB * BS * D;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH;
        const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
        const ELEM* qb = q + b * qs + h * G * D;
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

/* One (sequence, KV head) work item of the fast path. Always inlined, so the calls below with
   literal G and C get copies whose query and accumulator vectors live in registers. */
static inline __attribute__((always_inline)) void CAT(item_, SFX)(
    int64_t w, const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table, int64_t nbmax,
    const int64_t* kstart, const int64_t* kend, ELEM* out,
    int64_t KH, const int64_t G, const int64_t C, int64_t NB, int64_t BS, float scale)
{
    const int64_t D = 16 * C;
    const int64_t v_off = KH * NB * BS * D;
    const int64_t b = w / KH, h = w % KH;
    const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
    ELEM* ob = out + w * G * D;
    if (L <= 0) { for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, (v16){}); return; }
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    float* sc = (float*)aligned_alloc(64, sizeof(float) * (size_t)(G * Lp));
    v16 qv[MAXG * MAXC];
    const ELEM* qsrc = q + b * qs + h * G * D;
    for (int64_t i = 0; i < G * C; ++i) qv[i] = CAT(ld16_, SFX)(qsrc + 16 * i) * scale;
    const int64_t* tb = table + b * nbmax;
    const int64_t fb = s0 / BS;
    const ELEM* kbase = cache + h * NB * BS * D;
    /* Rows are reached through a (block index, offset) cursor -- no division per key -- and
       the row at the same offset PF blocks ahead is prefetched: blocks are scattered, so the
       hardware prefetcher stops at every block boundary (a DRAM miss per 16 keys otherwise). */
    const int64_t nbi = (s1 - 1) / BS - fb + 1, off0 = s0 - fb * BS;
    const int64_t row_bytes = D * (int64_t)sizeof(ELEM);
#define PF 2
#define ROW(base, bi, off) ((base) + (tb[bi] * BS + (off)) * D)
#define PREFETCH_AHEAD(base, bi, off) do { if ((bi) + PF < nbi) { \
        const char* nr_ = (const char*)ROW(base, (bi) + PF, off); \
        for (int64_t o_ = 0; o_ < row_bytes; o_ += 64) __builtin_prefetch(nr_ + o_); } } while (0)
#define ADVANCE(bi, off) do { if (++(off) == BS) { (off) = 0; ++(bi); } } while (0)
    /* The first PF blocks have no earlier rows to prefetch them from. */
    for (int64_t bi = 0; bi < PF && bi < nbi; ++bi)
        for (int64_t off = bi ? 0 : off0; off < BS; ++off)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char*)ROW(kbase, bi, off) + o);
    int64_t p = s0, kbi = 0, koff = off0;
    /* 16 keys at a time: widen them once into kf, then one transposing reduction per
       query head gives their 16 scores (instead of 16 horizontal sums). */
#if defined(__AVX512BF16__)
    /* bfloat16 with AVX512-BF16: vdpbf16ps multiplies bf16 pairs exactly and adds them in
       float32, so the keys need no widening and half the instructions; q is used unscaled
       (as stored) and the scale applied to the 16 scores. */
    if (sizeof(ELEM) == 2 && C % 2 == 0) {
        __m512bh qb[MAXG * MAXC / 2];
        for (int64_t i = 0; i < G * C / 2; ++i) qb[i] = (__m512bh)_mm512_loadu_si512((const void*)(qsrc + 32 * i));
        for (; p + 16 <= s1; p += 16) {
            __m512bh kb[16 * MAXC / 2];
            for (int64_t j = 0; j < 16; ++j) {
                const ELEM* k = ROW(kbase, kbi, koff);
                for (int64_t c = 0; c < C / 2; ++c) kb[j * (C / 2) + c] = (__m512bh)_mm512_loadu_si512((const void*)(k + 32 * c));
                PREFETCH_AHEAD(kbase, kbi, koff);
                ADVANCE(kbi, koff);
            }
            for (int64_t g = 0; g < G; ++g) {
                const __m512bh* qg = qb + g * (C / 2);
                v16 a[16];
                for (int64_t j = 0; j < 16; ++j) {
                    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qg[0], kb[j * (C / 2)]);
                    for (int64_t c = 1; c < C / 2; ++c) acc = _mm512_dpbf16_ps(acc, qg[c], kb[j * (C / 2) + c]);
                    a[j] = (v16)acc;
                }
                *(v16*)(sc + g * Lp + (p - s0)) = hsum16x16(a) * scale;
            }
        }
    }
#endif
    for (; p + 16 <= s1; p += 16) {
        v16 kf[16 * MAXC];
        for (int64_t j = 0; j < 16; ++j) {
            const ELEM* k = ROW(kbase, kbi, koff);
            for (int64_t c = 0; c < C; ++c) kf[j * C + c] = CAT(ld16_, SFX)(k + 16 * c);
            PREFETCH_AHEAD(kbase, kbi, koff);
            ADVANCE(kbi, koff);
        }
        for (int64_t g = 0; g < G; ++g) {
            const v16* qg = qv + g * C;
            v16 a[16];
            for (int64_t j = 0; j < 16; ++j) {
                v16 acc = qg[0] * kf[j * C];
                for (int64_t c = 1; c < C; ++c) acc += qg[c] * kf[j * C + c];
                a[j] = acc;
            }
            *(v16*)(sc + g * Lp + (p - s0)) = hsum16x16(a);
        }
    }
    for (; p < s1; ++p) {
        const ELEM* k = ROW(kbase, kbi, koff);
        ADVANCE(kbi, koff);
        v16 kc[MAXC];
        for (int64_t c = 0; c < C; ++c) kc[c] = CAT(ld16_, SFX)(k + 16 * c);
        for (int64_t g = 0; g < G; ++g) {
            const v16* qg = qv + g * C;
            v16 acc = qg[0] * kc[0];
            for (int64_t c = 1; c < C; ++c) acc += qg[c] * kc[c];
            sc[g * Lp + (p - s0)] = hsum16(acc);
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
    for (int64_t bi = 0; bi < PF && bi < nbi; ++bi)
        for (int64_t off = bi ? 0 : off0; off < BS; ++off)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char*)ROW(vbase, bi, off) + o);
    int64_t vbi = 0, voff = off0;
    for (p = s0; p < s1; ++p) {
        const ELEM* v = ROW(vbase, vbi, voff);
        PREFETCH_AHEAD(vbase, vbi, voff);
        ADVANCE(vbi, voff);
        v16 vc[MAXC];
        for (int64_t c = 0; c < C; ++c) vc[c] = CAT(ld16_, SFX)(v + 16 * c);
        for (int64_t g = 0; g < G; ++g) {
            const float a = sc[g * Lp + (p - s0)];
            v16* ag = acc + g * C;
            for (int64_t c = 0; c < C; ++c) ag[c] += a * vc[c];
        }
    }
#undef PF
#undef ROW
#undef PREFETCH_AHEAD
#undef ADVANCE
    for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, acc[i]);
    free(sc);
}

void CAT(kv_paged_decode_attention_, SFX)(const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table, int64_t nbmax,
                               const int64_t* kstart, const int64_t* kend, ELEM* out,
                               int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                               float scale, int nthreads)
{
    if (D % 16 || D / 16 > MAXC || G > MAXG) {
        CAT(generic_, SFX)(q, qs, cache, table, nbmax, kstart, kend, out, B, KH, G, D, NB, BS, scale, nthreads);
        return;
    }
    const int64_t C = D / 16;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
#define ITEM(g, c) CAT(item_, SFX)(w, q, qs, cache, table, nbmax, kstart, kend, out, KH, g, c, NB, BS, scale)
        /* Common shapes (head_dim 64 or 128; 1-8 query heads per KV head) as constants. */
        if (C == 4 && G == 3) ITEM(3, 4);
        else if (C == 4 && G == 1) ITEM(1, 4);
        else if (C == 4 && G == 4) ITEM(4, 4);
        else if (C == 8 && G == 4) ITEM(4, 8);
        else if (C == 8 && G == 8) ITEM(8, 8);
        else if (C == 8 && G == 1) ITEM(1, 8);
        else ITEM(G, C);
#undef ITEM
    }
}
"""

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIB = NativeLibrary(
    "kv_attention",
    PRELUDE + _HELPERS + instantiate(_KERNEL),
    {
        f"kv_paged_decode_attention_{sfx}": [
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
            _i64,
            _i64,
            _i64,
            _i64,
            ctypes.c_float,
            ctypes.c_int,
        ]
        for sfx in DTYPE_SUFFIX.values()
    },
)


def available() -> bool:
    """True when the native kernel is compiled and loaded."""
    return _LIB.available()


def supports_dtype(dtype: torch.dtype) -> bool:
    """True for the storage dtypes the kernel has a version of (float32, bfloat16)."""
    return dtype in DTYPE_SUFFIX


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
        kv_cache: ``[2, KH, NB, BS, D]`` contiguous (one layer), same dtype as ``q``.
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
    if q.dtype != kv_cache.dtype or not supports_dtype(q.dtype):
        raise ValueError(
            f"native attention takes float32 or bfloat16 q and cache of one dtype, "
            f"got q {q.dtype} and cache {kv_cache.dtype}."
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
    _, _, NB, BS, _ = kv_cache.shape
    if out is None:
        out = torch.empty(B, KH, G, D, dtype=q.dtype)
    elif out.shape != (B, KH, G, D) or out.dtype != q.dtype or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(
            f"native attention: out must be a contiguous CPU {q.dtype} tensor of shape "
            f"{(B, KH, G, D)}, got {out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )
    kernel = _LIB.fn(f"kv_paged_decode_attention_{DTYPE_SUFFIX[q.dtype]}")
    kernel(
        q.data_ptr(),
        q.stride(0),
        kv_cache.data_ptr(),
        table.data_ptr(),
        table.shape[1],
        kstart.data_ptr(),
        kend.data_ptr(),
        out.data_ptr(),
        B,
        KH,
        G,
        D,
        NB,
        BS,
        float(scale),
        torch.get_num_threads(),
    )
    return out
