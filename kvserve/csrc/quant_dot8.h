/* Integer dot products of GGUF weight blocks with int8 activations (quant_gemm.c's int8-activation
   kernels), one pair of 32-weight blocks (j, j + 1) of one weight row at a time.

   A pair's 64 weights become 64 unsigned bytes u (load_pair); dot8 multiplies them with 64 int8
   activations and sums groups of 4 products into 16 int32 lanes, so 8 lanes belong to each
   block. Which lanes, and in which order the 64 activations must be stored (the activation
   quantizer writes them that way), is the pair layout:
     natural:  bytes [w_j 0..31 | w_j+1 0..31]; lanes 0-7 block j, 8-15 block j+1.
     permuted: bytes [w_j 0..15 | w_j+1 0..15 | w_j 16..31 | w_j+1 16..31]; lanes 0-3 and 8-11
               block j, 4-7 and 12-15 block j+1 (AVX-512 Q4_0 / Q4_1: the low nibbles of both
               blocks' 32 quant bytes form one 256-bit half, the high nibbles the other, so a
               pair unpacks with one shift, one insert and one AND).
   The integer weight is q_w = u - OFF, so x . w = d_w (dot8 - OFF * sum(q_x)) (+ m sum(q_x) for
   Q4_1); the kernels fold OFF into the activation sums they precompute:
     Q4_0: u = nibble (0..15), OFF = 8 (w = d (nibble - 8));
     Q4_1: u = nibble, OFF = 0 (w = d nibble + m: the minimum multiplies sum(q_x));
     Q8_0: AVX-512 VNNI: u = q_w + 128 (XOR 0x80: exact for every int8, -128 included),
           OFF = 128; AVX2: OFF = 0, the sign trick (|q_w| u8 times q_x with q_w's sign; |q_w|
           <= 128 and |q_x| <= 127 keep maddubs' int16 pair sums below 32767, where the +128
           bias would saturate); scalar: the signed product directly, OFF = 0.
   Ranges: |q_x| <= 127, u <= 255: a lane sums 4 products (< 2^17), never overflows.
   ISAs (compile-time, as the other kernels): AVX-512 VNNI + BW (vpdpbusd: 64 multiply-adds per
   instruction), AVX2 (vpmaddubsw + vpmaddwd per 32 bytes), scalar C. */
#ifndef KV_QUANT_DOT8_H
#define KV_QUANT_DOT8_H

#include "kv_vec.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT8_ISA 2
typedef __m512i wpair;
#elif defined(__AVX2__)
#define DOT8_ISA 1
typedef struct {
    __m256i a, b; /* blocks j and j + 1, natural order */
} wpair;
#else
#define DOT8_ISA 0
typedef struct {
    int8_t v[64]; /* the integer weights themselves (OFF = 0) */
} wpair;
#endif

/* qt codes as quant_gemm.c's enum (kept equal). */
#define DOT8_Q8_0 0
#define DOT8_Q4_0 1
#define DOT8_Q4_1 2
#define DOT8_Q4_K 3
#define DOT8_Q6_K 5

/* Only Q4_0 / Q4_1 permute: a K-quant pair's two chunks are the low and high nibbles (or 2-bit
   planes) of the same bytes, so it unpacks in the natural order (quant_dot8_k.h). */
static inline int dot8_permuted(const int qt) {
    return DOT8_ISA == 2 && (qt == DOT8_Q4_0 || qt == DOT8_Q4_1);
}
static inline int dot8_offset(const int qt) {
    return qt == DOT8_Q4_0 ? 8 : (qt == DOT8_Q8_0 && DOT8_ISA == 2 ? 128 : 0);
}
/* Position in the pair's 64 activation bytes of element i (0..31) of block h (0, 1). */
static inline int dot8_pos(const int qt, const int h, const int i) {
    if (dot8_permuted(qt)) return (i >> 4) * 32 + h * 16 + (i & 15);
    return h * 32 + i;
}
/* Whether lane l (0..15) of dot8's result belongs to block j + 1. */
static inline int dot8_lane_hi(const int qt, const int l) {
    return dot8_permuted(qt) ? (l >> 2) & 1 : l >> 3;
}

/* Quants of block j (qs: its 16 nibble bytes or 32 int8) and, when two, of block j + 1
   (qs1 = qs + block bytes); never reads block j + 1 otherwise. */
