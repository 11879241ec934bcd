/* The dtype-generic kernels of prefill_attention.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. */
/* One work item on AVX-512. Always inlined, so the calls with a literal C (= head_dim / 16) get
   copies whose loops are fully unrolled and whose tiles live in registers. */
static inline __attribute__((always_inline)) void CAT(pf_item_, SFX)(const pf_args* A, pf_item it,
                                                                     pf_scratch* S, const int64_t C) {
    const int64_t D = 16 * C, G = A->G, BS = A->BS, W = A->window;
    const ELEM* q = (const ELEM*)A->q;
    ELEM* out = (ELEM*)A->out;
    const pf_geom geo = pf_geom_of(A, it);
    const ELEM* kbase = (const ELEM*)A->cache + geo.hoff;
    const ELEM* vbase = kbase + A->KH * A->NB * BS * D;
    const int64_t H = A->KH * G, nr = geo.nr;
    /* a quantized cache: KV head h's K rows, and the distance from a K row to its V row */
    const int8_t* k8 = (const int8_t*)A->cache + it.h * A->NB * BS * (D + 2);
    const int64_t v8off = A->KH * A->NB * BS * (D + 2);

    /* Queries -> qt[g][d][lane] (float), 16 x 16 blocks at a time; lanes past the tile's rows
       are zero. */
    for (int64_t g = 0; g < G; ++g) {
        const ELEM* qg = q + geo.r0 * A->qs + (it.h * G + g) * D;
        for (int64_t cc = 0; cc < C; ++cc) {
            v16 x[16];
            for (int64_t i = 0; i < 16; ++i)
                x[i] = i < nr ? CAT(ld16_, SFX)(qg + i * A->qs + 16 * cc) : (v16){};
            transpose16(x);
            for (int64_t d = 0; d < 16; ++d) S->qt[g * D + 16 * cc + d] = x[d];
        }
        for (int64_t i = 0; i < 16 * D; i += 16) *(v16*)(S->o + g * 16 * D + i) = (v16){};
        S->m[g] = (v16){} - INFINITY;
        S->l[g] = (v16){};
    }

    for (int64_t s = 0; s < geo.nsteps; ++s) {
        const int64_t k0 = geo.pf - 16 * (geo.nsteps - 1 - s);
        /* The step's keys ka..ke that some row attends (others zero: never read, so no table
           entry is needed for them), widened once for all G heads. */
        const int64_t ka = k0 > geo.kmin ? k0 : geo.kmin, ke = k0 + 15 < geo.pl ? k0 + 15 : geo.pl;
        const float* kf = S->kf;
        const float* vf = S->vf;
        int64_t bi = ka / BS - geo.fb, off = ka % BS;
        if (A->qkind >= 0)
            for (int64_t j = 0; j < 16; ++j) {
                const int64_t k = k0 + j;
                if (k < ka || k > ke) {
                    for (int64_t cc = 0; cc < C; ++cc)
                        *(v16*)(S->kf + j * D + 16 * cc) = *(v16*)(S->vf + j * D + 16 * cc) = (v16){};
                    continue;
                }
                const int8_t* kr = k8 + (geo.tb[bi] * BS + off) * (D + 2);
                const int8_t* vr = kr + v8off;
                const float ks = q8_half(kr + D), vs = q8_half(vr + D);
                for (int64_t cc = 0; cc < C; ++cc)
                    *(v16*)(S->kf + j * D + 16 * cc) = q8_ld16(kr + 16 * cc, A->qkind) * ks;
                for (int64_t cc = 0; cc < C; ++cc)
                    *(v16*)(S->vf + j * D + 16 * cc) = q8_ld16(vr + 16 * cc, A->qkind) * vs;
                if (++off == BS) {
                    off = 0;
                    ++bi;
                }
            }
        else if (sizeof(ELEM) == 4 && ka == k0 && ke == k0 + 15 && off + 16 <= BS) {
            /* float32, all 16 keys in one block: read them in place. */
            kf = (const float*)(kbase + (geo.tb[bi] * BS + off) * D);
            vf = (const float*)(vbase + (geo.tb[bi] * BS + off) * D);
        } else
            for (int64_t j = 0; j < 16; ++j) {
                const int64_t k = k0 + j;
                if (k < ka || k > ke) {
                    for (int64_t cc = 0; cc < C; ++cc)
                        *(v16*)(S->kf + j * D + 16 * cc) = *(v16*)(S->vf + j * D + 16 * cc) = (v16){};
                    continue;
                }
                const int64_t row = (geo.tb[bi] * BS + off) * D;
                for (int64_t cc = 0; cc < C; ++cc)
                    *(v16*)(S->kf + j * D + 16 * cc) = CAT(ld16_, SFX)(kbase + row + 16 * cc);
                for (int64_t cc = 0; cc < C; ++cc)
                    *(v16*)(S->vf + j * D + 16 * cc) = CAT(ld16_, SFX)(vbase + row + 16 * cc);
                if (++off == BS) {
                    off = 0;
                    ++bi;
                }
            }
        const int need = pf_masks(&geo, k0, W, S->mk);

        for (int64_t g = 0; g < G; ++g) {
            /* Scores: sc[j][lane] = q_lane . k_j, 16 independent accumulators. */
            v16 sc[16];
            for (int j = 0; j < 16; ++j) sc[j] = (v16){};
            const v16* qt = S->qt + g * D;
            for (int64_t d = 0; d < D; ++d) {
                const v16 qd = qt[d];
                for (int j = 0; j < 16; ++j) sc[j] += kf[j * D + d] * qd;
            }
            /* (A copy: sc itself must not have its address taken, or GCC keeps the
               accumulators in memory.) */
            v16 x[16];
            for (int j = 0; j < 16; ++j) x[j] = sc[j];
            *(v16*)S->alpha = pf_softmax(x, A->scale, need, S->mk, S->m + g, S->l + g);
            for (int j = 0; j < 16; ++j) *(v16*)(S->p + 16 * j) = x[j];

            /* O[r] = alpha[r] * O[r] + sum_j p[j][r] v_j: tiles of R rows x D in registers
               (R * C <= 16 accumulators), p broadcast, each v_j vector loaded once per tile. */
            const int64_t R = C <= 1 ? 16 : C <= 2 ? 8 : C <= 4 ? 4 : C <= 8 ? 2 : 1;
            float* og = S->o + g * 16 * D;
            for (int64_t rb = 0; rb < nr; rb += R) {
                v16 acc[16];
                for (int64_t r = 0; r < R; ++r) {
                    const float a = S->alpha[rb + r];
                    for (int64_t cc = 0; cc < C; ++cc)
                        acc[r * C + cc] = *(v16*)(og + (rb + r) * D + 16 * cc) * a;
                }
                for (int64_t j = 0; j < 16; ++j) {
                    float pj[16];
                    for (int64_t r = 0; r < R; ++r) pj[r] = S->p[16 * j + rb + r];
                    for (int64_t cc = 0; cc < C; ++cc) {
                        const v16 vv = *(const v16*)(vf + j * D + 16 * cc);
                        for (int64_t r = 0; r < R; ++r) acc[r * C + cc] += pj[r] * vv;
                    }
                }
                for (int64_t r = 0; r < R; ++r)
                    for (int64_t cc = 0; cc < C; ++cc) *(v16*)(og + (rb + r) * D + 16 * cc) = acc[r * C + cc];
            }
        }
    }

    for (int64_t g = 0; g < G; ++g) {
        float inv[16];
        *(v16*)inv = 1.0f / S->l[g];
        const float* og = S->o + g * 16 * D;
        for (int64_t r = 0; r < nr; ++r) {
            ELEM* dst = out + (geo.r0 + r) * H * D + (it.h * G + g) * D;
            for (int64_t cc = 0; cc < C; ++cc)
                CAT(st16_, SFX)(dst + 16 * cc, *(const v16*)(og + r * D + 16 * cc) * inv[r]);
        }
    }
}

