/*
 * bfloat16 linear layers of many rows on AVX512-BF16 without AMX: y = x @ W^T (+ b) with
 * VDPBF16PS, the weight packed once into column panels of input-feature pairs.
 *
 * Why: on CPUs with AVX512-BF16 but no AMX tiles (Intel Xeons whose AMX is off, AMD Zen 4)
 * bfloat16 steps of many rows otherwise run oneDNN's bfloat16 matmul or our float32-widening
 * panels (gemm.c). VDPBF16PS
 * (Intel SDM vol. 2, "VDPBF16PS") adds to each of 16 float32 lanes the products of one pair of
 * bfloat16 values of each source: two multiply-adds per lane per instruction where an FMA does
 * one, so the compute-bound steps (prefill, large batches) can run at up to twice the float32
 * rate. Each product of two bfloat16 values is exact in float32 (8 + 8 significant bits); the
 * instruction adds the two products one after the other, rounding each sum to nearest even,
 * and treats denormal inputs and results as zero whatever MXCSR says.
 *
 * Layout: W [N, K] becomes panels [P, KP, 48, 2] (P = ceil(N / 48), KP = ceil(K / 2), zero
 * padded): element [p, kp, j, e] = W[48 p + j, 2 kp + e]. One input-feature pair of a panel is
 * 192 bytes, three 64-byte vectors of 16 column pairs each: the same pair order as the AMX B
 * tiles (amx_gemm.c), 48 columns wide instead of 16.
 *
 * Micro-kernel: 8 rows x 48 columns = 24 float32 accumulator vectors; per pair it loads the 3
 * weight vectors once and, per row, broadcasts the 32 bits (x[r, 2kp], x[r, 2kp + 1]) and
 * issues 3 VDPBF16PS: 27 of the 32 vector registers, 11 loads and 24 dot products per pair (the
 * float32 panels' kernel: 11 loads and 24 FMAs per input feature, half the work). x is read as
 * it is (bfloat16 rows, no widening pass); with K odd the last pair's second half is a zero read
 * apart (never the next row's first value). Sums over pairs run in order, so a row's result
 * does not depend on the other rows of the call (what speculative decoding's equality needs);
 * the bias is added in float32, then rounded once to bfloat16 (nearest even, as torch).
 *
 * Whether it pays depends on the CPU's VDPBF16PS rate. Where one issues every ~2 cycles against
 * two FMAs per cycle (the no-AMX Xeon of docs/benchmarks.md), it does about half the FMAs'
 * multiply-adds (bf16dot_speed below), so this kernel is no faster than the float32-widening
 * panels and only level with oneDNN's bfloat16 matmul (the same instruction); the figures are in
 * docs/benchmarks.md (CPU kernels, gemm_micro.py --dtype bfloat16 --kernel bf16dot panels). So
 * where the probe finds the dot product slower than FMAs, bfloat16 weights take the panels at
 * every step size (ops/gemm.py's packs_bfloat16). Where it is faster (AMD Zen 4) this kernel
 * runs every step size, one copy of each weight (model_executor/layers/linear.py): at
 * Llama-3.2-1B's layer shapes it is level with oneDNN's matmul on prefill steps and faster than
 * both oneDNN and the float32-widening panels on decode steps (docs/benchmarks_shapes.md).
 *
 * Outer loops as gemm.c: threads split the panels; rows go in chunks of ~512 KB of x (in L2
 * while every panel of the thread passes over it) of balanced <= 8-row blocks; a step of one
 * block (<= 8 rows) streams its weights GEMM_STREAM_AHEAD bytes ahead, one of more blocks
 * prefetches the thread's next panel in slices proportional to each block's rows. Steps of
 * more than one block at K > KC_ELEMS go through each panel one K slice at a time (below).
 */
#include "kv_vec.h"
#include <omp.h>

#ifndef GEMM_STREAM_AHEAD
#define GEMM_STREAM_AHEAD 4096
#endif
#define PAIR_BYTES 192 /* 48 columns x 2 bfloat16 */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 24 independent accumulators (zmm0-23, zeroed), sources zmm30/31 (zero), n iterations of 24
   instructions `op` (GNU as .irp repeats a line per register): its throughput, not its latency. */
