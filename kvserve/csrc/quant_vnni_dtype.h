/* The dtype-generic part of the VNNI many-row kernel of quant_vnni.h (ELEM: storage type of x,
   y and the bias; SFX: symbol suffix): included from quant_gemm_dtype.h once per dtype, hence no
   include guard. */

#if DOT8_ISA == 2
/* One row of x quantized for the VNNI kernel into `out` (vnni_act_bytes): act8_quant_block_'s
   quants and d_x per 32-block, then the Q8_0 seed -128 sum(q_x) (int32) or the Q4_1 term
   d_x sum(q_x) (float32). */
static inline __attribute__((always_inline)) void CAT(vnni_quant_row_, SFX)(const int q41, const ELEM* x,
                                                                            const int64_t K, uint8_t* out) {
    const int64_t nb = K / QK;
    float* dx = (float*)(out + nb * QK);
    int32_t* seed = (int32_t*)(dx + nb);
    float* cx = (float*)(dx + nb);
    for (int64_t j = 0; j < nb; ++j) {
        int s, t;
        int8_t* q = (int8_t*)out + j * QK;
        dx[j] = CAT(act8_quant_block_, SFX)(1, x + j * QK, q, q, &s, &t);
        if (q41) cx[j] = dx[j] * (float)s;
        else seed[j] = -128 * s;
    }
}

/* mr (<= VN_MR) quantized rows (xa, xs bytes apart) times one panel (pq, pd, pm: quant_vnni.h):
   y[r * ldy + i] = x_r . w_i (+ b_i) for i < ncols. Per block: VN_MR x VN_NV int32 accumulators
   (seeded with the Q8_0 offset term), 8 chunks of VN_NV weight vectors each times every row's
   4 activation bytes broadcast; then per accumulator acc += float(sum) (d_w d_x) (+ m_w c). */
static inline __attribute__((always_inline)) void
CAT(vnni_kernel_, SFX)(const int q41, const int mr, const int64_t nb, const uint8_t* xa, const int64_t xs,
                       const uint8_t* pq, const float* pd, const float* pm, const ELEM* bias, ELEM* y,
                       const int64_t ldy, const int ncols) {
    __m512 acc[VN_MR][VN_NV];
#pragma GCC unroll 4
    for (int r = 0; r < VN_MR; ++r)
#pragma GCC unroll 3
        for (int v = 0; v < VN_NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const float* dx[VN_MR];
#pragma GCC unroll 4
    for (int r = 0; r < VN_MR; ++r) dx[r] = (const float*)(xa + (r < mr ? r : 0) * xs + nb * QK);
    for (int64_t j = 0; j < nb; ++j) {
        __m512i s[VN_MR][VN_NV];
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const __m512i seed =
                q41 ? _mm512_setzero_si512() : _mm512_set1_epi32(((const int32_t*)(dx[r] + nb))[j]);
#pragma GCC unroll 3
            for (int v = 0; v < VN_NV; ++v) s[r][v] = seed;
        }
        const uint8_t* wj = pq + j * 8 * VN_NV * 64;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            __m512i wv[VN_NV];
#pragma GCC unroll 3
            for (int v = 0; v < VN_NV; ++v)
                wv[v] = _mm512_load_si512((const void*)(wj + (c * VN_NV + v) * 64));
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                int32_t q4;
                memcpy(&q4, xa + r * xs + j * QK + 4 * c, 4);
                const __m512i xb = _mm512_set1_epi32(q4);
#pragma GCC unroll 3
                for (int v = 0; v < VN_NV; ++v) s[r][v] = _mm512_dpbusd_epi32(s[r][v], wv[v], xb);
            }
        }
        __m512 dw[VN_NV];
#pragma GCC unroll 3
        for (int v = 0; v < VN_NV; ++v) dw[v] = _mm512_load_ps(pd + j * VN_NR + 16 * v);
#pragma GCC unroll 4
        for (int r = 0; r < mr; ++r) {
            const __m512 d = _mm512_set1_ps(dx[r][j]);
#pragma GCC unroll 3
            for (int v = 0; v < VN_NV; ++v)
                acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_mul_ps(dw[v], d), acc[r][v]);
        }
        if (q41) {
#pragma GCC unroll 3
            for (int v = 0; v < VN_NV; ++v) dw[v] = _mm512_load_ps(pm + j * VN_NR + 16 * v);
#pragma GCC unroll 4
            for (int r = 0; r < mr; ++r) {
                const __m512 c = _mm512_set1_ps(dx[r][nb + j]);
#pragma GCC unroll 3
                for (int v = 0; v < VN_NV; ++v) acc[r][v] = _mm512_fmadd_ps(dw[v], c, acc[r][v]);
            }
        }
    }
    float bb[VN_NR] __attribute__((aligned(64))) = {0};
    if (bias)
        for (int i = 0; i < ncols; ++i) bb[i] = CAT(ld1_, SFX)(bias + i);
