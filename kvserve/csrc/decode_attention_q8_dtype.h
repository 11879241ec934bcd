/* Decode attention over a quantized paged KV cache (kv_paged_decode_attention_q8_<SFX>): the
   queries and the output are ELEM (float32 or bfloat16), the cache holds one-byte codes and a
   float16 scale per row (model_executor/layers/kv_quant.py):

       row = [code_0 .. code_{D-1}, scale (float16)]     D + 2 bytes, value_i = code_i * scale
       kind 0: int8 codes; 1: float8 e4m3fn; 2: float8 e5m2

   The cache is read once, in place: half the bytes of a bfloat16 cache. The row scale is
   applied once per key, not per value: score = (q . codes) * k_scale, and the weight of a
   value row is p * v_scale. One work item per (query row, KV head) for all its query heads
   (GQA); two passes over the keys (scores, then the weighted values) as the unquantized kernel,
   float32 sums, an exact softmax (max subtracted, exp16 of kv_vec.h). head_dim % 16 == 0 and
   up to MAXG query heads per KV head take the vector path, other shapes a scalar loop.
   int8 codes on CPUs with AVX-512 VNNI and BW: integer dot products for the scores
   (q8_dot_scores) and, for head_dim % 32 == 0, the weighted values (q8_dot_pv), instead of
   widening every code to float32 (the float path: float8 codes, other CPUs, and
   kv_decode_attention_set_q8_dot(0)). */

/* Shared by both dtype instantiations (the template is included once per ELEM). */
#ifndef DA_Q8_COMMON
#define DA_Q8_COMMON
#include "kv_q8.h"

/* Software prefetch Q8_AHEAD keys ahead of the row being read: a work item's blocks are
   scattered, so the hardware prefetcher stops at each block's end; the distance is in keys, not
   blocks, so small blocks get as much warning as large ones. (*pb, *po): the prefetch cursor
   (block index into the item's table row tb, offset), advanced by one key; nbi: the blocks the
   item's keys span (rows past the last key in its block are prefetched, harmlessly). Every
   64 bytes of the row and its last byte: each cache line it touches. */
#define Q8_AHEAD 64
/* __builtin_prefetch locality 1 (PREFETCHT2, into L2): beat L1 prefetches when other processes
   load the machine (docs/benchmarks.md, KV cache dtypes). */
#define Q8_LOC 1
static inline __attribute__((always_inline)) void q8_prefetch_next(const int8_t* base, const int64_t* tb,
                                                                   int64_t BS, int64_t W, int64_t nbi,
                                                                   int64_t* pb, int64_t* po) {
    if (*pb < nbi) {
        const int8_t* r = base + (tb[*pb] * BS + *po) * W;
        for (int64_t o = 0; o < W; o += 64) __builtin_prefetch(r + o, 0, Q8_LOC);
        __builtin_prefetch(r + W - 1, 0, Q8_LOC);
    }
    if (++*po == BS) {
        *po = 0;
        ++*pb;
    }
}