#define REGS "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23"
#define TIMED_LOOP(op)                                                                                       \
    "vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31\n\t"                               \
    ".irp r," REGS "\n\tvpxord %%zmm\\r, %%zmm\\r, %%zmm\\r\n\t.endr\n\t"                                    \
    "1:\n\t.irp r," REGS "\n\t" op " %%zmm30, %%zmm31, %%zmm\\r\n\t.endr\n\t"                                \
    "dec %0\n\tjnz 1b\n\tvzeroupper"
#define CLOBBERS                                                                                             \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",        \
        "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",   \
        "xmm23", "xmm30", "xmm31", "cc"

static double run_loop(int dot, int64_t n) {
    const double t0 = omp_get_wtime();
    if (dot) __asm__ volatile(TIMED_LOOP("vdpbf16ps") : "+r"(n)::CLOBBERS);
    else __asm__ volatile(TIMED_LOOP("vfmadd231ps") : "+r"(n)::CLOBBERS);
    return omp_get_wtime() - t0;
}
#endif

/* VDPBF16PS's multiply-adds per second over VFMADD231PS's on the calling core (512-bit, both
   throughput-bound: 24 independent accumulators), best of 5 interleaved runs, or 0 where the
   kernel is not built. About 0.5 on a CPU that issues one VDPBF16PS per ~2 cycles against two
   FMAs per cycle (the dot product then never beats the float32 panels), about 2 on one that
   issues a VDPBF16PS per FMA slot. */
double bf16dot_speed(void) {
#if defined(__AVX512BF16__)
    const int64_t n = 20000;
    double dot = 1e30, fma = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        const double d = run_loop(1, n), f = run_loop(0, n);
        if (d < dot) dot = d;
        if (f < fma) fma = f;
    }
    return dot > 0 ? 2.0 * fma / dot : 0.0;
#else
    return 0.0;
#endif
}

/* 1 when this build has the dot-product kernel (compiled for a CPU with AVX512-BF16). */
int bf16dot_built(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline __m512 bcast_pair(const uint16_t* p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return (__m512)_mm512_set1_epi32((int)u);
}

/* mr (<= 8) rows of x (row stride ldx elements) times one panel, all KP pairs; K odd: the last
   pair holds x[r, K - 1] alone. pf / pf_len / pf_step: this block's slice of the next panel,
   prefetched pf_step bytes per pair; sp: stream this panel's own weights ahead (up to sp_end). */
static inline __attribute__((always_inline)) void
ukernel(const int mr, int64_t K, const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias,
        uint16_t* y, int64_t ldy, int ncols, const char* pf, int64_t pf_len, int64_t pf_step, const char* sp,
        const char* sp_end, const float* acc_in, float* acc_out) {
    /* acc_in: the rows' float32 sums of the earlier K blocks ([mr, 48], or NULL: start from 0);
       acc_out: store this block's sums there and return (a later K block goes on from them),
       else add the bias and round to y. Float32 stores and loads are exact, so a blocked row
       sums in the same order, to the same bits, as an unblocked one. */
    __m512 a0[8], a1[8], a2[8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        a0[r] = acc_in ? _mm512_loadu_ps(acc_in + r * 48) : _mm512_setzero_ps();
        a1[r] = acc_in ? _mm512_loadu_ps(acc_in + r * 48 + 16) : _mm512_setzero_ps();
        a2[r] = acc_in ? _mm512_loadu_ps(acc_in + r * 48 + 32) : _mm512_setzero_ps();
    }
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; ++kp) {
        if (pf && kp * pf_step < pf_len) {
            const char* a = pf + kp * pf_step;
            __builtin_prefetch(a, 0, 2);
            if (pf_step > 64) __builtin_prefetch(a + 64, 0, 2);
            if (pf_step > 128) __builtin_prefetch(a + 128, 0, 2);
        }
        if (sp) {
            const char* a = sp + kp * PAIR_BYTES;
            if (a < sp_end) {
                __builtin_prefetch(a, 0, 2);
                __builtin_prefetch(a + 64, 0, 2);
                __builtin_prefetch(a + 128, 0, 2);
            }
        }
        const uint16_t* wk = w + kp * 96;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const __m512bh b = (__m512bh)bcast_pair(x + r * ldx + 2 * kp);
            a0[r] = _mm512_dpbf16_ps(a0[r], b, w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], b, w1);
            a2[r] = _mm512_dpbf16_ps(a2[r], b, w2);
        }
    }
    if (K & 1) { /* the last pair: (x[r, K - 1], 0) against (W[n, K - 1], 0) */
        const uint16_t* wk = w + full * 96;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + 2 * full]);
            a0[r] = _mm512_dpbf16_ps(a0[r], b, w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], b, w1);
            a2[r] = _mm512_dpbf16_ps(a2[r], b, w2);
        }
    }
    if (acc_out) {
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            _mm512_storeu_ps(acc_out + r * 48, a0[r]);
            _mm512_storeu_ps(acc_out + r * 48 + 16, a1[r]);
            _mm512_storeu_ps(acc_out + r * 48 + 32, a2[r]);
        }
        return;
    }
    v16 b0 = {}, b1 = {}, b2 = {};
    if (bias) {
        uint16_t bb[48] = {0};
        memcpy(bb, bias, ncols * sizeof(uint16_t));
        b0 = ld16_bf16(bb);
        b1 = ld16_bf16(bb + 16);
        b2 = ld16_bf16(bb + 32);
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        uint16_t* yr = y + r * ldy;
        const v16 c0 = (v16)a0[r] + b0, c1 = (v16)a1[r] + b1, c2 = (v16)a2[r] + b2;
        if (ncols == 48) {
            st16_bf16(yr, c0);
            st16_bf16(yr + 16, c1);
            st16_bf16(yr + 32, c2);
        } else {
            uint16_t t[48];
            st16_bf16(t, c0);
            st16_bf16(t + 16, c1);
            st16_bf16(t + 32, c2);
            memcpy(yr, t, ncols * sizeof(uint16_t));
        }
    }
}
#endif

