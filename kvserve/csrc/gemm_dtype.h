/* The dtype-generic kernels of gemm.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. */
/* mr (<= 8) rows of x times one 48-column panel, all K; while it runs, one cache line per k of
   `pf` (up to pf_len bytes: the thread's next panel) is prefetched into L2, and, when `sp` is
   set, the weight stream itself GEMM_STREAM_AHEAD bytes ahead of the k being read (up to
   `sp_end`, the end of the thread's panels). */
static inline __attribute__((always_inline)) void
CAT(ukernel_, SFX)(const int mr, int64_t K, const float* x, int64_t ldx, const ELEM* w, const ELEM* bias,
                   ELEM* y, int64_t ldy, int ncols, const char* pf, int64_t pf_len, const char* sp,
                   const char* sp_end) {
    v16 a0[8], a1[8], a2[8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        a0[r] = (v16){};
        a1[r] = (v16){};
        a2[r] = (v16){};
    }
    for (int64_t k = 0; k < K; ++k) {
        if (pf && k * 64 < pf_len) __builtin_prefetch(pf + k * 64, 0, 2);
        if (sp) {
            const char* a = sp + k * 48 * (int64_t)sizeof(ELEM);
            if (a < sp_end) {
                for (int64_t off = 0; off < 48 * (int64_t)sizeof(ELEM); off += 64)
                    __builtin_prefetch(a + off, 0, GEMM_STREAM_HINT);
            }
        }
        const ELEM* wk = w + k * 48;
        const v16 w0 = CAT(ld16_, SFX)(wk), w1 = CAT(ld16_, SFX)(wk + 16), w2 = CAT(ld16_, SFX)(wk + 32);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const float b = x[r * ldx + k];
            a0[r] += b * w0;
            a1[r] += b * w1;
            a2[r] += b * w2;
        }
    }
    v16 b0 = {}, b1 = {}, b2 = {};
    if (bias) {
        ELEM bb[48] = {0};
        for (int j = 0; j < ncols; ++j) bb[j] = bias[j];
        b0 = CAT(ld16_, SFX)(bb);
        b1 = CAT(ld16_, SFX)(bb + 16);
        b2 = CAT(ld16_, SFX)(bb + 32);
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        ELEM* yr = y + r * ldy;
        if (ncols == 48) {
            CAT(st16_, SFX)(yr, a0[r] + b0);
            CAT(st16_, SFX)(yr + 16, a1[r] + b1);
            CAT(st16_, SFX)(yr + 32, a2[r] + b2);
        } else {
            ELEM t[48];
            CAT(st16_, SFX)(t, a0[r] + b0);
            CAT(st16_, SFX)(t + 16, a1[r] + b1);
            CAT(st16_, SFX)(t + 32, a2[r] + b2);
            memcpy(yr, t, ncols * sizeof(ELEM));
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); w: panels [ceil(N / 48), K, 48]; xf: float32 x (the
   caller's x when ELEM is float, else a scratch copy widened here). Rows go in chunks of
   ~1 MB of x so a chunk stays in L2 while every panel of the thread passes over it; the 8-row
   blocks after a panel's first one prefetch the thread's next panel, so its first block
   computes from L2 instead of waiting on memory. */
void CAT(gemm_, SFX)(const ELEM* x, float* xf, const ELEM* w, const ELEM* bias, ELEM* y, int64_t M, int64_t N,
                     int64_t K, int nthreads) {
    const int64_t P = (N + 47) / 48;
    const int64_t panel_bytes = K * 48 * (int64_t)sizeof(ELEM);
    int64_t mc = K > 0 ? ((int64_t)(1 << 18) / K) & ~(int64_t)7 : 8;
    if (mc < 8) mc = 8;
#pragma omp parallel num_threads(nthreads)
    {
        if ((const void*)xf != (const void*)x) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * K; ++i) xf[i] = CAT(ld1_, SFX)(x + i);
        }
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p_begin = P * tid / nth, p_end = P * (tid + 1) / nth;
        const char* w_end = (const char*)(w + p_end * K * 48);
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m_end = m0 + mc < M ? m0 + mc : M;
            for (int64_t p = p_begin; p < p_end; ++p) {
                const ELEM* wp = w + p * K * 48;
                const ELEM* bp = bias ? bias + p * 48 : NULL;
                const int ncols = N - p * 48 < 48 ? (int)(N - p * 48) : 48;
                const char* next = p + 1 < p_end ? (const char*)(wp + K * 48) : NULL;
                // The blocks after the first prefetch one cache line per k of the next panel:
                // too few of them (a decode or verify step of <= 8 rows has none; 9-16 rows of
                // float32 have one, a third of a panel) leave the first block waiting on memory,
                // so that block streams the weights ahead of its FMAs itself.
                const int64_t nblk = (m_end - m0 + 7) / 8;
                const int stream_first = (nblk - 1) * K * 64 < panel_bytes;
                for (int64_t m = m0, blk = 0; m < m_end; m += 8, ++blk) {
                    const char* sp = blk == 0 && stream_first ? (const char*)wp + GEMM_STREAM_AHEAD : NULL;
                    const float* xm = xf + m * K;
                    ELEM* ym = y + m * N + p * 48;
                    const int64_t pf_off = (blk - 1) * K * 64;
                    const char* pf = next && blk > 0 && pf_off < panel_bytes ? next + pf_off : NULL;
                    const int64_t pf_len = panel_bytes - pf_off;
                    switch (m_end - m < 8 ? (int)(m_end - m) : 8) {
                    case 8:
                        CAT(ukernel_, SFX)(8, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 7:
                        CAT(ukernel_, SFX)(7, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 6:
                        CAT(ukernel_, SFX)(6, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 5:
                        CAT(ukernel_, SFX)(5, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 4:
                        CAT(ukernel_, SFX)(4, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 3:
                        CAT(ukernel_, SFX)(3, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    case 2:
                        CAT(ukernel_, SFX)(2, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    default:
                        CAT(ukernel_, SFX)(1, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, sp, w_end);
                        break;
                    }
                }
            }
        }
    }
}
