/* Q8_0 and Q4_1 weights repacked for the int8-activation GEMV of small batches ("x4" layout;
   quant_gemm.c's act8x4 / act16x4 kernels, built from a GGUF weight by ops/quant.py's pack_x4;
   the Q4_1 layout and its helpers are in the second half of this file).

   Q8_0. Why: the GGUF block (a float16 scale, then 32 int8 quants: 34 bytes) is a poor unit for a
   64-byte vector unit. The act8 kernel of the GGUF layout spent per pair of blocks and weight
   row two unaligned loads, an insert, an XOR (the unsigned offset vpdpbusd needs), two float16
   loads, a conversion and two permutes for the scales, and four float operations on the int32
   lanes: ~12 vector operations per 64 weights, on the two 512-bit ports, so at one row it was
   compute-bound, well below the memory's rate in a real step. Here:
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

/* ---- Q4_1 in the x4 layout ------------------------------------------------------------------

   Why: the GGUF-layout act8 kernel unpacks each row's pair of 20-byte blocks on its own (two
   unaligned 16-byte loads, an insert, a shift and an AND, two float16 pairs converted and
   permuted per row and pair), so it streamed a decode step's Q4_1 layers far below the x4 Q8_0
   kernel's bytes per second (docs/benchmarks.md, CPU kernels). Here the unpacking and the scale
   conversion happen once per block of four rows, and all loads are of whole 64-byte lines.

   Layout of W [N, K] (nb = K / 32, G = ceil(N / 4); rows past N have quants 0, d = m = 0):
     quants: G * nb * 64 bytes; group g, block j: the 16 GGUF quant bytes of rows 4g .. 4g + 3 in
             turn (byte ((g nb + j) 4 + i) 16 + b of row 4g + i: element b in its low nibble,
             element b + 16 in its high one, as in the GGUF block);
     scales: after the quants, G * nb * 8 float16: at ((g nb + j) 8) d of rows 4g .. 4g + 3,
             then m of the same rows.
   The same bytes as the GGUF weight when N is a multiple of 4 (80 per block of four rows).
   One 64-byte load holds block j of all four rows: an AND gives elements 0-15 of each row (16
   bytes apiece, so 4 dot-product lanes per row), a shift and an AND elements 16-31, and the
   activation block's two halves broadcast to the four 128-bit lanes of a register feed all four
   rows: per block of four rows and activation row 2 vpdpbusd (the weights are unsigned 0..15:
   no offset to undo), the unpacking once for all activation rows. The minimum's term m sum(x)
   is one FMA per block with the activation sum c = d_x sum(q_x) / 4 (per lane: a row's 4 lanes
   add up to m d_x sum(q_x)).

   Activations (one row of K, x4_act_bytes): per plane nb * 32 int8 quants in natural order,
   then nb float32 d_x, then nb float32 c (d_x (sum(q) + sum(q2) / 254) / 4). */

/* Block j of a group's four rows (64 bytes at w) unpacked for x4q_dot: lo = elements 0-15 of
   rows 0-3 (16 bytes each), hi = elements 16-31. */
typedef struct {
#if DOT8_ISA == 2
    __m512i lo, hi;
#elif DOT8_ISA == 1
    __m256i lo[2], hi[2]; /* rows 0-1, rows 2-3 */
#else
    uint8_t lo[64], hi[64];
#endif
} x4q_block;

static inline __attribute__((always_inline)) x4q_block x4q_unpack(const uint8_t* w) {
    x4q_block b;
#if DOT8_ISA == 2
    const __m512i v = _mm512_loadu_si512((const void*)w), m = _mm512_set1_epi8(0x0F);
    b.lo = _mm512_and_si512(v, m);
    b.hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
#elif DOT8_ISA == 1
    const __m256i m = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * h));
        b.lo[h] = _mm256_and_si256(v, m);
        b.hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    }
#else
    for (int i = 0; i < 64; ++i) {
        b.lo[i] = w[i] & 15;
        b.hi[i] = w[i] >> 4;
    }