#if defined(__AVX512BF16__)
/* One mr-row block (mr <= 8) of x against K elements of one panel (ukernel's arguments). */
static void ublock(int mr, int64_t K, const uint16_t* xm, int64_t ldx, const uint16_t* wp, const uint16_t* bp,
                   uint16_t* ym, int64_t ldy, int ncols, const char* pf, int64_t pf_len, int64_t pf_step,
                   const char* sp, const char* sp_end, const float* acc_in, float* acc_out) {
#define UK(R)                                                                                                \
    ukernel(R, K, xm, ldx, wp, bp, ym, ldy, ncols, pf, pf_len, pf_step, sp, sp_end, acc_in, acc_out);        \
    break
    switch (mr) {
    case 8: UK(8);
    case 7: UK(7);
    case 6: UK(6);
    case 5: UK(5);
    case 4: UK(4);
    case 3: UK(3);
    case 2: UK(2);
    default: UK(1);
    }
#undef UK
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias[N]), all bfloat16; w: panels [ceil(N / 48), ceil(K / 2), 48, 2].
   Never called where bf16dot_built() is 0 (the wrapper keeps to oneDNN there).

   K blocking: where K > KC_ELEMS and a chunk has more than one 8-row block, each panel is
   taken KC_ELEMS input features at a time (a 192 KiB slice at KC_ELEMS = 2048), every block of
   the chunk passing over the slice while it is in L2, the blocks' float32 sums kept in `acc`
   between slices. Why: a whole panel at K = 8192 (Llama-3.2-1B's down projection) is 768 KiB,
   which with the blocks' x rows and the next panel's prefetch overflows a 1 MiB L2, so the
   blocks would re-read it from L3 (docs/benchmarks_shapes.md). Row chunks are then sized by
   KC_ELEMS, not K. */
#ifndef KC_ELEMS
#define KC_ELEMS 2048
#endif
#define MC_MAX ((1 << 18) / KC_ELEMS)

void bf16dot_gemm(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
                  int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__)
    const int64_t P = (N + 47) / 48, KP = (K + 1) / 2;
    const int64_t panel_bytes = KP * PAIR_BYTES;
    const int kblocked = K > KC_ELEMS && M > 8;
    int64_t mc = K > 0 ? ((int64_t)(1 << 18) / (kblocked ? KC_ELEMS : K)) & ~(int64_t)7 : 8;
    if (mc < 8) mc = 8;
#pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p_begin = P * tid / nth, p_end = P * (tid + 1) / nth;
        const char* w_end = (const char*)(w + p_end * KP * 96);
        float acc[MC_MAX * 48]; /* the chunk's sums of one panel between K blocks */
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m_end = m0 + mc < M ? m0 + mc : M, rows = m_end - m0;
            const int64_t nblk = (rows + 7) / 8, base = rows / nblk, extra = rows % nblk;
            for (int64_t p = p_begin; p < p_end; ++p) {
                const uint16_t* wp = w + p * KP * 96;
                const uint16_t* bp = bias ? bias + p * 48 : NULL;
                const int ncols = N - p * 48 < 48 ? (int)(N - p * 48) : 48;
                if (kblocked) {
                    for (int64_t k0 = 0; k0 < K; k0 += KC_ELEMS) {
                        const int64_t kc = K - k0 < KC_ELEMS ? K - k0 : KC_ELEMS;
                        const int last = k0 + kc == K;
                        const uint16_t* wk = wp + (k0 / 2) * 96;
                        /* the next slice: this panel's next K block, or the next panel's first */
                        const char* next = !last ? (const char*)(wk + (kc / 2) * 96)
                            : p + 1 < p_end      ? (const char*)(wp + KP * 96)
                                                 : NULL;
                        const int64_t next_bytes = (int64_t)KC_ELEMS / 2 * PAIR_BYTES;
                        for (int64_t m = m0, blk = 0; m < m_end; ++blk) {
                            const int mr = (int)(base + (blk < extra));
                            const char* pf = NULL;
                            int64_t pf_len = 0, pf_step = 64;
                            if (next) {
                                const int64_t off = (next_bytes * (m - m0) / rows) & ~(int64_t)63;
                                pf_len = ((next_bytes * (m + mr - m0) / rows + 63) & ~(int64_t)63) - off;
                                pf_step =
                                    ((pf_len + kc / 2 - 1) / (kc / 2 > 0 ? kc / 2 : 1) + 63) & ~(int64_t)63;
                                if (pf_step > PAIR_BYTES) pf_step = PAIR_BYTES;
                                pf = next + off;
                            }
                            const char* sp = blk == 0 && k0 == 0 && p == p_begin
                                ? (const char*)wp + GEMM_STREAM_AHEAD
                                : NULL;
                            float* a = acc + (m - m0) * 48;
                            ublock(mr, kc, x + m * K + k0, K, wk, bp, y + m * N + p * 48, N, ncols, pf,
                                   pf_len, pf_step, sp, w_end, k0 ? a : NULL, last ? NULL : a);
                            m += mr;
                        }
                    }
                    continue;
                }
                const char* next = nblk > 1 && p + 1 < p_end ? (const char*)(wp + KP * 96) : NULL;
                for (int64_t m = m0, blk = 0; m < m_end; ++blk) {
                    const int mr = (int)(base + (blk < extra));
                    /* one block: it streams its weights; more: the first panel of a chunk, which
                       nothing prefetched, streams in the first block */
                    const char* sp =
                        blk == 0 && (nblk == 1 || p == p_begin) ? (const char*)wp + GEMM_STREAM_AHEAD : NULL;
                    const char* pf = NULL;
                    int64_t pf_len = 0, pf_step = 64;
                    if (next) {
                        const int64_t off = (panel_bytes * (m - m0) / rows) & ~(int64_t)63;
                        pf_len = ((panel_bytes * (m + mr - m0) / rows + 63) & ~(int64_t)63) - off;
                        pf_step = ((pf_len + KP - 1) / KP + 63) & ~(int64_t)63;
                        if (pf_step > PAIR_BYTES) pf_step = PAIR_BYTES;
                        pf = next + off;
                    }
                    ublock(mr, K, x + m * K, K, wp, bp, y + m * N + p * 48, N, ncols, pf, pf_len, pf_step, sp,
                           w_end, NULL, NULL);
                    m += mr;
                }
            }
        }
    }
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
#endif
}
