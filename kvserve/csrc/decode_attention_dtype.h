/* The dtype-generic kernels of decode_attention.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. */
static void CAT(generic_, SFX)(const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table,
                               int64_t nbmax, const int64_t* kstart, const int64_t* kend, ELEM* out,
                               int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS,
                               float scale, int nthreads) {
    const int64_t v_off = KH * NB * BS * D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < B * KH; ++w) {
        const int64_t b = w / KH, h = w % KH;
        const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
        const ELEM* qb = q + b * qs + h * G * D;
        ELEM* ob = out + w * G * D;
        if (L <= 0) {
            for (int64_t i = 0; i < G * D; ++i) CAT(st1_, SFX)(ob + i, 0.0f);
            continue;
        }
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
            for (int64_t i = 0; i < L; ++i) {
                s[i] = expf(s[i] - m);
                sum += s[i];
            }
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
static inline __attribute__((always_inline)) void
CAT(item_, SFX)(int64_t w, const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table, int64_t nbmax,
                const int64_t* kstart, const int64_t* kend, ELEM* out, int64_t KH, const int64_t G,
                const int64_t C, int64_t NB, int64_t BS, float scale) {
    const int64_t D = 16 * C;
    const int64_t v_off = KH * NB * BS * D;
    const int64_t b = w / KH, h = w % KH;
    const int64_t s0 = kstart[b], s1 = kend[b], L = s1 - s0;
    ELEM* ob = out + w * G * D;
    if (L <= 0) {
        for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, (v16){});
        return;
    }
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
#define PREFETCH_AHEAD(base, bi, off)                                                                        \
    do {                                                                                                     \
        if ((bi) + PF < nbi) {                                                                               \
            const char* nr_ = (const char*)ROW(base, (bi) + PF, off);                                        \
            for (int64_t o_ = 0; o_ < row_bytes; o_ += 64) __builtin_prefetch(nr_ + o_);                     \
        }                                                                                                    \
    } while (0)
#define ADVANCE(bi, off)                                                                                     \
    do {                                                                                                     \
        if (++(off) == BS) {                                                                                 \
            (off) = 0;                                                                                       \
            ++(bi);                                                                                          \
        }                                                                                                    \
    } while (0)
    /* The first PF blocks have no earlier rows to prefetch them from. */
    for (int64_t bi = 0; bi < PF && bi < nbi; ++bi)
        for (int64_t off = bi ? 0 : off0; off < BS; ++off)
            for (int64_t o = 0; o < row_bytes; o += 64)
                __builtin_prefetch((const char*)ROW(kbase, bi, off) + o);
    int64_t p = s0, kbi = 0, koff = off0;
    /* 16 keys at a time: widen them once into kf, then one transposing reduction per
       query head gives their 16 scores (instead of 16 horizontal sums). */
#if defined(__AVX512BF16__)
    /* bfloat16 with AVX512-BF16: vdpbf16ps multiplies bf16 pairs exactly and adds them in
       float32, so the keys need no widening and half the instructions; q is used unscaled
       (as stored) and the scale applied to the 16 scores. */
    if (sizeof(ELEM) == 2 && C % 2 == 0) {
        __m512bh qb[MAXG * MAXC / 2];
        for (int64_t i = 0; i < G * C / 2; ++i)
            qb[i] = (__m512bh)_mm512_loadu_si512((const void*)(qsrc + 32 * i));
        for (; p + 16 <= s1; p += 16) {
            __m512bh kb[16 * MAXC / 2];
            for (int64_t j = 0; j < 16; ++j) {
                const ELEM* k = ROW(kbase, kbi, koff);
                for (int64_t c = 0; c < C / 2; ++c)
                    kb[j * (C / 2) + c] = (__m512bh)_mm512_loadu_si512((const void*)(k + 32 * c));
                PREFETCH_AHEAD(kbase, kbi, koff);
                ADVANCE(kbi, koff);
            }
            for (int64_t g = 0; g < G; ++g) {
                const __m512bh* qg = qb + g * (C / 2);
                v16 a[16];
                for (int64_t j = 0; j < 16; ++j) {
                    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qg[0], kb[j * (C / 2)]);
                    for (int64_t c = 1; c < C / 2; ++c)
                        acc = _mm512_dpbf16_ps(acc, qg[c], kb[j * (C / 2) + c]);
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
        for (int64_t i = 16; i < Lp; i += 16) {
            v16 x = *(v16*)(s + i);
            mv = vmax(x, mv);
        }
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
            for (int64_t o = 0; o < row_bytes; o += 64)
                __builtin_prefetch((const char*)ROW(vbase, bi, off) + o);
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

void CAT(kv_paged_decode_attention_, SFX)(const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table,
                                          int64_t nbmax, const int64_t* kstart, const int64_t* kend,
                                          ELEM* out, int64_t B, int64_t KH, int64_t G, int64_t D, int64_t NB,
                                          int64_t BS, float scale, int nthreads) {
    if (D % 16 || D / 16 > MAXC || G > MAXG) {
        CAT(generic_, SFX)(q, qs, cache, table, nbmax, kstart, kend, out, B, KH, G, D, NB, BS, scale,
                           nthreads);
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
