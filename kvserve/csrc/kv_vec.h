/* Vector helpers shared by every kernel family.

   16-lane float vectors by GCC vector extensions: one AVX-512 register with -march=native on
   an AVX-512 CPU, two AVX2 registers otherwise (the same source builds for both). Horizontal
   sum, lane-wise max, a vectorised exp, and bfloat16 <-> float32 conversion: bfloat16 is the
   top half of a float32, so widening is a 16-bit shift and narrowing rounds to nearest even,
   as torch does. CAT(a, b) pastes a symbol and the dtype suffix SFX (kv_instantiate.h). */
#ifndef KV_VEC_H
#define KV_VEC_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The 64-byte vectors below are passed by value only between static inline helpers, never
   across a library boundary, so GCC's note that their ABI differs without AVX-512 does not
   apply (it fires on AVX2-only builds). */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));

static inline float hsum16(v16 v) {
    v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

static inline v16 vmax(v16 a, v16 b) {
    v16i m = a > b;
    return (v16)(((v16i)a & m) | ((v16i)b & ~m));
}

/* The largest of v's 16 lanes. */
static inline float hmax16(v16 v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* exp(x) for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor in r, times 2^n
   (relative error ~1e-7). */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){} - 87.0f;
    x = vmax(x, lo);
    const v16 magic = (v16){} + 12582912.0f; /* 1.5 * 2^23: round to nearest */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693145751953125f; /* ln2 split hi/lo */
    r = r - n * 1.428606765330187045e-06f;
    v16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)e;
}

/* Element access for the two storage dtypes (SFX f32 / bf16). */
static inline v16 ld16_f32(const float* p) { return *(const v16*)p; }
static inline void st16_f32(float* p, v16 x) { *(v16*)p = x; }
static inline float ld1_f32(const float* p) { return *p; }
static inline void st1_f32(float* p, float x) { *p = x; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* One VPMOVZXWD with its load folded in: GCC lowers the generic widening below to two 128-bit
   halves and an insert (4 instructions), which left RMSNorm and SiLU compute-bound. */
static inline v16 ld16_bf16(const uint16_t* p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
#else
static inline v16 ld16_bf16(const uint16_t* p) {
    return (v16)(__builtin_convertvector(*(const v16h*)p, v16u) << 16);
}
#endif
#if defined(__AVX512BF16__)
/* One VCVTNEPS2BF16 (round to nearest even, as the shifts below) instead of five integer
   ops and a narrowing: these conversions were ~1/3 of the SiLU and attention-output loops.
   Unlike the integer version it keeps NaNs NaN, and it flushes float32 denormals (|x| <
   1.2e-38) to zero. */
static inline v16h cvt16_bf16(v16 x) { return (v16h)_mm512_cvtneps_pbh((__m512)x); }
#else
static inline v16h cvt16_bf16(v16 x) {
    v16u u = (v16u)x;
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return __builtin_convertvector(u, v16h);
}
#endif
static inline void st16_bf16(uint16_t* p, v16 x) { *(v16h*)p = cvt16_bf16(x); }
static inline float ld1_bf16(const uint16_t* p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void st1_bf16(uint16_t* p, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    *p = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
/* Round a float32 to the nearest bfloat16 value, kept as float32 (bf16 arithmetic emulation). */
static inline v16 round16_bf16(v16 x) {
    const v16h h = cvt16_bf16(x);
    return ld16_bf16((const uint16_t*)&h);
}
static inline v16 round16_f32(v16 x) { return x; }

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#endif /* KV_VEC_H */
