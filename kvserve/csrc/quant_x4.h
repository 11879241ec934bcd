/* Q8_0 weights repacked for the int8-activation GEMV of small batches ("x4" layout; quant_gemm.c's
   act8x4 / act16x4 kernels, built from a GGUF Q8_0 weight by quant_gemm.py's pack_x4).

   Why: the GGUF block (a float16 scale, then 32 int8 quants: 34 bytes) is a poor unit for a
   64-byte vector unit. The act8 kernel of the GGUF layout spent per pair of blocks and weight
   row two unaligned loads, an insert, an XOR (the unsigned offset vpdpbusd needs), two float16
   loads, a conversion and two permutes for the scales, and four float operations on the int32
   lanes: ~12 vector operations per 64 weights, on the two 512-bit ports, so at one row it ran
   at ~22 GB/s from L2 and well below the memory's rate in a real step. Here:
   - four weight rows are interleaved per 32-block, so one 64-byte load holds block j of two
     rows, and one activation block (32 bytes, broadcast to both halves of the register by a
     load) feeds all four rows;
   - the quants are stored offset (u = q + 128, the unsigned operand of vpdpbusd), and the
     offset's term -128 sum(q_x) over each lane's 4 activations is precomputed with the
     quantized activations as int32 lanes that seed the dot product, so the integer result is
     exactly sum(q_w q_x) with no XOR and no float correction;
   - the scales of the four rows for block j sit together (8 bytes), in a separate region, so
     the quant loads are aligned full cache lines.
   Per block of four rows: 2 loads and 2 vpdpbusd, one float16 conversion and 2 permutes for
   the scales, then per row 2 conversions, 2 multiplies (the activation scale) and 2 FMAs.

   Layout of W [N, K] (nb = K / 32 blocks per row, G = ceil(N / 4) groups of four rows; rows
   past N have q = 0 and d = 0):
     quants: G * nb * 128 bytes; group g, block j, row i (0-3) of the group, element e at
             ((g nb + j) 4 + i) 32 + e, holding q + 128 (uint8);
     scales: after the quants, G * nb * 4 float16; d of row 4g + i, block j at
             ((g nb + j) 4 + i) 2.
   The same bytes as the GGUF weight when N is a multiple of 4.

   Activations (one row of K; x4_act_bytes): per plane (1, or 2 for act16) nb * 32 int8 quants in
   natural order; then per plane nb * 8 int32 seeds (lane l of block j: -128 * the sum of its
   quants 4l .. 4l + 3; unused by the AVX2 / scalar dot products, which multiply signed values
   directly); then nb float32 scales d_x. */
#ifndef KV_QUANT_X4_H
#define KV_QUANT_X4_H

#include "quant_dot8.h"

#define X4_ROWS 4 /* weight rows per group */
#define X4_MR 4   /* activation rows per tile */

/* Bytes of one quantized activation row (a multiple of 64, so every row stays aligned). */
static inline int64_t x4_act_bytes(const int64_t nb, const int planes) {
    return ((int64_t)planes * nb * 64 + nb * 4 + 63) / 64 * 64;
}

/* Block j of two weight rows (64 bytes at w: 32 of each) times one activation block (32 int8
   at x, with its 8 int32 seeds): 16 int32 lanes, lanes 0-7 the first row, 8-15 the second, lane
   l of a row = sum over b < 4 of q_w[4l + b] q_x[4l + b] (exact). */
static inline __attribute__((always_inline)) v16i x4_dot2(const uint8_t* w, const int8_t* x,
                                                          const int32_t* seed) {
#if DOT8_ISA == 2
    const __m512i xb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)x));
    const __m512i c = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)seed));
    return (v16i)_mm512_dpbusd_epi32(c, _mm512_loadu_si512((const void*)w), xb);
#elif DOT8_ISA == 1
    (void)seed; /* signed products: no offset to undo */
    const __m256i xv = _mm256_loadu_si256((const __m256i*)x), ones = _mm256_set1_epi16(1);
    const __m256i off = _mm256_set1_epi8(-128);
    const __m256i qa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)w), off);
    const __m256i qb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 32)), off);
    /* the sign trick of quant_dot8.h: |q_w| <= 128, |q_x| <= 127 keep maddubs' pair sums exact */
    const __m256i pa =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(qa), _mm256_sign_epi8(xv, qa)), ones);
    const __m256i pb =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(qb), _mm256_sign_epi8(xv, qb)), ones);
    v16i r;
    memcpy(&r, &pa, 32);
    memcpy((char*)&r + 32, &pb, 32);
    return r;
#else
    (void)seed;
    v16i r = {};
    for (int l = 0; l < 16; ++l) {
        int s = 0;
        for (int b = 0; b < 4; ++b) s += ((int)w[4 * l + b] - 128) * x[(4 * l + b) & 31];
        r[l] = s;
    }
    return r;
#endif
}

/* The float16 scales of block j of a group's four rows (8 bytes at s) as the lane scales of the
   two x4_dot2 results: a = [d_0 x 8, d_1 x 8], b = [d_2 x 8, d_3 x 8]. */
static inline __attribute__((always_inline)) void x4_scales(const uint8_t* s, v16* a, v16* b) {
#if defined(__AVX512F__) && defined(__F16C__)
    const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)s)));
    *a = (v16)_mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), f);
    *b = (v16)_mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), f);
#else
    const float d0 = fp16_to_f32(s), d1 = fp16_to_f32(s + 2), d2 = fp16_to_f32(s + 4),
                d3 = fp16_to_f32(s + 6);
    *a = (v16){d0, d0, d0, d0, d0, d0, d0, d0, d1, d1, d1, d1, d1, d1, d1, d1};
    *b = (v16){d2, d2, d2, d2, d2, d2, d2, d2, d3, d3, d3, d3, d3, d3, d3, d3};
#endif
}

/* The four row sums of a tile row's accumulators (a: rows 0-1 of the group, 8 lanes each; b: rows
   2-3), into out[0..3]. */
static inline void x4_reduce(const v16 a, const v16 b, float out[4]) {
    const v16 a1 = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    const v16 b1 = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v16 c = __builtin_shufflevector(a1, b1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    c = c + __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    c = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    for (int i = 0; i < 4; ++i) out[i] = c[4 * i];
}

/* Software prefetch distance of the x4 kernels in bytes of weights ahead (0: none); a runtime
   value so benchmarks/int8_gemv.py can tune it without rebuilding (quant_x4_set_prefetch). */
static int x4_prefetch_bytes = 12288;

#endif /* KV_QUANT_X4_H */