#pragma GCC unroll 4
    for (int r = 0; r < mr; ++r) {
        ELEM t[VN_NR];
        ELEM* o = ncols == VN_NR ? y + r * ldy : t;
#pragma GCC unroll 3
        for (int v = 0; v < VN_NV; ++v)
            CAT(st16_, SFX)(o + 16 * v, (v16)_mm512_add_ps(acc[r][v], _mm512_load_ps(bb + 16 * v)));
        if (ncols != VN_NR) memcpy(y + r * ldy, t, (size_t)ncols * sizeof(ELEM));
    }
}

/* Thread tid of nth's share of y = x @ W^T (+ bias), W a Q8_0 (q41 = 0) or Q4_1 weight in the x4
   layout: the threads quantize their share of x's rows into the shared xa, then (a barrier)
   split the panels; rows go in chunks of ~256 KB of xa, each panel repacked into the thread's
   buffer `panel` once per chunk, then every VN_MR rows of the chunk pass over it. */
static inline __attribute__((always_inline)) void
CAT(qvnni_, SFX)(const int q41, const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y, const int64_t M,
                 const int64_t N, const int64_t K, uint8_t* xa, uint8_t* panel, const int tid,
                 const int nth) {
    const int64_t nb = K / QK, xs = vnni_act_bytes(nb);
    for (int64_t r = M * tid / nth; r < M * (tid + 1) / nth; ++r)
        CAT(vnni_quant_row_, SFX)(q41, x + r * K, K, xa + r * xs);
#pragma omp barrier
    if (!panel) return;
    const int64_t G = (N + X4_ROWS - 1) / X4_ROWS, P = (N + VN_NR - 1) / VN_NR;
    float* pd = (float*)(panel + nb * 8 * VN_NV * 64);
    float* pm = pd + nb * VN_NR;
    int64_t mc = ((int64_t)(1 << 18) / xs) & ~(int64_t)(VN_MR - 1);
    if (mc < VN_MR) mc = VN_MR;
    const int64_t p_begin = P * tid / nth, p_end = P * (tid + 1) / nth;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m_end = m0 + mc < M ? m0 + mc : M;
        for (int64_t p = p_begin; p < p_end; ++p) {
            const int ncols = N - p * VN_NR < VN_NR ? (int)(N - p * VN_NR) : VN_NR;
            vnni_pack(q41, w, G, nb, p * VN_NR, ncols, panel, pd, pm);
            const ELEM* bp = bias ? bias + p * VN_NR : NULL;
            for (int64_t m = m0; m < m_end; m += VN_MR) {
                const uint8_t* xm = xa + m * xs;
                ELEM* ym = y + m * N + p * VN_NR;
                switch (m_end - m < VN_MR ? (int)(m_end - m) : VN_MR) {
                case 4: CAT(vnni_kernel_, SFX)(q41, 4, nb, xm, xs, panel, pd, pm, bp, ym, N, ncols); break;
                case 3: CAT(vnni_kernel_, SFX)(q41, 3, nb, xm, xs, panel, pd, pm, bp, ym, N, ncols); break;
                case 2: CAT(vnni_kernel_, SFX)(q41, 2, nb, xm, xs, panel, pd, pm, bp, ym, N, ncols); break;
                default: CAT(vnni_kernel_, SFX)(q41, 1, nb, xm, xs, panel, pd, pm, bp, ym, N, ncols); break;
                }
            }
        }
    }
}
#endif

/* y = x @ W^T (+ bias) on the VNNI kernel (quant_vnni.h), W the x4 bytes of a Q8_0 or Q4_1
   weight: 0, -1 when a scratch buffer could not be allocated (some panels unwritten then), -2
   when the library was built without AVX-512 VNNI (nothing done). */
#if DOT8_ISA == 2
#define QVNNI_EXPORT(NAME, Q41)                                                                              \
    int CAT(quant_gemm_vnnix4_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,    \
                                              int64_t M, int64_t N, int64_t K, int nthreads) {               \
        uint8_t* xa = (uint8_t*)scratch(0, (size_t)(M * vnni_act_bytes(K / QK)));                            \
        if (!xa) return -1;                                                                                  \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel num_threads(nthreads)") {                                                      \
            uint8_t* panel = (uint8_t*)scratch(5, (size_t)vnni_panel_bytes(K / QK));                         \
            if (!panel) { _Pragma("omp atomic write") failed = 1; }                                          \
            CAT(qvnni_, SFX)(Q41, x, w, bias, y, M, N, K, xa, panel, omp_get_thread_num(),                   \
                             omp_get_num_threads());                                                         \
        }                                                                                                    \
        return failed ? -1 : 0;                                                                              \
    }
#else
#define QVNNI_EXPORT(NAME, Q41)                                                                              \
    int CAT(quant_gemm_vnnix4_##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,    \
                                              int64_t M, int64_t N, int64_t K, int nthreads) {               \
        (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;                    \
        return -2;                                                                                           \
    }
#endif
QVNNI_EXPORT(q8_0, 0)
QVNNI_EXPORT(q4_1, 1)
#undef QVNNI_EXPORT