/* int8 scores by integer dot products (AVX-512 VNNI + BW; compile-time, as the other kernels:
   the library is built for its host). Per work item each query head, softmax scale folded in,
   is quantized to int16, q16 = round(q * 32767 / max|q|) (the scale sq = max|q| / 32767 kept as
   float), and split into two bytes, q16 = 256 qh + ql with ql = q16 & 255 unsigned and qh =
   q16 >> 8 in [-128, 127]. Sixteen keys at a time, their rows' 64-byte chunks are transposed as
   16 x 16 dwords (transpose16.h), so a register holds 4 consecutive codes of each of the 16 keys
   and VPDPBUSD against one broadcast dword of the query gives 16 keys' partial sums at once:
       lo = sum ql * k               (ql the unsigned operand, k the signed one)
       hi = sum (k + 128) * qh       (k XOR 0x80 unsigned; 128 sum(qh) subtracted once)
       q16 . k = 256 (hi - 128 sum(qh)) + lo,   score = (q16 . k) * sq * k_scale
   (the sign/offset trick of llama.cpp's q8_0 dot product on VNNI).
   Bounds: |k| <= 128 (any int8), |q16| <= 32767, D <= 256: |hi| <= 256 * 255 * 128 < 2^23,
   |hi - 128 sum(qh)| = |sum k qh| <= 256 * 128 * 128 = 2^22 (times 256: 2^30), |lo| <=
   256 * 128 * 255 < 2^23, so every int32 lane and the sum stay below 2^31. The integer dot is
   exact; the only error is the query's rounding, |q16 sq - q| <= sq / 2 = max|q| / 65534 per
   element: |score error| <= max|q| * k_scale * sum|k| / 65534.
   q8_dot_on turns it off at run time (kv_decode_attention_set_q8_dot: A/B comparisons, tests
   of the float path that CPUs without VNNI take). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_DOT 1
#include "transpose16.h"
#else
#define Q8_DOT 0
#endif
static int q8_dot_on = Q8_DOT;

#if Q8_DOT
/* The next 16 keys' rows for the integer path: row pointers into r (keys past the n left: the
   zero row), their scales as float32 (0 there), the item's read cursor (*bi, *off) advanced by
   16 and the prefetch cursor (*pb, *po, as q8_prefetch_next) too. Sixteen rows inside one block
   are contiguous: then no per-key cursor steps, the scales are loaded one by one into a vector
   (a round trip through memory, 16 two-byte stores read back as one vector, stalls store
   forwarding; a VPGATHERDD was slower still) and the prefetch covers the 16 rows ahead line by
   line when they share a block too; otherwise key by key, the scales through memory. */
static inline __attribute__((always_inline)) v16 q8_rows16(const int8_t* base, const int64_t* tb, int64_t BS,
                                                           int64_t W, int64_t D, int64_t nbi, int64_t n,
                                                           const int8_t* zero, int64_t* bi, int64_t* off,
                                                           int64_t* pb, int64_t* po, const int8_t** r) {
    if (n >= 16 && *off + 16 <= BS) {
        const int8_t* r0 = base + (tb[*bi] * BS + *off) * W;
        for (int64_t j = 0; j < 16; ++j) r[j] = r0 + j * W;
        if ((*off += 16) == BS) {
            *off = 0;
            ++*bi;
        }
        if (*po + 16 <= BS) {
            if (*pb < nbi) {
                const int8_t* f = base + (tb[*pb] * BS + *po) * W;
                for (int64_t o = 0; o < 16 * W; o += 64) __builtin_prefetch(f + o, 0, Q8_LOC);
                __builtin_prefetch(f + 16 * W - 1, 0, Q8_LOC);
            }
            if ((*po += 16) == BS) {
                *po = 0;
                ++*pb;
            }
        } else
            for (int64_t j = 0; j < 16; ++j) q8_prefetch_next(base, tb, BS, W, nbi, pb, po);
        uint16_t h[16];
        for (int64_t k = 0; k < 16; ++k) memcpy(h + k, r0 + k * W + D, 2);
        const __m256i hv =
            _mm256_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                              (short)h[6], (short)h[7], (short)h[8], (short)h[9], (short)h[10], (short)h[11],
                              (short)h[12], (short)h[13], (short)h[14], (short)h[15]);
        return (v16)_mm512_cvtph_ps(hv);
    }
    uint16_t s16[16];
    for (int64_t j = 0; j < 16; ++j) {
        if (j < n) {
            r[j] = base + (tb[*bi] * BS + *off) * W;
            q8_prefetch_next(base, tb, BS, W, nbi, pb, po);
            memcpy(s16 + j, r[j] + D, 2);
            if (++*off == BS) {
                *off = 0;
                ++*bi;
            }
        } else {
            r[j] = zero;
            s16[j] = 0;
        }
    }
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s16));
}

/* Scores of keys s0 .. s1 - 1 (int8 codes) into sc[g * Lp + (p - s0)]: the integer dot products
   above. qv: the G query heads times the softmax scale, C vectors each (D = 16 C); tb, BS, nbi,
   off0: the item's block cursor (q8_item). Lanes past s1 in the last 16 are left as garbage
   (the caller masks them). */