#endif
    return b;
}

/* An unpacked block times one activation block (32 int8 at x): 16 int32 lanes, lanes 4i .. 4i + 3
   row i's, lane 4i + l = sum over b < 4 of the products of elements 4l + b and 16 + 4l + b (exact:
   |sum| <= 8 * 15 * 128). */
static inline __attribute__((always_inline)) v16i x4q_dot(const x4q_block* b, const int8_t* x) {
#if DOT8_ISA == 2
    const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x));
    const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(x + 16)));
    return (v16i)_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), b->lo, xl), b->hi, xh);
#elif DOT8_ISA == 1
    const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)x));
    const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x + 16)));
    const __m256i ones = _mm256_set1_epi16(1);
    v16i r;
    for (int h = 0; h < 2; ++h) {
        /* u8 0..15 times s8: each int16 pair sum within 2 * 15 * 128, two of them within int16 */
        const __m256i s =
            _mm256_add_epi16(_mm256_maddubs_epi16(b->lo[h], xl), _mm256_maddubs_epi16(b->hi[h], xh));
        const __m256i p = _mm256_madd_epi16(s, ones);
        memcpy((char*)&r + 32 * h, &p, 32);
    }
    return r;
#else
    v16i r;
    for (int l = 0; l < 16; ++l) {
        int s = 0;
        for (int k = 0; k < 4; ++k) {
            const int e = 4 * (l & 3) + k; /* element of the row in this lane */
            s += b->lo[4 * l + k] * x[e] + b->hi[4 * l + k] * x[16 + e];
        }
        r[l] = s;
    }
    return r;
#endif
}

/* The float16 d and m of block j of a group's four rows (16 bytes at s) as lane vectors:
   lanes 4i .. 4i + 3 row i's. */
static inline __attribute__((always_inline)) void x4q_scales(const uint8_t* s, v16* d, v16* m) {
#if defined(__AVX512F__) && defined(__F16C__)
    const __m512 f = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)));
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    *d = (v16)_mm512_permutexvar_ps(idx, f);
    *m = (v16)_mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(4)), f);
#else
    for (int l = 0; l < 16; ++l) {
        (*d)[l] = fp16_to_f32(s + 2 * (l >> 2));
        (*m)[l] = fp16_to_f32(s + 8 + 2 * (l >> 2));
    }
#endif
}

/* The four row sums of a Q4_1 x4 accumulator (lanes 4i .. 4i + 3: row i) into out[0..3]. */
static inline void x4q_reduce(const v16 a, float out[4]) {
    v16 c = a + __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    c = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    for (int i = 0; i < 4; ++i) out[i] = c[4 * i];
}

/* Block j of row r of a Q4_1 x4 weight (w: its start, G groups of nb blocks) dequantized as
   dequant_block does the GGUF one (the panels' source when only the x4 copy is kept). */
static inline __attribute__((always_inline)) void x4q_dequant(const uint8_t* w, const int64_t G,
                                                              const int64_t nb, const int64_t r,
                                                              const int64_t j, v16* w0, v16* w1) {
    const int64_t g = r >> 2, i = r & 3;
    const uint8_t* s = w + G * nb * 64 + (g * nb + j) * 16;
    const float d = fp16_to_f32(s + 2 * i), m = fp16_to_f32(s + 8 + 2 * i);
    const v16i qs = widen_u8(w + ((g * nb + j) * 4 + i) * 16);
    *w0 = __builtin_convertvector(qs & 0xF, v16) * d + m;
    *w1 = __builtin_convertvector(qs >> 4, v16) * d + m;
}

/* Software prefetch distance of the x4 kernels in bytes of weights ahead (0: none); a runtime
   value so a benchmark can tune it without rebuilding (quant_x4_set_prefetch: ops/quant.py's
   set_x4_prefetch). */
static int x4_prefetch_bytes = 12288;

#endif /* KV_QUANT_X4_H */
