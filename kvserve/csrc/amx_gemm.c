/*
 * bfloat16 linear layers for decode-sized batches on Intel AMX tiles.
 *
 * Why: a decode step's GEMMs have few rows (1-64 tokens) and must read every weight once, so
 * their floor is memory bandwidth, and oneDNN's bfloat16 matmul (AMX too) streams them well
 * below it (docs/benchmarks.md, CPU kernels: benchmarks/gemm_micro.py --dtype bfloat16). This
 * kernel streams a layout made for tile loads, one sequential stream per thread, and reuses each
 * loaded weight tile for 32 rows.
 *
 * AMX (Intel Architecture Instruction Set Extensions Programming Reference, ch. 3): eight tile
 * registers of 16 rows x 64 bytes; TDPBF16PS C, A, B adds to C (16 x 16 float32) the
 * product of A (16 rows x 32 bfloat16) and B (16 rows of 16 column pairs: the weights of
 * two consecutive input features for 16 output columns), with float32 accumulation. Linux grants
 * the tile state per process on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
 *
 * Layout: W [N, K] (K % 32 == 0; N padded to a multiple of 32 with zero rows) becomes
 * tiles [N / 32, K / 32, 2, 16, 16, 2]: for each group of 32 output columns and each 32-wide
 * slice of K, two B tiles of 1 KB (columns 0-15 and 16-31 of the group), element
 * [kp, n, e] = W[n, 32 * kc + 2 * kp + e]. A thread's groups are contiguous in memory, so it
 * reads one sequential stream.
 *
 * Kernel: each thread copies x in blocks of up to 256 rows into a buffer of its own, in tile
 * order, padded to a multiple of 16 rows (zero rows, whose outputs are dropped), so every tile is
 * full and the tile configuration never changes. Per group and 32-row chunk:
 * four accumulator tiles (2 row blocks x 2 column tiles), two A tiles, two B tiles: the eight
 * registers. Accumulators are stored to a float32 scratch and rounded to bfloat16 (nearest even,
 * as torch) with the bias added in float32.
 */