static inline __attribute__((always_inline)) void
q8_dot_scores(const v16* qv, const int8_t* kbase, const int64_t* tb, int64_t G, int64_t C, int64_t BS,
              int64_t nbi, int64_t off0, int64_t s0, int64_t s1, int64_t Lp, float* sc) {
    const int64_t D = 16 * C, W = D + 2, NCH = (D + 63) / 64;
    int32_t ql[MAXG * 64], qh[MAXG * 64], bias[MAXG]; /* dword w (dims 4w .. 4w+3) of head g at g * 64 + w */
    float sq[MAXG];
    for (int64_t g = 0; g < G; ++g) {
        v16 am = (v16){};
        for (int64_t c = 0; c < C; ++c) am = vmax(am, (v16)((v16i)qv[g * C + c] & 0x7FFFFFFF));
        const float amax = hmax16(am), inv = amax > 0 ? 32767.0f / amax : 0.0f;
        sq[g] = amax / 32767.0f;
        __m512i hs = _mm512_setzero_si512();
        for (int64_t c = 0; c < C; ++c) {
            __m512i c16 = _mm512_cvtps_epi32((__m512)(qv[g * C + c] * inv));
            c16 =
                _mm512_min_epi32(_mm512_max_epi32(c16, _mm512_set1_epi32(-32767)), _mm512_set1_epi32(32767));
            const __m512i h8 = _mm512_srai_epi32(c16, 8);
            _mm_storeu_si128((__m128i*)(ql + g * 64 + 4 * c), _mm512_cvtepi32_epi8(c16)); /* low bytes */
            _mm_storeu_si128((__m128i*)(qh + g * 64 + 4 * c), _mm512_cvtepi32_epi8(h8));
            hs = _mm512_add_epi32(hs, h8);
        }
        bias[g] = 128 * _mm512_reduce_add_epi32(hs);
    }
    int8_t zero[256 + 2] = {0}; /* keys past s1 in the last 16 */
    int64_t bi = 0, off = off0, pb = (off0 + Q8_AHEAD) / BS, po = (off0 + Q8_AHEAD) % BS;
    for (int64_t p = s0; p < s1; p += 16) {
        const int8_t* r[16];
        const v16 ksv = q8_rows16(kbase, tb, BS, W, D, nbi, s1 - p, zero, &bi, &off, &pb, &po, r);
        __m512i lo[MAXG], hi[MAXG];
        for (int64_t g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_si512();
        for (int64_t ch = 0; ch < NCH; ++ch) {
            const int64_t nb = D - 64 * ch < 64 ? D - 64 * ch : 64;
            const __mmask64 m = nb == 64 ? ~(__mmask64)0 : ((__mmask64)1 << nb) - 1;
            v16 x[16];
            for (int64_t j = 0; j < 16; ++j) x[j] = (v16)_mm512_maskz_loadu_epi8(m, r[j] + 64 * ch);
            transpose16(x);
            for (int64_t w = 0; w < nb / 4; ++w) {
                const __m512i k = (__m512i)x[w], ku = _mm512_xor_si512(k, _mm512_set1_epi8((char)0x80));
                for (int64_t g = 0; g < G; ++g) {
                    lo[g] = _mm512_dpbusd_epi32(lo[g], _mm512_set1_epi32(ql[g * 64 + 16 * ch + w]), k);
                    hi[g] = _mm512_dpbusd_epi32(hi[g], ku, _mm512_set1_epi32(qh[g * 64 + 16 * ch + w]));
                }
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            const __m512i t = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_sub_epi32(hi[g], _mm512_set1_epi32(bias[g])), 8), lo[g]);
            const v16 sv = (v16)_mm512_cvtepi32_ps(t) * (ksv * sq[g]);
            memcpy(sc + g * Lp + (p - s0), &sv, sizeof sv);
        }
    }
}

