/* The dtype-generic kernels of moe.c, written with ELEM (storage type) and SFX (symbol suffix):
   included once per dtype through kv_instantiate.h, hence no include guard. */

/* y[r, 0..16 nv) = sum_k x[r, k] w[k, 0..16 nv) for mr (<= 8) float32 rows x (row stride ldx)
   and a k-major weight block w (row stride ldw, nv <= 3 vectors of 16 columns): the outer-product
   micro-kernel of gemm.c (8 x 48 accumulators) with the weight rows read in place. pf: also
   prefetch the weight rows MOE_PF_K ahead of the k being read (the block's first pass over
   memory). */
static inline __attribute__((always_inline)) void CAT(moe_uk_, SFX)(const int mr, const int nv, int64_t K,
                                                                    const float* x, int64_t ldx,
                                                                    const ELEM* w, int64_t ldw, float* y,
                                                                    int64_t ldy, int pf) {
    v16 a0[8], a1[8], a2[8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        a0[r] = (v16){};
        a1[r] = (v16){};
        a2[r] = (v16){};
    }
    for (int64_t k = 0; k < K; ++k) {
        const ELEM* wk = w + k * ldw;
        if (pf) {
            const char* a = (const char*)(wk + MOE_PF_K * ldw);
            for (int v = 0; v < nv; ++v) __builtin_prefetch(a + v * 16 * (int64_t)sizeof(ELEM), 0, 3);
        }
        const v16 b0 = CAT(ld16_, SFX)(wk);
        const v16 b1 = nv > 1 ? CAT(ld16_, SFX)(wk + 16) : (v16){};
        const v16 b2 = nv > 2 ? CAT(ld16_, SFX)(wk + 32) : (v16){};
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const float xv = x[r * ldx + k];
            a0[r] += xv * b0;
            if (nv > 1) a1[r] += xv * b1;
            if (nv > 2) a2[r] += xv * b2;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        st16_f32(y + r * ldy, a0[r]);
        if (nv > 1) st16_f32(y + r * ldy + 16, a1[r]);
        if (nv > 2) st16_f32(y + r * ldy + 32, a2[r]);
    }
}

/* moe_uk_ for nc (<= 48) columns, mr and nv compile-time constants in each case (the
   accumulators stay in registers); a column count that is no multiple of 16 runs a scalar loop
   (no vector load past the block's last column). */
static void CAT(moe_block_, SFX)(int mr, int nc, int64_t K, const float* x, int64_t ldx, const ELEM* w,
                                 int64_t ldw, float* y, int64_t ldy, int pf) {
    if (nc % 16) {
        for (int r = 0; r < mr; ++r)
            for (int c = 0; c < nc; ++c) {
                float s = 0.f;
                for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * CAT(ld1_, SFX)(w + k * ldw + c);
                y[r * ldy + c] = s;
            }
        return;
    }
    const int nv = nc / 16;
#define MOE_CASE(M)                                                                                          \
    case M:                                                                                                  \
        if (nv == 3) CAT(moe_uk_, SFX)(M, 3, K, x, ldx, w, ldw, y, ldy, pf);                                 \
        else if (nv == 2) CAT(moe_uk_, SFX)(M, 2, K, x, ldx, w, ldw, y, ldy, pf);                            \
        else CAT(moe_uk_, SFX)(M, 1, K, x, ldx, w, ldw, y, ldy, pf);                                         \
        break;
    switch (mr) {
        MOE_CASE(8)
        MOE_CASE(7)
        MOE_CASE(6)
        MOE_CASE(5)
        MOE_CASE(4)
        MOE_CASE(3)
        MOE_CASE(2)
    default: MOE_CASE(1)
    }
#undef MOE_CASE
}

/* out [T, H] = the weighted sum of each token's k experts' SwiGLU MLPs (moe.c, steps 0-4).
   x [T, H]; experts [T, k] int64 in [0, E); weights [T, k] float32; the weights k-major:
   w13t [E, H, 2I] (gate columns then up columns), w2t [E, I, H]. Returns 0, -1 (an expert id out
   of range: nothing written) or -2 (out of memory). */
