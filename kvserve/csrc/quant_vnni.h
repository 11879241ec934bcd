/* Many rows on AVX-512 VNNI without AMX: Q8_0 and Q4_1 weights (their x4 copy, quant_x4.h)
   repacked per call into int8 panels whose vector lanes are output features, times int8
   activations with vpdpbusd (quant_gemm.c's "vnni" kernel; quant_vnni_dtype.h drives it).

   Why: from PANEL_ROWS rows the other kernels spend one float multiply-add per weight and row
   (the float32 panels: 16 per instruction) or, in the x4 GEMV, three float operations per
   vpdpbusd because its lanes are partial sums of four weight rows. vpdpbusd does 64
   multiply-adds per instruction at about the FMA's issue rate. Here a
   register holds 16 output features times 4 consecutive inputs, so a 32-block of 16 features
   and one activation row is 8 vpdpbusd into one int32 accumulator, then one conversion and
   two float operations (d_w d_x; Q4_1 one more FMA for the minimum's m_w d_x sum(q_x)):
   ~2.7x the float panels' multiply-adds per instruction. The weights' integer values are the
   x4 bytes themselves (Q8_0: u = q + 128, Q4_1: the nibble 0..15, both unsigned, vpdpbusd's
   first operand), the activations int8 per 32-block as the act8 kernels' (llama.cpp's Q8
   activations), so the integer sums are exact and the result is the float64 product of the
   quantized activations and the weights up to float32 rounding of the scaled block sums (the
   numerics of the act8 kernels below PANEL_ROWS rows; tests/ops/test_quant_vnni.py).

   Panel of VN_NR output features n0 .. n0 + VN_NR - 1 (features past N zero) in a per-thread
   buffer, per 32-block j:
     quants: at (j * 8 + c) * VN_NV * 64 + v * 64 + 4 f + b: input 32 j + 4 c + b of feature
             n0 + 16 v + f (c < 8 the 4-input chunk, v < VN_NV the 16-feature group, b < 4);
     then nb * VN_NR float32 d_w (block j of feature n0 + i at j * VN_NR + i), then, for Q4_1,
     as many m_w.
   Built from x4 per 16 features and pair of blocks: each feature's 2 x 32 bytes (Q4_1: its
   2 x 16 nibble bytes, split by a shift and an AND) as one 16-lane row of 4-byte chunks, and a
   16 x 16 register transpose (transpose16.h) makes the chunks of one input quad contiguous
   across the 16 features: ~8 vector operations per 64 weights, once per call per ~256 KB of
   activation rows, against 8 x rows vpdpbusd.

   Activations (vnni_act_bytes per row): nb * 32 int8 quants in natural order, nb float32 d_x,
   then nb 4-byte terms: Q8_0 the int32 seed -128 sum(q_x) (undoes the +128 of the weight bytes
   inside the integer sum), Q4_1 the float32 c = d_x sum(q_x) (times m_w: the minimum's term).
   Reference: Intel's intrinsics guide for vpdpbusd / vcvtph2ps; the block formats are llama.cpp's
   (quant_gemm.c). */
#ifndef KV_QUANT_VNNI_H
#define KV_QUANT_VNNI_H

#include "quant_x4.h"

#define VN_NV 3            /* 16-feature vectors per panel */
#define VN_NR (16 * VN_NV) /* output features per panel */
#define VN_MR 4            /* activation rows per micro-kernel tile */

/* Bytes of one quantized activation row (a multiple of 64). */
static inline int64_t vnni_act_bytes(const int64_t nb) { return (nb * 40 + 63) / 64 * 64; }

/* Bytes of one thread's panel for nb blocks (quants, d_w, m_w). */
static inline int64_t vnni_panel_bytes(const int64_t nb) { return nb * (8 * VN_NV * 64 + 2 * VN_NR * 4); }

#if DOT8_ISA == 2
/* Features n0 .. n0 + ncols - 1 of a Q8_0 (q41 = 0) or Q4_1 weight's x4 bytes w (G groups of
   four rows, nb blocks) repacked into the panel at pq (layout above; d_w at pd, m_w at pm). */
static inline __attribute__((always_inline)) void vnni_pack(const int q41, const uint8_t* w, const int64_t G,
                                                            const int64_t nb, const int64_t n0,
                                                            const int ncols, uint8_t* pq, float* pd,
                                                            float* pm) {
    const int64_t gq = q41 ? 64 : 128; /* quant bytes per group and block */
    const uint8_t* scales = w + G * nb * gq;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    /* 16-bit lane shifts: 128-bit lanes 1 and 3 take the high nibbles */
    const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                           0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    for (int v = 0; v < VN_NV; ++v) {
        const int64_t c0 = n0 + 16 * v;
        for (int64_t j = 0; j < nb; j += 2) {
            const int two = j + 1 < nb;
            v16 rows[16];
            for (int f = 0; f < 16; ++f) {
                const int64_t n = c0 + f, g = n >> 2, i = n & 3;
                __m512i r = _mm512_setzero_si512();
                if (16 * v + f < ncols) {
                    if (q41) {
                        const uint8_t* p = w + ((g * nb + j) * 4 + i) * 16;
                        const __m128i b0 = _mm_loadu_si128((const __m128i*)p);
                        const __m128i b1 =
                            two ? _mm_loadu_si128((const __m128i*)(p + 64)) : _mm_setzero_si128();
                        r = _mm512_inserti32x4(_mm512_castsi128_si512(b0), b0, 1);
                        r = _mm512_inserti32x4(_mm512_inserti32x4(r, b1, 2), b1, 3);
                        r = _mm512_and_si512(_mm512_srlv_epi16(r, shift), nib);
                    } else {
                        const uint8_t* p = w + ((g * nb + j) * 4 + i) * 32;
                        const __m256i b1 =
                            two ? _mm256_loadu_si256((const __m256i*)(p + 128)) : _mm256_setzero_si256();
                        r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                                               b1, 1);
                    }
                }
                rows[f] = (v16)r;
            }
            transpose16(rows);
            for (int c = 0; c < (two ? 16 : 8); ++c)
                _mm512_store_si512((void*)(pq + ((j * 8 + c) * VN_NV + v) * 64), (__m512i)rows[c]);
        }
        /* scales: 4 groups of four features per block (features past N: d = m = 0) */
        for (int64_t j = 0; j < nb; ++j) {
            uint16_t d[16] = {0}, m[16] = {0};
            for (int t = 0; t < 4; ++t) {
                const int64_t g = (c0 >> 2) + t;
                if (g >= G || 16 * v + 4 * t >= ncols) continue;
                const uint8_t* s = scales + (g * nb + j) * (q41 ? 16 : 8);
                memcpy(d + 4 * t, s, 8);
                if (q41) memcpy(m + 4 * t, s + 8, 8);
            }
            _mm512_store_ps(pd + j * VN_NR + 16 * v, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d)));
            if (q41)
                _mm512_store_ps(pm + j * VN_NR + 16 * v,
                                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)m)));
        }
    }
}
#endif

#endif /* KV_QUANT_VNNI_H */