/* The weighted int8 values of keys s0 .. s1 - 1, D = 16 C with C even, into acc[g * C + c]
   (16 dims each, natural order): sum over keys of p * v_scale * code. sc: the softmax
   numerators p (row g at g * Lp), lanes past s1 finite (their rows read as zeros here).
   Per 16 keys and query head the weights w = p * v_scale are quantized to int16 against their
   largest, wq = round(w * 32767 / max w) (|error| <= max w / 65534 a weight); two keys' codes
   are interleaved into int16 pairs (a 32-dim chunk of key a and key b as (a_d, b_d) words: the
   dims of a register come out in the unpacks' lane order, put back at the end) and VPDPWSSD
   adds a_d wq_a + b_d wq_b to int32 lanes; every 16 keys the lanes go to float32 times
   max w / 32767. Bounds: |code| <= 128, wq <= 32767: a VPDPWSSD adds < 2^23 to a lane, 8 of
   them before the flush < 2^26. */
static inline __attribute__((always_inline)) void q8_dot_pv(const float* sc, int64_t Lp, const int8_t* vbase,
                                                            const int64_t* tb, int64_t G, int64_t C,
                                                            int64_t BS, int64_t nbi, int64_t off0, int64_t s0,
                                                            int64_t s1, v16* acc) {
    const int64_t D = 16 * C, W = D + 2;
    v16 af[MAXG * MAXC]; /* per 32-dim chunk c: [2c] dims of the low unpacks, [2c + 1] the high */
    for (int64_t i = 0; i < G * C; ++i) af[i] = (v16){};
    int8_t zero[256 + 2] = {0};
    int64_t bi = 0, off = off0, pb = (off0 + Q8_AHEAD) / BS, po = (off0 + Q8_AHEAD) % BS;
    for (int64_t p = s0; p < s1; p += 16) {
        const int8_t* r[16];
        const v16 vsv = q8_rows16(vbase, tb, BS, W, D, nbi, s1 - p, zero, &bi, &off, &pb, &po, r);
        int32_t wp[MAXG * 8]; /* head g, key pair k: (wq[2k], wq[2k + 1]) as one dword */
        float bsc[MAXG];
        for (int64_t g = 0; g < G; ++g) {
            v16 w;
            memcpy(&w, sc + g * Lp + (p - s0), sizeof w);
            w *= vsv;
            const float wmax = _mm512_reduce_max_ps((__m512)w), inv = wmax > 0 ? 32767.0f / wmax : 0.0f;
            bsc[g] = wmax / 32767.0f;
            const __m512i wi =
                _mm512_min_epi32(_mm512_cvtps_epi32((__m512)(w * inv)), _mm512_set1_epi32(32767));
            _mm256_storeu_si256((__m256i*)(wp + 8 * g), _mm512_cvtepi32_epi16(wi));
        }
        __m512i ai[MAXG * MAXC];
        for (int64_t i = 0; i < G * C; ++i) ai[i] = _mm512_setzero_si512();
        for (int64_t k = 0; k < 8; ++k) {
            const int8_t *ra = r[2 * k], *rb = r[2 * k + 1];
            for (int64_t c = 0; c < C / 2; ++c) {
                const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(ra + 32 * c)));
                const __m512i bb = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(rb + 32 * c)));
                const __m512i lo = _mm512_unpacklo_epi16(a, bb), hi = _mm512_unpackhi_epi16(a, bb);
                for (int64_t g = 0; g < G; ++g) {
                    const __m512i wv = _mm512_set1_epi32(wp[8 * g + k]);
                    ai[g * C + 2 * c] = _mm512_dpwssd_epi32(ai[g * C + 2 * c], lo, wv);
                    ai[g * C + 2 * c + 1] = _mm512_dpwssd_epi32(ai[g * C + 2 * c + 1], hi, wv);
                }
            }
        }
        for (int64_t g = 0; g < G; ++g)
            for (int64_t i = 0; i < C; ++i) af[g * C + i] += (v16)_mm512_cvtepi32_ps(ai[g * C + i]) * bsc[g];
    }
    /* 128-bit lane l of a low unpack holds dims 8l .. 8l + 3 of its chunk, of a high one 8l + 4 .. 8l + 7 */
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C / 2; ++c) {
            const __m512 lo = (__m512)af[g * C + 2 * c], hi = (__m512)af[g * C + 2 * c + 1];
            acc[g * C + 2 * c] = (v16)_mm512_permutex2var_ps(lo, i0, hi);
            acc[g * C + 2 * c + 1] = (v16)_mm512_permutex2var_ps(lo, i1, hi);
        }
}
#endif