static inline __attribute__((always_inline)) wpair load_pair(const int qt, const uint8_t* qs,
                                                             const uint8_t* qs1, const int two) {
#if DOT8_ISA == 2
    if (qt == DOT8_Q8_0) {
        const __m256i a = _mm256_loadu_si256((const __m256i*)qs);
        const __m256i b = two ? _mm256_loadu_si256((const __m256i*)qs1) : _mm256_set1_epi8(-128);
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), _mm512_set1_epi8(-128));
    }
    const __m128i a = _mm_loadu_si128((const __m128i*)qs);
    const __m128i b = two ? _mm_loadu_si128((const __m128i*)qs1) : _mm_setzero_si128();
    const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ab), _mm256_srli_epi16(ab, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
#elif DOT8_ISA == 1
    wpair p;
    if (qt == DOT8_Q8_0) {
        p.a = _mm256_loadu_si256((const __m256i*)qs);
        p.b = two ? _mm256_loadu_si256((const __m256i*)qs1) : _mm256_setzero_si256();
        return p;
    }
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i a = _mm_loadu_si128((const __m128i*)qs);
    const __m128i b = two ? _mm_loadu_si128((const __m128i*)qs1) : _mm_setzero_si128();
    p.a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(a, m)),
                                  _mm_and_si128(_mm_srli_epi16(a, 4), m), 1);
    p.b = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, m)),
                                  _mm_and_si128(_mm_srli_epi16(b, 4), m), 1);
    return p;
#else
    wpair p;
    for (int h = 0; h < 2; ++h) {
        const uint8_t* q = h ? qs1 : qs;
        for (int i = 0; i < 32; ++i) {
            int v = 0;
            if (!h || two) v = qt == DOT8_Q8_0 ? (int8_t)q[i] : (i < 16 ? q[i] & 15 : q[i - 16] >> 4);
            p.v[h * 32 + i] = (int8_t)v;
        }
    }
    return p;
#endif
}

/* 16 int32 lanes, lane l = sum over b < 4 of u[4 l + b] * x[4 l + b] (x: 64 int8 activations in
   the pair layout, 64-byte aligned). */
static inline __attribute__((always_inline)) v16i dot8(const int qt, const wpair w, const int8_t* x) {
#if DOT8_ISA == 2
    (void)qt;
    return (v16i)_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512((const void*)x));
#elif DOT8_ISA == 1
    const __m256i xa = _mm256_load_si256((const __m256i*)x), xb = _mm256_load_si256((const __m256i*)(x + 32));
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i pa, pb;
    if (qt == DOT8_Q8_0) {
        pa = _mm256_maddubs_epi16(_mm256_abs_epi8(w.a), _mm256_sign_epi8(xa, w.a));
        pb = _mm256_maddubs_epi16(_mm256_abs_epi8(w.b), _mm256_sign_epi8(xb, w.b));
    } else {
        pa = _mm256_maddubs_epi16(w.a, xa);
        pb = _mm256_maddubs_epi16(w.b, xb);
    }
    pa = _mm256_madd_epi16(pa, ones);
    pb = _mm256_madd_epi16(pb, ones);
    v16i r;
    memcpy(&r, &pa, 32);
    memcpy((char*)&r + 32, &pb, 32);
    return r;
#else
    (void)qt;
    v16i r;
    for (int l = 0; l < 16; ++l) {
        int s = 0;
        for (int b = 0; b < 4; ++b) s += w.v[4 * l + b] * x[4 * l + b];
        r[l] = s;
    }
    return r;
#endif
}

/* round-to-nearest-even float -> int32 of 16 lanes (the conversion instructions under the
   default rounding mode; a separate step, so no FMA contraction can fuse it with the product
   it rounds). */
static inline v16i rint16_i32(const v16 p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtps_epi32((__m512)p);
#elif defined(__AVX2__)
    __m256 lo, hi;
    memcpy(&lo, &p, 32);
    memcpy(&hi, (const char*)&p + 32, 32);
    const __m256i a = _mm256_cvtps_epi32(lo), b = _mm256_cvtps_epi32(hi);
    v16i r;
    memcpy(&r, &a, 32);
    memcpy((char*)&r + 32, &b, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; ++i) r[i] = (int32_t)lrintf(p[i]);
    return r;
#endif
}

#endif /* KV_QUANT_DOT8_H */
