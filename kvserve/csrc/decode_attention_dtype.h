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

/* Scores of keys kp[0 .. e-1] (e < 16) for the G query heads of qv (scaled, C vectors each):
   one horizontal sum per key and head, into s[g * Lp + j]. */
static inline __attribute__((always_inline)) void CAT(tail_, SFX)(const v16* qv, const ELEM* const* kp,
                                                                  int64_t e, const int64_t G, const int64_t C,
                                                                  float* s, int64_t Lp) {
    for (int64_t j = 0; j < e; ++j) {
        v16 kc[MAXC];
        for (int64_t c = 0; c < C; ++c) kc[c] = CAT(ld16_, SFX)(kp[j] + 16 * c);
        for (int64_t g = 0; g < G; ++g) {
            const v16* qg = qv + g * C;
            v16 t = qg[0] * kc[0];
            for (int64_t c = 1; c < C; ++c) t += qg[c] * kc[c];
            s[g * Lp + j] = hsum16(t);
        }
    }
}

/* One work item of the fast path: KV head h of rows b0 .. b0+R-1, which are one sequence's
   consecutive query positions (R = 1: a decode; R > 1: a verify chunk, see verify_rows), so
   each key and value row is read once for all R. Each row's arithmetic is exactly that of the
   row alone (R = 1): its keys in the same 16-key blocks and tail, its own softmax and its own
   value sums in key order, so a verify row equals the decode of the same position bit for bit.
   Always inlined, so the calls below with literal G, C and R = 1 get copies whose query and
   accumulator vectors live in registers. */
static inline __attribute__((always_inline)) void
CAT(item_, SFX)(int64_t b0, const int64_t R, int64_t h, const ELEM* q, int64_t qs, const ELEM* cache,
                const int64_t* table, int64_t nbmax, const int64_t* kstart, const int64_t* kend, ELEM* out,
                int64_t KH, const int64_t G, const int64_t C, int64_t NB, int64_t BS, float scale) {
    const int64_t D = 16 * C;
    const int64_t v_off = KH * NB * BS * D;
    const int64_t bl = b0 + R - 1; /* the last row: the most keys, and the table read */
    const int64_t s0 = kstart[b0], s1 = kend[bl], L = s1 - s0;
    if (L <= 0) { /* only ever R = 1 (verify_rows needs keys) */
        ELEM* ob = out + (b0 * KH + h) * G * D;
        for (int64_t i = 0; i < G * C; ++i) CAT(st16_, SFX)(ob + 16 * i, (v16){});
        return;
    }
    const int64_t Lp = (L + 15) & ~(int64_t)15;
    const int64_t GC = G * C;
    /* Per row: scores [G][Lp] (row r's own Lr <= L of them used), scaled queries, accumulators. */
    float* sc = (float*)aligned_alloc(64, sizeof(float) * (size_t)(R * G * Lp));
    /* qv: scaled float queries; qb: the bfloat16 queries as stored, 32 a vector (vdpbf16ps). */
    v16 qv1[MAXG * MAXC], acc1[MAXG * MAXC], qb1[MAXG * MAXC / 2];
    v16* heap = R == 1 ? NULL : (v16*)aligned_alloc(64, sizeof(v16) * (size_t)(5 * R * GC / 2));
    /* Row r's vectors (R = 1: the arrays above, named directly so they stay in registers). */
#define QV(r) (R == 1 ? qv1 : heap + (r) * GC)
#define ACC(r) (R == 1 ? acc1 : heap + R * GC + (r) * GC)
#define QB(r) (R == 1 ? qb1 : heap + 2 * R * GC + (r) * (GC / 2))
    for (int64_t r = 0; r < R; ++r) {
        const ELEM* qsrc = q + (b0 + r) * qs + h * G * D;
        for (int64_t i = 0; i < GC; ++i) QV(r)[i] = CAT(ld16_, SFX)(qsrc + 16 * i) * scale;
        if (sizeof(ELEM) == 2 && C % 2 == 0) /* read by the vdpbf16ps path only */
            for (int64_t i = 0; i < GC / 2; ++i) memcpy(QB(r) + i, qsrc + 32 * i, 64);
    }
    const int64_t* tb = table + bl * nbmax;
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
    int64_t kbi = 0, koff = off0;
    /* 16 keys at a time: a row whose keys fill the block gets their 16 scores from one
       transposing reduction per query head (instead of 16 horizontal sums); a row whose keys
       end inside a block takes its last keys one by one (R = 1: the last block's). */
    const ELEM* kp[16];
    int64_t p = s0;
#define TAILS                                                                                                \
    for (int64_t r = 0; r < R; ++r) {                                                                        \
        const int64_t e = kend[b0 + r] - p; /* row r's keys in this block */                                 \
        if (e > 0 && e < 16) CAT(tail_, SFX)(QV(r), kp, e, G, C, sc + r * G * Lp + (p - s0), Lp);            \
    }
    for (; p + 16 <= s1; p += 16) {
#if defined(__AVX512BF16__)
        /* bfloat16 with AVX512-BF16: vdpbf16ps multiplies bf16 pairs exactly and adds them in
           float32, so the keys need no widening and half the instructions; q is used unscaled
           (as stored) and the scale applied to the 16 scores. */
        if (sizeof(ELEM) == 2 && C % 2 == 0) {
            __m512bh kb[16 * MAXC / 2];
            for (int64_t j = 0; j < 16; ++j) {
                kp[j] = ROW(kbase, kbi, koff);
                for (int64_t c = 0; c < C / 2; ++c)
                    kb[j * (C / 2) + c] = (__m512bh)_mm512_loadu_si512((const void*)(kp[j] + 32 * c));
                PREFETCH_AHEAD(kbase, kbi, koff);
                ADVANCE(kbi, koff);
            }
            for (int64_t r = 0; r < R; ++r) {
                if (r < R - 1 && kend[b0 + r] - p < 16) continue;
                float* sr = sc + r * G * Lp + (p - s0);
                for (int64_t g = 0; g < G; ++g) {
                    const v16* qg = QB(r) + g * (C / 2);
                    v16 a[16];
                    for (int64_t j = 0; j < 16; ++j) {
                        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qg[0], kb[j * (C / 2)]);
                        for (int64_t c = 1; c < C / 2; ++c)
                            t = _mm512_dpbf16_ps(t, (__m512bh)qg[c], kb[j * (C / 2) + c]);
                        a[j] = (v16)t;
                    }
                    *(v16*)(sr + g * Lp) = hsum16x16(a) * scale;
                }
            }
            if (R > 1) TAILS;
            continue;
        }
#endif
        v16 kf[16 * MAXC];
        for (int64_t j = 0; j < 16; ++j) {
            kp[j] = ROW(kbase, kbi, koff);
            for (int64_t c = 0; c < C; ++c) kf[j * C + c] = CAT(ld16_, SFX)(kp[j] + 16 * c);
            PREFETCH_AHEAD(kbase, kbi, koff);
            ADVANCE(kbi, koff);
        }
        for (int64_t r = 0; r < R; ++r) {
            if (r < R - 1 && kend[b0 + r] - p < 16) continue;
            float* sr = sc + r * G * Lp + (p - s0);
            for (int64_t g = 0; g < G; ++g) {
                const v16* qg = QV(r) + g * C;
                v16 a[16];
                for (int64_t j = 0; j < 16; ++j) {
                    v16 t = qg[0] * kf[j * C];
                    for (int64_t c = 1; c < C; ++c) t += qg[c] * kf[j * C + c];
                    a[j] = t;
                }
                *(v16*)(sr + g * Lp) = hsum16x16(a);
            }
        }
        if (R > 1) TAILS;
    }
    if (p < s1) {
        for (int64_t j = 0; j < s1 - p; ++j) {
            kp[j] = ROW(kbase, kbi, koff);
            ADVANCE(kbi, koff);
        }
        TAILS;
    }
