/* The activation-dtype-generic kernels of quant_gemm.c, written with ELEM (storage type of x,
   y and the bias) and SFX (symbol suffix): included once per dtype through kv_instantiate.h,
   hence no include guard. */

/* mr (<= MR) rows of x times nc (<= NC) weight rows, all K: y[r * ldy + c] = x_r . w_c (+ b_c).
   w: the nc rows, row_bytes apart. mr and nc are literals at the hot call sites. */
static inline __attribute__((always_inline)) void
CAT(qtile_, SFX)(const int qt, const int mr, const int nc, const ELEM* x, const int64_t K, const uint8_t* w,
                 const int64_t row_bytes, const ELEM* bias, ELEM* y, const int64_t ldy) {
    v16 acc[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = (v16){};
    const int64_t nb = K / QK;
    for (int64_t j = 0; j < nb; ++j) {
        const ELEM* xj = x + j * QK;
#pragma GCC unroll 4
        for (int c = 0; c < nc; ++c) {
            v16 w0, w1;
            dequant_block(qt, w + c * row_bytes, j, &w0, &w1);
            /* x straight from L1 (a memory operand of the FMA): no registers held for it */
#pragma GCC unroll 8
            for (int r = 0; r < mr; ++r) {
                acc[r][c] += CAT(ld16_, SFX)(xj + r * K) * w0;
                acc[r][c] += CAT(ld16_, SFX)(xj + r * K + 16) * w1;
            }
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nc; ++c) {
            const float b = bias ? CAT(ld1_, SFX)(bias + c) : 0.0f;
            CAT(st1_, SFX)(y + r * ldy + c, hsum16(acc[r][c]) + b);
        }
}

/* Thread tid of nth's share of y[M, N] = x[M, K] @ W^T (+ bias[N]) for W [N, K] in blocks of
   type qt (K a multiple of its block). The threads split the column tiles; rows go in chunks of ~256 KB of x
   (as float32), so a chunk stays in L2 while the thread's weight tiles pass over it. Called
   from inside the parallel region of each exported function: GCC outlines a parallel region
   before inlining, so one inside this function would see qt as a variable and keep the
   per-type branches in the inner loop (measured 4-20x slower). */
static inline __attribute__((always_inline)) void
CAT(qgemm_, SFX)(const int qt, const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y, const int64_t M,
                 const int64_t N, const int64_t K, const int tid, const int nth) {
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    const int64_t tiles = (N + NC - 1) / NC;
    int64_t mc = K > 0 ? ((int64_t)(1 << 16) / K) / MR * MR : MR;
    if (mc < MR) mc = MR;
    {
        const int64_t t_begin = tiles * tid / nth, t_end = tiles * (tid + 1) / nth;
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m_end = m0 + mc < M ? m0 + mc : M;
            for (int64_t t = t_begin; t < t_end; ++t) {
                const int64_t n = t * NC;
                const int nc = N - n < NC ? (int)(N - n) : NC;
                const uint8_t* wt = w + n * row_bytes;
                const ELEM* bt = bias ? bias + n : NULL;
                for (int64_t m = m0; m < m_end; m += MR) {
                    const int mr = m_end - m < MR ? (int)(m_end - m) : MR;
                    const ELEM* xm = x + m * K;
                    ELEM* ym = y + m * N + n;
                    if (nc == NC) {
                        switch (mr) {
                        case 8: CAT(qtile_, SFX)(qt, 8, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 7: CAT(qtile_, SFX)(qt, 7, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 6: CAT(qtile_, SFX)(qt, 6, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 5: CAT(qtile_, SFX)(qt, 5, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 4: CAT(qtile_, SFX)(qt, 4, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 3: CAT(qtile_, SFX)(qt, 3, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        case 2: CAT(qtile_, SFX)(qt, 2, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        default: CAT(qtile_, SFX)(qt, 1, NC, xm, K, wt, row_bytes, bt, ym, N); break;
                        }
                    } else { /* the last, ragged column tile */
                        CAT(qtile_, SFX)(qt, mr, nc, xm, K, wt, row_bytes, bt, ym, N);
                    }
                }
            }
        }
    }
}

/* Thread tid of nth's rows of out[i, :] = dequantized row ids[i] of W [*, K] (the embedding
   lookup; ids checked by the caller). */
static inline __attribute__((always_inline)) void CAT(qrows_, SFX)(const int qt, const uint8_t* w,
                                                                   const int64_t* ids, const int64_t n,
                                                                   const int64_t K, ELEM* out, const int tid,
                                                                   const int nth) {
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    for (int64_t i = n * tid / nth; i < n * (tid + 1) / nth; ++i) {
        const uint8_t* row = w + ids[i] * row_bytes;
        ELEM* o = out + i * K;
        for (int64_t j = 0; j < K / QK; ++j) {
            v16 w0, w1;
            dequant_block(qt, row, j, &w0, &w1);
            CAT(st16_, SFX)(o + j * QK, w0);
            CAT(st16_, SFX)(o + j * QK + 16, w1);
        }
    }
}

#define QUANT_EXPORTS(NAME, QT)                                                                              \
    void CAT(quant_gemm_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,          \
                                        int64_t M, int64_t N, int64_t K, int nthreads) {                     \
        _Pragma("omp parallel num_threads(nthreads)")                                                        \
            CAT(qgemm_, SFX)(QT, x, w, bias, y, M, N, K, omp_get_thread_num(), omp_get_num_threads());       \
    }                                                                                                        \
    void CAT(quant_rows_##NAME##_, SFX)(const uint8_t* w, const int64_t* ids, int64_t n, int64_t K,          \
                                        ELEM* out, int nthreads) {                                           \
        _Pragma("omp parallel num_threads(nthreads)")                                                        \
            CAT(qrows_, SFX)(QT, w, ids, n, K, out, omp_get_thread_num(), omp_get_num_threads());            \
    }
QUANT_EXPORTS(q8_0, QT_Q8_0)
QUANT_EXPORTS(q4_0, QT_Q4_0)
QUANT_EXPORTS(q4_1, QT_Q4_1)
QUANT_EXPORTS(q4_k, QT_Q4_K)
QUANT_EXPORTS(q5_k, QT_Q5_K)
QUANT_EXPORTS(q6_k, QT_Q6_K)
#undef QUANT_EXPORTS