int CAT(moe_experts_, SFX)(const ELEM* x, const int64_t* experts, const float* weights, const ELEM* w13t,
                           const ELEM* w2t, ELEM* out, int64_t T, int64_t k, int64_t E, int64_t H, int64_t I,
                           int nthreads) {
    const int64_t n = T * k;
    for (int64_t i = 0; i < n; ++i)
        if (experts[i] < 0 || experts[i] >= E) return -1;
    const int64_t nb_i = (I + MOE_NB - 1) / MOE_NB, nb_h = (H + MOE_NB - 1) / MOE_NB;
    int64_t* start = calloc(E + 1, sizeof(int64_t));
    int64_t* fill = malloc((E > 0 ? E : 1) * sizeof(int64_t));
    int64_t* slot = malloc((n > 0 ? n : 1) * sizeof(int64_t));
    int64_t* token = malloc((n > 0 ? n : 1) * sizeof(int64_t));
    int64_t* active = malloc((E > 0 ? E : 1) * sizeof(int64_t));
    int owned = 0;
    float* xs = moe_scratch((size_t)(n * (2 * H + I) + 1) * sizeof(float), &owned);
    float* h = xs ? xs + n * H : NULL;
    float* ys = xs ? h + n * I : NULL;
    int rc = 0;
    if (!start || !fill || !slot || !token || !active || !xs) {
        rc = -2;
        goto done;
    }
    // counting sort of the pairs by expert (stable: token order within an expert)
    for (int64_t i = 0; i < n; ++i) start[experts[i] + 1]++;
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    memcpy(fill, start, E * sizeof(int64_t));
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = fill[experts[i]]++;
        slot[i] = s;
        token[s] = i / k;
    }
    int64_t na = 0;
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] > start[e]) active[na++] = e;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t s = 0; s < n; ++s) {
            const ELEM* src = x + token[s] * H;
            float* dst = xs + s * H;
            for (int64_t c = 0; c < H; ++c) dst[c] = CAT(ld1_, SFX)(src + c);
        }
        // gate/up: task m is column block (m mod nb_i) of active expert m / nb_i
#pragma omp for schedule(dynamic, 1)
        for (int64_t m = 0; m < na * nb_i; ++m) {
            const int64_t e = active[m / nb_i], c0 = (m % nb_i) * MOE_NB;
            const int nc = (int)(I - c0 < MOE_NB ? I - c0 : MOE_NB);
            const ELEM* wg = w13t + e * H * 2 * I + c0;
            float g[8 * MOE_NB], u[8 * MOE_NB];
            for (int64_t s0 = start[e]; s0 < start[e + 1]; s0 += 8) {
                const int mr = start[e + 1] - s0 < 8 ? (int)(start[e + 1] - s0) : 8;
                const int pf = s0 == start[e];
                CAT(moe_block_, SFX)(mr, nc, H, xs + s0 * H, H, wg, 2 * I, g, MOE_NB, pf);
                CAT(moe_block_, SFX)(mr, nc, H, xs + s0 * H, H, wg + I, 2 * I, u, MOE_NB, pf);
                for (int r = 0; r < mr; ++r) {
                    float* hr = h + (s0 + r) * I + c0;
                    const float *gr = g + r * MOE_NB, *ur = u + r * MOE_NB;
                    int c = 0;
                    for (; c + 16 <= nc; c += 16)
                        st16_f32(hr + c, silu_mul16(ld16_f32(gr + c), ld16_f32(ur + c)));
                    for (; c < nc; ++c) hr[c] = gr[c] / (1.f + expf(-gr[c])) * ur[c];
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t m = 0; m < na * nb_h; ++m) {
            const int64_t e = active[m / nb_h], c0 = (m % nb_h) * MOE_NB;
            const int nc = (int)(H - c0 < MOE_NB ? H - c0 : MOE_NB);
            const ELEM* wd = w2t + e * I * H + c0;
            for (int64_t s0 = start[e]; s0 < start[e + 1]; s0 += 8) {
                const int mr = start[e + 1] - s0 < 8 ? (int)(start[e + 1] - s0) : 8;
                CAT(moe_block_, SFX)(mr, nc, I, h + s0 * I, I, wd, H, ys + s0 * H + c0, H, s0 == start[e]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float acc[MOE_NB];
            for (int64_t c0 = 0; c0 < H; c0 += MOE_NB) {
                const int64_t nc = H - c0 < MOE_NB ? H - c0 : MOE_NB;
                for (int64_t c = 0; c < nc; ++c) acc[c] = 0.f;
                for (int64_t j = 0; j < k; ++j) {
                    const float w = weights[t * k + j];
                    const float* y = ys + slot[t * k + j] * H + c0;
                    for (int64_t c = 0; c < nc; ++c) acc[c] += w * y[c];
                }
                for (int64_t c = 0; c < nc; ++c) CAT(st1_, SFX)(out + t * H + c0 + c, acc[c]);
            }
        }
    }
done:
    free(start);
    free(fill);
    free(slot);
    free(token);
    free(active);
    if (owned) free(xs);
    return rc;
}