/* Turns the integer int8 score path on or off (on only where this library was built with
   AVX-512 VNNI and BW); returns the state now in force. */
int kv_decode_attention_set_q8_dot(int on) {
    q8_dot_on = Q8_DOT && on != 0;
    return q8_dot_on;
}
#endif

/* Any shape, scalar: row b, KV head h. sc: G * L floats. */
static void CAT(q8_generic_item_, SFX)(int64_t b, int64_t h, const ELEM* q, int64_t qs, const int8_t* cache,
                                       const int64_t* table, int64_t nbmax, const int64_t* kstart,
                                       const int64_t* kend, ELEM* out, int64_t KH, int64_t G, int64_t D,
                                       int64_t NB, int64_t BS, float scale, int kind, float* sc) {
    const int64_t W = D + 2, s0 = kstart[b], L = kend[b] - s0;
    const int64_t* tb = table + b * nbmax;
    const int8_t* kb = cache + h * NB * BS * W;
    const int8_t* vb = cache + (KH + h) * NB * BS * W;
    for (int64_t g = 0; g < G; ++g) {
        const ELEM* qg = q + b * qs + (h * G + g) * D;
        ELEM* og = out + ((b * KH + h) * G + g) * D;
        if (L <= 0) {
            for (int64_t d = 0; d < D; ++d) CAT(st1_, SFX)(og + d, 0.0f);
            continue;
        }
        float m = -INFINITY;
        for (int64_t i = 0; i < L; ++i) {
            const int64_t p = s0 + i;
            const int8_t* row = kb + (tb[p / BS - s0 / BS] * BS + p % BS) * W;
            float s = 0;
            for (int64_t d = 0; d < D; ++d) s += CAT(ld1_, SFX)(qg + d) * q8_ld1(row + d, kind);
            sc[i] = s * q8_half(row + D) * scale;
            m = sc[i] > m ? sc[i] : m;
        }
        float sum = 0;
        for (int64_t i = 0; i < L; ++i) sum += (sc[i] = expf(sc[i] - m));
        float acc[1024];
        for (int64_t d0 = 0; d0 < D; d0 += 1024) {
            const int64_t n = D - d0 < 1024 ? D - d0 : 1024;
            for (int64_t d = 0; d < n; ++d) acc[d] = 0;
            for (int64_t i = 0; i < L; ++i) {
                const int64_t p = s0 + i;
                const int8_t* row = vb + (tb[p / BS - s0 / BS] * BS + p % BS) * W;
                const float w = sc[i] * q8_half(row + D);
                for (int64_t d = 0; d < n; ++d) acc[d] += w * q8_ld1(row + d0 + d, kind);
            }
            for (int64_t d = 0; d < n; ++d) CAT(st1_, SFX)(og + d0 + d, acc[d] / sum);
        }
    }
}