static void CAT(pf_run_, SFX)(const ELEM* q, int64_t qs, const void* cache, int qkind, const int64_t* table,
                              int64_t nbmax, const int64_t* q_start, const int64_t* pos0,
                              const int64_t* kstart, int64_t nc, int64_t window, ELEM* out, int64_t T,
                              int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale, int amx,
                              int64_t gather_bytes, int nthreads, int64_t* status) {
    status[0] = pf_check(q_start, pos0, kstart, table, nbmax, nc, T, window, NB, BS, &status[1]);
    if (status[0]) return;
    if (D % 16 || D / 16 > PMAXC) {
        status[0] = 6;
        return;
    }
#ifdef PF_AMX
    amx = amx && sizeof(ELEM) == 2 && D % 32 == 0 && qkind < 0;
#else
    amx = 0;
#endif
    int64_t ni = 0;
    for (int64_t c = 0; c < nc; ++c) ni += (q_start[c + 1] - q_start[c] + 15) / 16 * KH;
    if (ni == 0) return;
    pf_item* items = (pf_item*)malloc(sizeof(pf_item) * (size_t)ni);
    int64_t* grange = (int64_t*)malloc(sizeof(int64_t) * 3 * (size_t)nc); /* gbase, glen, goff */
    if (!items || !grange) {
        free(items);
        free(grange);
        status[0] = 7;
        return;
    }
    pf_args args = {q, qs, cache, table, nbmax, q_start, pos0,   kstart,      window,          out, KH, G,
                    D, NB, BS,    scale, NULL,  NULL,    grange, grange + nc, grange + 2 * nc, -1};
    args.qkind = qkind;
    for (int64_t c = 0; c < nc; ++c) pf_key_range(&args, c, &grange[c], &grange[nc + c]);
    const int64_t C = D / 16;
    int failed = 0;
    /* Chunks go in batches whose gathered keys (AMX path) fit gather_bytes (at least one chunk
       a batch); without AMX there is nothing to gather: one batch. */
    for (int64_t c0 = 0, c1; c0 < nc && !failed; c0 = c1) {
        size_t bytes = 0;
        for (c1 = c0; c1 < nc; ++c1) {
            const size_t b = (size_t)(2 * KH * grange[nc + c1] * D) * 2;
            if (amx && c1 > c0 && bytes + b > (size_t)gather_bytes) break;
            grange[2 * nc + c1] = (int64_t)(bytes / 4); /* element offset in each buffer */
            bytes += b;
        }
        uint16_t* gbuf = NULL;
        if (amx) {
            if (pf_gather_size < bytes) {
                free(pf_gather_buf);
                pf_gather_buf = (uint16_t*)aligned_alloc(64, (bytes + 63) / 64 * 64);
                pf_gather_size = pf_gather_buf ? bytes : 0;
            }
            if (!(gbuf = pf_gather_buf)) {
                failed = 1;
                break;
            }
            args.kg = gbuf;
            args.vtg = gbuf + bytes / 4;
        }
        ni = 0;
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t n = q_start[c + 1] - q_start[c];
            int64_t gcost = 0;
            for (int64_t t = 0; t < (n + 15) / 16; ++t) {
                const int64_t pf = pos0[c] + 16 * t;
                const int64_t klo = window > 0 ? (pf - window + 1 > 0 ? pf - window + 1 : 0) : 0;
                gcost += (pf - klo + 15) / 16 + 1;
            }
            for (int64_t h = 0; h < KH; ++h)
                for (int64_t t = 0; t < (n + 15) / 16; ++t)
                    items[ni++] = (pf_item){(int32_t)c, (int32_t)h, (int32_t)t, gcost};
        }
        if (ni == 0) continue;
        qsort(items, (size_t)ni, sizeof(pf_item), pf_item_cmp);
        const int nt = nthreads < ni ? nthreads : (int)ni;
#pragma omp parallel num_threads(nt)
        {
            pf_scratch sc;
            void* mem = pf_scratch_alloc(&sc, G, D);
            if (!mem) {
#pragma omp atomic write
                failed = 1;
            }
#ifdef PF_AMX
            const int64_t ng = amx ? (c1 - c0) * KH : 0; /* (chunk, KV head) gathers */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < ng; ++i) { /* (implicit barrier: all gathered before any item) */
                const int64_t c = c0 + i / KH, h = i % KH, len = grange[nc + c];
                pf_gather(&args, c, h, (uint16_t*)args.kg + grange[2 * nc + c] + h * len * D,
                          (uint16_t*)args.vtg + grange[2 * nc + c] + h * len * D, grange[c], len);
            }
            if (amx) config_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < ni; ++i) {
                if (!mem) continue;
#ifdef PF_AMX
                if (amx) {
                    pf_item_amx(&args, items[i], &sc);
                    continue;
                }
#endif
#define ITEM(cc) CAT(pf_item_, SFX)(&args, items[i], &sc, cc)
                /* head_dim 16, 32, 64, 128 as constants; others at run time. */
                switch (C) {
                case 1: ITEM(1); break;
                case 2: ITEM(2); break;
                case 4: ITEM(4); break;
                case 8: ITEM(8); break;
                default: ITEM(C); break;
                }
#undef ITEM
            }
