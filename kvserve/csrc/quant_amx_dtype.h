/* The dtype-generic part of the AMX kernel of quant_amx.h (ELEM: storage type of x, y and the
   bias; SFX: symbol suffix): included from quant_gemm_dtype.h once per dtype, hence no include
   guard. */

#ifdef QAMX
/* Rows m0 .. m0 + mp - 1 of x (mp a multiple of 16; rows at or past M zero) as bfloat16 B tiles
   in xl: [mp / 16][K / 32][16 pairs][16 tokens][2]. Per 16 tokens and 32 features: the 16 rows
   of 32 bfloat16 (16 pairs, held as 32-bit lanes) transposed as a 16 x 16 block of lanes. */
static inline __attribute__((always_inline)) void CAT(qamx_pack_, SFX)(const ELEM* x, const int64_t M,
                                                                       const int64_t m0, const int64_t mp,
                                                                       const int64_t K, uint16_t* xl) {
    const int64_t KC = K / 32;
    for (int64_t tb = 0; tb < mp / 16; ++tb)
        for (int64_t kc = 0; kc < KC; ++kc) {
            v16 r[16];
            for (int t = 0; t < 16; ++t) {
                const int64_t m = m0 + tb * 16 + t;
                if (m >= M) {
                    r[t] = (v16){};
                } else if (sizeof(ELEM) == 4) {
                    const float* p = (const float*)(const void*)(x + m * K + kc * 32);
                    r[t] = (v16)_mm512_cvtne2ps_pbh((__m512)ld16_f32(p + 16), (__m512)ld16_f32(p));
                } else {
                    memcpy(&r[t], x + m * K + kc * 32, 64);
                }
            }
            transpose16(r);
            uint16_t* o = xl + (tb * KC + kc) * 512;
            for (int p = 0; p < 16; ++p) memcpy(o + p * 32, &r[p], 64);
        }
}

/* Accumulator tile c (features f0 .. f0 + 15 by tokens t0 .. t0 + 15, as stored in acc
   [16 features][16 tokens]) transposed and written to y (ldy = N) with the bias (float32 adds;
   only the nf < 16 valid features of a ragged last tile, and the tokens below M). */
static inline __attribute__((always_inline)) void CAT(qamx_store_, SFX)(const float* acc, const ELEM* bias,
                                                                        ELEM* y, const int64_t N,
                                                                        const int64_t f0, const int64_t t0,
                                                                        const int64_t M) {
    const int64_t nf = N - f0 < 16 ? N - f0 : 16;
    if (nf <= 0 || t0 >= M) return;
    v16 r[16];
    for (int i = 0; i < 16; ++i) r[i] = *(const v16*)(acc + i * 16);
    transpose16(r);
    v16 bv = {};
    if (bias)
        for (int64_t i = 0; i < nf; ++i) bv[i] = CAT(ld1_, SFX)(bias + f0 + i);
    const int64_t nt = M - t0 < 16 ? M - t0 : 16;
    for (int64_t t = 0; t < nt; ++t) {
        ELEM* o = y + (t0 + t) * N + f0;
        if (nf == 16) {
            CAT(st16_, SFX)(o, r[t] + bv);
        } else {
            ELEM tmp[16];
            CAT(st16_, SFX)(tmp, r[t] + bv);
            memcpy(o, tmp, (size_t)nf * sizeof(ELEM));
        }
    }
}

/* Thread tid of nth's share of y[M, N] = x[M, K] @ W^T (+ bias) on AMX tiles (quant_amx.h): the
   threads split the groups of 32 weight rows (one sequential stream each); x goes in blocks of
   QAMX_MB rows packed into xl; per block every group is dequantized once into one half of wl
   (the next group's blocks interleaved with the current group's first 32-row pass, so the
   AVX-512 dequantization overlaps the tile multiplies), then every 32 rows of x pass over it
   with four accumulators (2 feature tiles x 2 token tiles), two A and two B tiles: all eight
   tile registers. */