/* head_dim = 16 C, G query heads: row b, KV head h. sc: G * Lp floats (Lp = L rounded up to 16). */
static inline __attribute__((always_inline)) void
CAT(q8_item_, SFX)(int64_t b, int64_t h, const ELEM* q, int64_t qs, const int8_t* cache, const int64_t* table,
                   int64_t nbmax, const int64_t* kstart, const int64_t* kend, ELEM* out, int64_t KH,
                   int64_t G, int64_t C, int64_t NB, int64_t BS, float scale, int kind, int dot, float* sc) {
    const int64_t D = 16 * C, W = D + 2, s0 = kstart[b], s1 = kend[b], L = s1 - s0;
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    ELEM* ob = out + (b * KH + h) * G * D;
    if (L <= 0) {
        for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, (v16){});
        return;
    }
    const int64_t* tb = table + b * nbmax;
    const int8_t* kbase = cache + h * NB * BS * W;
    const int8_t* vbase = cache + (KH + h) * NB * BS * W;
    v16 qv[MAXG * MAXC];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c)
            qv[g * C + c] = CAT(ld16_, SFX)(q + b * qs + (h * G + g) * D + 16 * c) * scale;
    /* cursor over (block index, offset), starting at key s0 */
    const int64_t off0 = s0 % BS;
    const int64_t nbi = (s1 - 1) / BS - s0 / BS + 1; /* blocks the keys span */
#define Q8_ROW(base, bi, off) ((base) + (tb[bi] * BS + (off)) * W)
#define Q8_PREFETCH(base, pb, po) q8_prefetch_next(base, tb, BS, W, nbi, &(pb), &(po))
#define Q8_ADVANCE(bi, off)                                                                                  \
    do {                                                                                                     \
        if (++(off) == BS) {                                                                                 \
            (off) = 0;                                                                                       \
            ++(bi);                                                                                          \
        }                                                                                                    \
    } while (0)
    int64_t kbi = 0, koff = off0, p = s0, pb = (off0 + Q8_AHEAD) / BS, po = (off0 + Q8_AHEAD) % BS;
#if Q8_DOT
    if (dot) {
        q8_dot_scores(qv, kbase, tb, G, C, BS, nbi, off0, s0, s1, Lp, sc);
        p = s1;
    }
#else
    (void)dot;
#endif
    for (; p + 16 <= s1; p += 16) {
        v16 kf[16 * MAXC];
        float ks[16];
        for (int64_t j = 0; j < 16; ++j) {
            const int8_t* row = Q8_ROW(kbase, kbi, koff);
            Q8_PREFETCH(kbase, pb, po);
            for (int64_t c = 0; c < C; ++c) kf[j * C + c] = q8_ld16(row + 16 * c, kind);
            ks[j] = q8_half(row + D);
            Q8_ADVANCE(kbi, koff);
        }
        v16 ksv;
        memcpy(&ksv, ks, sizeof ksv);
        for (int64_t g = 0; g < G; ++g) {
            v16 a[16];
            for (int64_t j = 0; j < 16; ++j) {
                v16 t = qv[g * C] * kf[j * C];
                for (int64_t c = 1; c < C; ++c) t += qv[g * C + c] * kf[j * C + c];
                a[j] = t;
            }
            const v16 s = hsum16x16(a) * ksv;
            memcpy(sc + g * Lp + (p - s0), &s, sizeof s);
        }
    }
    for (; p < s1; ++p) {
        const int8_t* row = Q8_ROW(kbase, kbi, koff);
        v16 kf[MAXC];
        for (int64_t c = 0; c < C; ++c) kf[c] = q8_ld16(row + 16 * c, kind);
        const float k_scale = q8_half(row + D);
        for (int64_t g = 0; g < G; ++g) {
            v16 t = qv[g * C] * kf[0];
            for (int64_t c = 1; c < C; ++c) t += qv[g * C + c] * kf[c];
            sc[g * Lp + (p - s0)] = hsum16(t) * k_scale;
        }
        Q8_ADVANCE(kbi, koff);
    }
    float inv[MAXG];
    for (int64_t g = 0; g < G; ++g) {
        float* s = sc + g * Lp;
        for (int64_t i = L; i < Lp; ++i) s[i] = -INFINITY;
        v16 mv = (v16){} - INFINITY; /* (a scalar max is a chain of dependent compares) */
        for (int64_t i = 0; i < Lp; i += 16) {
            v16 x;
            memcpy(&x, s + i, sizeof x);
            mv = vmax(mv, x);
        }
        const float m = hmax16(mv);
        v16 sumv = (v16){};
        for (int64_t i = 0; i < Lp; i += 16) {
            v16 x;
            memcpy(&x, s + i, sizeof x);
            x = exp16(x - m);
            memcpy(s + i, &x, sizeof x);
            sumv += x;
        }
        inv[g] = 1.0f / hsum16(sumv);
    }
    v16 acc[MAXG * MAXC];
    for (int64_t i = 0; i < G * C; ++i) acc[i] = (v16){};
