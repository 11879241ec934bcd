/* The dtype-generic kernels of gemm.c, written with ELEM (storage type) and SFX (symbol
   suffix): included once per dtype through kv_instantiate.h, hence no include guard. */
/* mr (<= 8) rows of x times one 48-column panel, all K; while it runs, `pf_step` bytes per k of
   `pf` (up to pf_len bytes: its share of the thread's next panel) are prefetched into L2, and,
   when `sp` is set, the weight stream itself GEMM_STREAM_AHEAD bytes ahead of the k being read
   (up to `sp_end`, the end of the thread's panels). pf_step is 64, 128 or 192 (cache lines; at most one k's float32 weights). */
static inline __attribute__((always_inline)) void
CAT(ukernel_, SFX)(const int mr, int64_t K, const float* x, int64_t ldx, const ELEM* w, const ELEM* bias,
                   ELEM* y, int64_t ldy, int ncols, const char* pf, int64_t pf_len, int64_t pf_step,
                   const char* sp, const char* sp_end) {
    v16 a0[8], a1[8], a2[8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        a0[r] = (v16){};
        a1[r] = (v16){};
        a2[r] = (v16){};
    }
    for (int64_t k = 0; k < K; ++k) {
        if (pf && k * pf_step < pf_len) {
            // pf_step <= one k's weights (3 lines of float32): unrolled, no inner loop in the hot k loop
            const char* a = pf + k * pf_step;
            __builtin_prefetch(a, 0, 2);
            if (pf_step > 64) __builtin_prefetch(a + 64, 0, 2);
            if (pf_step > 128) __builtin_prefetch(a + 128, 0, 2);
        }
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
   ~1 MB of x so a chunk stays in L2 while every panel of the thread passes over it, in
   ceil(rows / 8) blocks of balanced size (12 rows: 6 + 6, not 8 + 4). With one block (decodes,
   verify chunks of <= 8 rows) the block streams its own weights GEMM_STREAM_AHEAD bytes ahead.
   With more, every block prefetches a slice of the thread's next panel proportional to its rows,
   spread over its k loop, so the memory stream runs under all the blocks' FMAs instead of only
   the first's, and the next panel's blocks compute from L2; the thread's first panel, which
   nothing prefetched, streams in its first block. */
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
            const int64_t m_end = m0 + mc < M ? m0 + mc : M, rows = m_end - m0;
            const int64_t nblk = (rows + 7) / 8, base = rows / nblk, extra = rows % nblk;
            for (int64_t p = p_begin; p < p_end; ++p) {
                const ELEM* wp = w + p * K * 48;
                const ELEM* bp = bias ? bias + p * 48 : NULL;
                const int ncols = N - p * 48 < 48 ? (int)(N - p * 48) : 48;
                const char* next =
                    GEMM_PF_NEXT && nblk > 1 && p + 1 < p_end ? (const char*)(wp + K * 48) : NULL;
                // Two blocks (9-16 rows: batch-8 verify steps) share the next panel's prefetch by
                // rows. From three blocks up the FMAs outlast the memory stream: blocks 1.. prefetch
                // one line per k of it (all of it from four float32 blocks), block 0 none.
                const int split = nblk == 2;
                const int stream = nblk == 1 || (split ? p == p_begin : (nblk - 1) * K * 64 < panel_bytes);
                for (int64_t m = m0, blk = 0; m < m_end; ++blk) {
                    const int mr = (int)(base + (blk < extra));
                    const char* sp = blk == 0 && stream ? (const char*)wp + GEMM_STREAM_AHEAD : NULL;
                    const float* xm = xf + m * K;
                    ELEM* ym = y + m * N + p * 48;
                    // this block's slice of the next panel: bytes [pf_off, pf_off + pf_len)
                    int64_t pf_off, pf_len, pf_step = 64;
                    if (split) {
                        pf_off = (panel_bytes * (m - m0) / rows) & ~(int64_t)63;
                        pf_len = ((panel_bytes * (m + mr - m0) / rows + 63) & ~(int64_t)63) - pf_off;
                        pf_step = ((pf_len + K - 1) / (K > 0 ? K : 1) + 63) & ~(int64_t)63;
                    } else {
                        pf_off = (blk - 1) * K * 64;
                        pf_len = panel_bytes - pf_off;
                    }
                    const char* pf =
                        next && (split || (blk > 0 && pf_off < panel_bytes)) ? next + pf_off : NULL;
                    switch (mr) {
                    case 8:
                        CAT(ukernel_, SFX)(8, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 7:
                        CAT(ukernel_, SFX)(7, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 6:
                        CAT(ukernel_, SFX)(6, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 5:
                        CAT(ukernel_, SFX)(5, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 4:
                        CAT(ukernel_, SFX)(4, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 3:
                        CAT(ukernel_, SFX)(3, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    case 2:
                        CAT(ukernel_, SFX)(2, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    default:
                        CAT(ukernel_, SFX)(1, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len, pf_step, sp, w_end);
                        break;
                    }
                    m += mr;
                }
            }
        }
    }
}