#undef TAILS
    for (int64_t r = 0; r < R; ++r) {
        const int64_t Lr = kend[b0 + r] - s0, Lpr = (Lr + 15) & ~(int64_t)15;
        for (int64_t g = 0; g < G; ++g) {
            float* s = sc + (r * G + g) * Lp;
            for (int64_t i = Lr; i < Lpr; ++i) s[i] = -INFINITY;
            v16 mv = *(v16*)s;
            for (int64_t i = 16; i < Lpr; i += 16) {
                v16 x = *(v16*)(s + i);
                mv = vmax(x, mv);
            }
            float m = mv[0];
            for (int i = 1; i < 16; ++i) m = mv[i] > m ? mv[i] : m;
            v16 sumv = (v16){};
            for (int64_t i = 0; i < Lpr; i += 16) {
                v16 x = exp16(*(v16*)(s + i) - m);
                *(v16*)(s + i) = x;
                sumv += x;
            }
            const float inv = 1.0f / hsum16(sumv);
            for (int64_t i = 0; i < Lpr; i += 16) *(v16*)(s + i) *= inv;
        }
    }
    for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < GC; ++i) ACC(r)[i] = (v16){};
    const ELEM* vbase = cache + v_off + h * NB * BS * D;
    for (int64_t bi = 0; bi < PF && bi < nbi; ++bi)
        for (int64_t off = bi ? 0 : off0; off < BS; ++off)
            for (int64_t o = 0; o < row_bytes; o += 64)
                __builtin_prefetch((const char*)ROW(vbase, bi, off) + o);
    int64_t vbi = 0, voff = off0;
    for (int64_t p = s0; p < s1; ++p) {
        const ELEM* v = ROW(vbase, vbi, voff);
        PREFETCH_AHEAD(vbase, vbi, voff);
        ADVANCE(vbi, voff);
        v16 vc[MAXC];
        for (int64_t c = 0; c < C; ++c) vc[c] = CAT(ld16_, SFX)(v + 16 * c);
        /* rows are in key order: row r has key p iff p < kend[b0 + r] (the last row has all) */
        for (int64_t r = R - 1; r >= 0; --r) {
            if (r < R - 1 && p >= kend[b0 + r]) break;
            for (int64_t g = 0; g < G; ++g) {
                const float a = sc[(r * G + g) * Lp + (p - s0)];
                v16* ag = ACC(r) + g * C;
                for (int64_t c = 0; c < C; ++c) ag[c] += a * vc[c];
            }
        }
    }