#include "kv_vec.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when this process may use the AMX tiles (asked once; harmless to repeat). */
int amx_init(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
#else
    return -1;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MB_ROWS 256 /* rows per L2-resident block of x */
/* The weight stream is read once, by tile loads the hardware prefetcher follows poorly: ask for
   the 2 KB that PF_DIST bytes ahead. */
#define PF_DIST 8192
#define PREFETCH_AHEAD(p)                                                                                    \
    do {                                                                                                     \
        const char* q_ = (const char*)(p) + PF_DIST;                                                         \
        for (int i_ = 0; i_ < 2048; i_ += 64) _mm_prefetch(q_ + i_, _MM_HINT_T0);                            \
    } while (0)

#include "amx_tiles.h"

/* One group's 32 (ncols valid) output columns for `rows` (<= 32) rows of acc, bias added. */
static inline void store_rows(const float* acc, int64_t rows, const uint16_t* bias, uint16_t* y, int64_t ldy,
                              int64_t ncols) {
    uint16_t bpad[32] = {0};
    if (bias && ncols < 32) {
        memcpy(bpad, bias, ncols * 2);
        bias = bpad;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float* a = acc + r * 32;
        uint16_t* yr = y + r * ldy;
        v16 lo = *(const v16*)a, hi = *(const v16*)(a + 16);
        if (bias) {
            lo += ld16_bf16(bias);
            hi += ld16_bf16(bias + 16);
        }
        if (ncols == 32) {
            st16_bf16(yr, lo);
            st16_bf16(yr + 16, hi);
        } else {
            uint16_t t[32];
            st16_bf16(t, lo);
            st16_bf16(t + 16, hi);
            memcpy(yr, t, ncols * 2);
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); w in the tile layout above. */
void amx_gemm_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
                   int64_t N, int64_t K, int nthreads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int64_t G = (N + 31) / 32, KC = K / 32, Mp = (M + 15) / 16 * 16;
#pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t g0 = G * tid / nth, g1 = G * (tid + 1) / nth;
        float acc[32 * 32] __attribute__((aligned(64)));
        /* Rows go in blocks of up to MB_ROWS, copied to a buffer of this thread's: the block
           stays in L2 while the thread's weight groups stream past it. The copy is in tile
           order, [16-row block][K / 32][16 rows][32]: every A tile is 1 KB contiguous (with
           x's own row stride, 16 rows of 3 KB share 4 of L1's 64 sets), and the rows past M
           are zero. */
        const int64_t mb_rows = Mp < MB_ROWS ? Mp : MB_ROWS;
        uint16_t* xl = (uint16_t*)aligned_alloc(64, (size_t)(mb_rows * K * 2));
        config_tiles();
        for (int64_t mb = 0; mb < Mp; mb += MB_ROWS) {
            const int64_t mrows = Mp - mb < MB_ROWS ? Mp - mb : MB_ROWS;
            for (int64_t r = 0; r < mrows; ++r)
                for (int64_t kc = 0; kc < KC; ++kc) {
                    uint16_t* dst = xl + (((r >> 4) * KC + kc) * 16 + (r & 15)) * 32;
                    if (mb + r < M) memcpy(dst, x + (mb + r) * K + kc * 32, 64);
                    else memset(dst, 0, 64);
                }
            /* A group's chunks after its first run on its weights in cache while memory idles:
               they fetch the next group's lines meanwhile, spread over their k-slices, into L2
               (into L1 they evicted the tiles those chunks read: slower). It helps steps of
               more than one 32-row chunk; up to 32 rows there are no later chunks. */
            const int64_t later = ((mrows + 31) / 32 - 1) * KC; /* k-slices of later chunks */
            const int64_t lines = KC * 32;                      /* 64-byte lines of one group */
            const int64_t per = later ? (lines + later - 1) / later : 0;
            for (int64_t g = g0; g < g1; ++g) {
                const uint16_t* wg = w + g * KC * 1024;
                const char* next = (const char*)(wg + KC * 1024);
                int64_t fetched = g + 1 < g1 ? 0 : lines;
                const int64_t ncols = N - g * 32 < 32 ? N - g * 32 : 32;
                const uint16_t* bg = bias ? bias + g * 32 : NULL;
                for (int64_t m = 0; m < mrows; m += 32) {
                    const uint16_t* xm = xl + (m >> 4) * KC * 512;
                    const int two = mrows - m >= 32; /* 32 rows, else the last 16 */
                    _tile_zero(0);
                    _tile_zero(1);
                    if (two) {
                        _tile_zero(2);
                        _tile_zero(3);
                    }
                    for (int64_t kc = 0; kc < KC; ++kc) {
                        const uint16_t* wk = wg + kc * 1024;
                        if (m == 0) PREFETCH_AHEAD(wk);
                        else
                            for (int64_t u = 0; u < per && fetched < lines; ++u, ++fetched)
                                _mm_prefetch(next + fetched * 64, _MM_HINT_T1);
                        _tile_loadd(6, wk, 64);
                        _tile_loadd(7, wk + 512, 64);
                        _tile_loadd(4, xm + kc * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (two) {
                            _tile_loadd(5, xm + (KC + kc) * 512, 64);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, acc, 128);
                    _tile_stored(1, acc + 16, 128);
                    if (two) {
                        _tile_stored(2, acc + 16 * 32, 128);
                        _tile_stored(3, acc + 16 * 32 + 16, 128);
                    }
                    const int64_t rows = M - mb - m < 32 ? M - mb - m : 32;
                    if (rows > 0) store_rows(acc, rows, bg, y + (mb + m) * N + g * 32, N, ncols);
                }
            }
        }
        _tile_release();
        free(xl);
    }
#else
    /* Never called: amx_init() fails on such a build, so the wrapper keeps to oneDNN. */
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
#endif
}