static inline __attribute__((always_inline)) void
CAT(qamx_gemm_, SFX)(const int qt, const int x4, const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,
                     const int64_t M, const int64_t N, const int64_t K, uint16_t* xl, uint16_t* wl,
                     const int tid, const int nth) {
    const int64_t G = (N + 31) / 32, KC = K / 32, nb = K / QK;
    const int64_t g0 = G * tid / nth, g1 = G * (tid + 1) / nth;
    if (g0 >= g1) return;
    const int64_t row_bytes = K / QK / block_chunks(qt) * block_bytes(qt);
    const int64_t G4 = (N + X4_ROWS - 1) / X4_ROWS;
    float acc[4 * 256] __attribute__((aligned(64)));
    config_tiles();
    for (int64_t mb = 0; mb < M; mb += QAMX_MB) {
        const int64_t mrows = M - mb < QAMX_MB ? M - mb : QAMX_MB, mp = (mrows + 15) / 16 * 16;
        CAT(qamx_pack_, SFX)(x, M, mb, mp, K, xl);
        qamx_dequant(qt, x4, w, row_bytes, G4, N, g0 * 32, nb, 0, 32 * nb, wl);
        for (int64_t g = g0; g < g1; ++g) {
            const int next = g + 1 < g1;
            uint16_t* cur = wl + ((g - g0) & 1) * 32 * K;
            uint16_t* nxt = wl + (((g - g0) & 1) ^ 1) * 32 * K;
            for (int64_t m = 0; m < mp; m += 32) {
                const int two = mp - m >= 32; /* 32 rows, else the last 16 */
                const uint16_t* xb = xl + (m / 16) * KC * 512;
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int64_t kc = 0; kc < KC; ++kc) {
                    const uint16_t* a = cur + kc * 1024;
                    _tile_loadd(4, a, 64);
                    _tile_loadd(5, a + 512, 64);
                    _tile_loadd(6, xb + kc * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (two) {
                        _tile_loadd(7, xb + (KC + kc) * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    if (m == 0 && next)
                        qamx_dequant(qt, x4, w, row_bytes, G4, N, (g + 1) * 32, nb, 32 * kc, 32 * kc + 32,
                                     nxt);
                }
                _tile_stored(0, acc, 64);
                _tile_stored(1, acc + 256, 64);
                if (two) {
                    _tile_stored(2, acc + 512, 64);
                    _tile_stored(3, acc + 768, 64);
                }
                for (int c = 0; c < (two ? 4 : 2); ++c)
                    CAT(qamx_store_, SFX)(acc + c * 256, bias, y, N, g * 32 + (c & 1) * 16,
                                          mb + m + (c >> 1) * 16, M);
            }
        }
    }
    _tile_release();
}
#endif

/* y = x @ W^T (+ bias) on AMX tiles: 0, -1 when a scratch buffer could not be allocated (some
   threads' columns unwritten then), -2 when the library was built without AMX (nothing done). */
#ifdef QAMX
#define QAMX_EXPORT(NAME, QT, X4)                                                                            \
    int CAT(quant_gemm_amx##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,        \
                                          int64_t M, int64_t N, int64_t K, int nthreads) {                   \
        int failed = 0;                                                                                      \
        const int64_t mb = M < QAMX_MB ? (M + 15) / 16 * 16 : QAMX_MB;                                       \
        _Pragma("omp parallel num_threads(nthreads)") {                                                      \
            uint16_t* xl = (uint16_t*)scratch(3, (size_t)(mb * K) * 2);                                      \
            uint16_t* wl = (uint16_t*)scratch(4, (size_t)(64 * K) * 2);                                      \
            if (!xl || !wl) {                                                                                \
                _Pragma("omp atomic write") failed = 1;                                                      \
            } else {                                                                                         \
                CAT(qamx_gemm_, SFX)(QT, X4, x, w, bias, y, M, N, K, xl, wl, omp_get_thread_num(),           \
                                     omp_get_num_threads());                                                 \
            }                                                                                                \
        }                                                                                                    \
        return failed ? -1 : 0;                                                                              \
    }
#else
#define QAMX_EXPORT(NAME, QT, X4)                                                                            \
    int CAT(quant_gemm_amx##NAME##_, SFX)(const ELEM* x, const uint8_t* w, const ELEM* bias, ELEM* y,        \
                                          int64_t M, int64_t N, int64_t K, int nthreads) {                   \
        (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;                    \
        return -2;                                                                                           \
    }
#endif
QAMX_EXPORT(_q8_0, QT_Q8_0, 0)
QAMX_EXPORT(_q4_0, QT_Q4_0, 0)
QAMX_EXPORT(_q4_1, QT_Q4_1, 0)
QAMX_EXPORT(_q4_k, QT_Q4_K, 0)
QAMX_EXPORT(_q5_k, QT_Q5_K, 0)
QAMX_EXPORT(_q6_k, QT_Q6_K, 0)
QAMX_EXPORT(x4_q4_1, QT_Q4_1, 1)
#undef QAMX_EXPORT