#if Q8_DOT
    if (dot && C % 2 == 0) q8_dot_pv(sc, Lp, vbase, tb, G, C, BS, nbi, off0, s0, s1, acc);
    else
#endif
    {
        int64_t vbi = 0, voff = off0;
        pb = (off0 + Q8_AHEAD) / BS;
        po = (off0 + Q8_AHEAD) % BS;
        for (p = s0; p < s1; ++p) {
            const int8_t* row = Q8_ROW(vbase, vbi, voff);
            Q8_PREFETCH(vbase, pb, po);
            Q8_ADVANCE(vbi, voff);
            v16 vf[MAXC];
            for (int64_t c = 0; c < C; ++c) vf[c] = q8_ld16(row + 16 * c, kind);
            const float v_scale = q8_half(row + D);
            for (int64_t g = 0; g < G; ++g) {
                const float w = sc[g * Lp + (p - s0)] * v_scale;
                for (int64_t c = 0; c < C; ++c) acc[g * C + c] += w * vf[c];
            }
        }
    }
#undef Q8_ROW
#undef Q8_PREFETCH
#undef Q8_ADVANCE
    for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) CAT(st16_, SFX)(ob + g * D + 16 * c, acc[g * C + c] * inv[g]);
}

/* The common shapes (head_dim 64 or 128; 3, 4 or 8 query heads per KV head) with G and C as
   constants, so the queries and accumulators stay in registers; others with them as variables. */
static __attribute__((noinline)) void CAT(q8_item_any_, SFX)(int64_t b, int64_t h, const ELEM* q, int64_t qs,
                                                             const int8_t* cache, const int64_t* table,
                                                             int64_t nbmax, const int64_t* kstart,
                                                             const int64_t* kend, ELEM* out, int64_t KH,
                                                             int64_t G, int64_t C, int64_t NB, int64_t BS,
                                                             float scale, int kind, float* sc) {
    const int dot = kind == 0 && q8_dot_on;
#define Q8_ITEM(g, c)                                                                                        \
    CAT(q8_item_, SFX)(b, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, g, c, NB, BS, scale, kind,   \
                       dot, sc)
    if (C == 4 && G == 3) Q8_ITEM(3, 4);
    else if (C == 4 && G == 4) Q8_ITEM(4, 4);
    else if (C == 8 && G == 4) Q8_ITEM(4, 8);
    else if (C == 8 && G == 8) Q8_ITEM(8, 8);
    else Q8_ITEM(G, C);
#undef Q8_ITEM
}

/* Returns 1 when a work item found no memory for its scores (its rows then hold garbage: the
   caller raises), else 0. */
int CAT(kv_paged_decode_attention_q8_,
        SFX)(const ELEM* q, int64_t qs, const int8_t* cache, const int64_t* table, int64_t nbmax,
             const int64_t* kstart, const int64_t* kend, ELEM* out, int64_t B, int64_t KH, int64_t G,
             int64_t D, int64_t NB, int64_t BS, float scale, int kind, int nthreads) {
    const int vec = D % 16 == 0 && D / 16 <= MAXC && G <= MAXG;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH, L = kend[b] - kstart[b];
        const int64_t Lp = L > 0 ? (L + 15) & ~(int64_t)15 : 16;
        float* sc = (float*)malloc(sizeof(float) * (size_t)(G * Lp));
        if (!sc) {
            failed = 1;
            continue;
        }
        if (vec)
            CAT(q8_item_any_, SFX)(b, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, G, D / 16, NB, BS,
                                   scale, kind, sc);
        else
            CAT(q8_generic_item_, SFX)(b, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, G, D, NB, BS,
                                       scale, kind, sc);
        free(sc);
    }
    return failed;
}