#ifdef PF_AMX
            if (amx) _tile_release();
#endif
        }
    }
    free(grange);
    free(items);
    if (failed) status[0] = 7;
}

/* The kernel over a cache of ELEM rows (the contract in prefill_attention.c). */
void CAT(kv_paged_prefill_attention_,
         SFX)(const ELEM* q, int64_t qs, const ELEM* cache, const int64_t* table, int64_t nbmax,
              const int64_t* q_start, const int64_t* pos0, const int64_t* kstart, int64_t nc, int64_t window,
              ELEM* out, int64_t T, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,
              int amx, int64_t gather_bytes, int nthreads, int64_t* status) {
    CAT(pf_run_, SFX)(q, qs, cache, -1, table, nbmax, q_start, pos0, kstart, nc, window, out, T, KH, G, D, NB,
                      BS, scale, amx, gather_bytes, nthreads, status);
}

/* The kernel over a quantized cache: int8 bytes [2, KH, NB, BS, D + 2], codes of kind (kv_q8.h:
   0 int8, 1 float8 e4m3fn, 2 float8 e5m2) and a float16 scale per row; the AVX-512 path. */
void CAT(kv_paged_prefill_attention_q8_,
         SFX)(const ELEM* q, int64_t qs, const int8_t* cache, const int64_t* table, int64_t nbmax,
              const int64_t* q_start, const int64_t* pos0, const int64_t* kstart, int64_t nc, int64_t window,
              ELEM* out, int64_t T, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,
              int amx, int64_t gather_bytes, int nthreads, int64_t* status, int kind) {
    if (kind < 0 || kind > 2) {
        status[0] = 8;
        status[1] = -1;
        return;
    }
    CAT(pf_run_, SFX)(q, qs, cache, kind, table, nbmax, q_start, pos0, kstart, nc, window, out, T, KH, G, D,
                      NB, BS, scale, amx, gather_bytes, nthreads, status);
}