#undef PF
#undef ROW
#undef PREFETCH_AHEAD
#undef ADVANCE
    for (int64_t r = 0; r < R; ++r) {
        ELEM* ob = out + ((b0 + r) * KH + h) * G * D;
        for (int64_t i = 0; i < GC; ++i) CAT(st16_, SFX)(ob + 16 * i, ACC(r)[i]);
    }
#undef QV
#undef ACC
#undef QB
    free(heap);
    free(sc);
}

/* Common shapes (head_dim 64 or 128; 1-8 query heads per KV head) as constants: calls ITEM(g, c). */
#define BY_SHAPE(G, C)                                                                                       \
    do {                                                                                                     \
        if (C == 4 && G == 3) ITEM(3, 4);                                                                    \
        else if (C == 4 && G == 1) ITEM(1, 4);                                                               \
        else if (C == 4 && G == 4) ITEM(4, 4);                                                               \
        else if (C == 8 && G == 4) ITEM(4, 8);                                                               \
        else if (C == 8 && G == 8) ITEM(8, 8);                                                               \
        else if (C == 8 && G == 1) ITEM(1, 8);                                                               \
        else ITEM(G, C);                                                                                     \
    } while (0)
#define ITEM(g, c)                                                                                           \
    CAT(item_, SFX)(b0, R, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, g, c, NB, BS, scale)

/* A work item of R > 1 rows, out of line: the loop below keeps only the single-row copies
   inline (with both, single rows run slower: the larger loop body). */
static __attribute__((noinline)) void CAT(rows_, SFX)(int64_t b0, int64_t R, int64_t h, const ELEM* q,
                                                      int64_t qs, const ELEM* cache, const int64_t* table,
                                                      int64_t nbmax, const int64_t* kstart,
                                                      const int64_t* kend, ELEM* out, int64_t KH, int64_t G,
                                                      int64_t C, int64_t NB, int64_t BS, float scale) {
    BY_SHAPE(G, C);
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
#ifdef DA_AMX
    if (sizeof(ELEM) == 2 && da_amx && (D == 32 || D == 64) && G <= 16 && BS % 16 == 0) {
        /* bfloat16 on AMX tiles (da_item_amx): items of up to 16 / G rows of one sequence */
        int64_t* st = (int64_t*)malloc(sizeof(int64_t) * (size_t)(B + 1));
        const int64_t ng = st ? verify_rows(table, nbmax, kstart, kend, B, BS, 16 / G, st) : 0;
        int failed = st == NULL;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            config_tiles();
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < ng * KH; ++w)
                failed |= da_item_amx(st[w / KH], st[w / KH + 1] - st[w / KH], w % KH, (const uint16_t*)q, qs,
                                      (const uint16_t*)cache, table, nbmax, kstart, kend, (uint16_t*)out, KH,
                                      G, D, NB, BS, scale);
            _tile_release();
        }
        free(st);
        if (!failed) return;
        /* no memory for an item's scratch: every row again on the AVX-512 path below */
    }
#endif
    const int64_t C = D / 16;
    /* Work items: whole verify chunks (up to MAXR rows) where that leaves at least 4 items a
       thread, else single rows. A chunk's rows share their key and value reads but each costs
       its own compute, so they pay where the reads do not fit the cache (several sequences'
       chunks) and lose where a thread would wait on a long item (one sequence's chunk). */
    int64_t* starts = (int64_t*)malloc(sizeof(int64_t) * (size_t)(B + 1));
    int64_t ng = verify_rows(table, nbmax, kstart, kend, B, BS, MAXR, starts);
    if (ng < B && ng * KH < 4 * (int64_t)nthreads) { /* single rows */
        for (int64_t i = 0; i <= B; ++i) starts[i] = i;
        ng = B;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t w = 0; w < ng * KH; ++w) {
        const int64_t b0 = starts[w / KH], R = starts[w / KH + 1] - b0, h = w % KH;
        if (R > 1) {
            CAT(rows_, SFX)(b0, R, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, G, C, NB, BS, scale);
            continue;
        }
#undef ITEM
#define ITEM(g, c)                                                                                           \
    CAT(item_, SFX)(b0, 1, h, q, qs, cache, table, nbmax, kstart, kend, out, KH, g, c, NB, BS, scale)
        BY_SHAPE(G, C);
    }
    free(starts);
}
#undef ITEM
#undef BY_SHAPE
