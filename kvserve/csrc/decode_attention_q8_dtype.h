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
   up to MAXG query heads per KV head take the vector path, other shapes a scalar loop. */

/* Shared by both dtype instantiations (the template is included once per ELEM). */
#ifndef DA_Q8_COMMON
#define DA_Q8_COMMON
typedef int8_t v16c __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16uc __attribute__((vector_size(16), aligned(1)));

/* float16 bits to float32 (normal, subnormal, zero; the scales are never inf or NaN): one
   VCVTPH2PS with F16C, else the bit fields moved. */
static inline float q8_half(const int8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* 16 codes of `kind` as float32. float8: the code's exponent and mantissa bits placed at the
   top of a float32's exponent and mantissa fields give 2^(e - 127) (1 + m / 2^k) (or the
   subnormal m 2^-126 / 2^k for e = 0); one multiply by 2^(127 - bias) rebias it, and the sign
   bit is put back. */
/* 16 bytes widened to 32-bit lanes, sign- (int8) or zero-extended (float8): one VPMOVSXBD /
   VPMOVZXBD (two on AVX2); the generic conversions below are left to GCC elsewhere. */
static inline v16i q8_widen(const int8_t* p, int sign) {
#if defined(__AVX512F__)
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
    return (v16i)(sign ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x));
#elif defined(__AVX2__)
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
    const __m128i hi = _mm_unpackhi_epi64(x, x);
    __m256i a[2] = {sign ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x),
                    sign ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi)};
    v16i r;
    memcpy(&r, a, sizeof r);
    return r;
#else
    return sign ? __builtin_convertvector(*(const v16c*)p, v16i)
                : __builtin_convertvector(*(const v16uc*)p, v16i);
#endif
}

static inline __attribute__((always_inline)) v16 q8_ld16(const int8_t* p, int kind) {
    if (kind == 0) return __builtin_convertvector(q8_widen(p, 1), v16);
    const v16i u = q8_widen(p, 0);
    const v16i sign = (u & 0x80) << 24;
    v16 mag;
    if (kind == 1) mag = (v16)((u & 0x7F) << 20) * 0x1p120f;
    else mag = (v16)((u & 0x7F) << 21) * 0x1p112f;
    return (v16)((v16i)mag | sign);
}

static inline float q8_ld1(const int8_t* p, int kind) {
    if (kind == 0) return (float)*p;
    const uint32_t u = (uint8_t)*p, sign = (u & 0x80u) << 24;
    uint32_t bits;
    float f;
    if (kind == 1) {
        bits = (u & 0x7Fu) << 20;
        memcpy(&f, &bits, 4);
        f *= 0x1p120f;
    } else {
        bits = (u & 0x7Fu) << 21;
        memcpy(&f, &bits, 4);
        f *= 0x1p112f;
    }
    memcpy(&bits, &f, 4);
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
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
                   int64_t G, int64_t C, int64_t NB, int64_t BS, float scale, int kind, float* sc) {
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
/* the row at the same offset two blocks ahead (the blocks are scattered: no hardware prefetch) */
#define Q8_PREFETCH(base, bi, off)                                                                           \
    do {                                                                                                     \
        if ((bi) + 2 < nbi) {                                                                                \
            const int8_t* r_ = Q8_ROW(base, (bi) + 2, off);                                                  \
            __builtin_prefetch(r_);                                                                          \
            __builtin_prefetch(r_ + W - 1);                                                                  \
        }                                                                                                    \
    } while (0)
#define Q8_ADVANCE(bi, off)                                                                                  \
    do {                                                                                                     \
        if (++(off) == BS) {                                                                                 \
            (off) = 0;                                                                                       \
            ++(bi);                                                                                          \
        }                                                                                                    \
    } while (0)
    int64_t kbi = 0, koff = off0, p = s0;
    for (; p + 16 <= s1; p += 16) {
        v16 kf[16 * MAXC];
        float ks[16];
        for (int64_t j = 0; j < 16; ++j) {
            const int8_t* row = Q8_ROW(kbase, kbi, koff);
            Q8_PREFETCH(kbase, kbi, koff);
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
        float m = s[0];
        for (int64_t i = 1; i < L; ++i) m = s[i] > m ? s[i] : m;
        for (int64_t i = L; i < Lp; ++i) s[i] = -INFINITY;
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
    int64_t vbi = 0, voff = off0;
    for (p = s0; p < s1; ++p) {
        const int8_t* row = Q8_ROW(vbase, vbi, voff);
        Q8_PREFETCH(vbase, vbi, voff);
        Q8_ADVANCE(vbi, voff);
        v16 vf[MAXC];
        for (int64_t c = 0; c < C; ++c) vf[c] = q8_ld16(row + 16 * c, kind);
        const float v_scale = q8_half(row + D);
        for (int64_t g = 0; g < G; ++g) {
            const float w = sc[g * Lp + (p - s0)] * v_scale;
            for (int64_t c = 0; c < C; ++c) acc[g * C + c] += w * vf[c];
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
#define Q8_ITEM(g, c)                                                                                        \
    CAT(q8_item_, SFX)(b, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, g, c, NB, BS, scale, kind, sc)
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
