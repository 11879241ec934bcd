/* Quantized KV-cache rows (model_executor/layers/kv_quant.py): row = [code_0 .. code_{D-1},
   scale (float16)], value_i = code_i * scale; kind 0: int8 codes, 1: float8 e4m3fn, 2: float8
   e5m2. Reading helpers shared by the decode and prefill attention kernels. */
#ifndef KV_Q8_H
#define KV_Q8_H

#include "kv_vec.h"

#include <immintrin.h>

typedef int8_t v16c __attribute__((vector_size(16), aligned(1)));
typedef uint8_t v16uc __attribute__((vector_size(16), aligned(1)));

/* float16 bits to float32 (normal, subnormal, zero; the scales are never inf or NaN): one
   VCVTPH2PS with F16C, else the bit fields moved. */
static inline float q8_half(const int8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | ((e + 112u) << 23) | (m << 13);
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* 16 codes of `kind` as float32. float8: the code's exponent and mantissa bits placed at the
   top of a float32's exponent and mantissa fields give 2^(e - 127) (1 + m / 2^k) (or the
   subnormal m 2^-126 / 2^k for e = 0); one multiply by 2^(127 - bias) rebias it, and the sign
   bit is put back. */
/* 16 bytes widened to 32-bit lanes, sign- (int8) or zero-extended (float8): one VPMOVSXBD /
   VPMOVZXBD (two on AVX2); the generic conversions below are left to GCC elsewhere. */
static inline v16i q8_widen(const int8_t* p, int sign) {
#if defined(__AVX512F__)
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
    return (v16i)(sign ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x));
#elif defined(__AVX2__)
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
    const __m128i hi = _mm_unpackhi_epi64(x, x);
    __m256i a[2] = {sign ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x),
                    sign ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi)};
    v16i r;
    memcpy(&r, a, sizeof r);
    return r;
#else
    return sign ? __builtin_convertvector(*(const v16c*)p, v16i)
                : __builtin_convertvector(*(const v16uc*)p, v16i);
#endif
}

static inline __attribute__((always_inline)) v16 q8_ld16(const int8_t* p, int kind) {
    if (kind == 0) return __builtin_convertvector(q8_widen(p, 1), v16);
    const v16i u = q8_widen(p, 0);
    const v16i sign = (u & 0x80) << 24;
    v16 mag;
    if (kind == 1) mag = (v16)((u & 0x7F) << 20) * 0x1p120f;
    else mag = (v16)((u & 0x7F) << 21) * 0x1p112f;
    return (v16)((v16i)mag | sign);
}

static inline float q8_ld1(const int8_t* p, int kind) {
    if (kind == 0) return (float)*p;
    const uint32_t u = (uint8_t)*p, sign = (u & 0x80u) << 24;
    uint32_t bits;
    float f;
    if (kind == 1) {
        bits = (u & 0x7Fu) << 20;
        memcpy(&f, &bits, 4);
        f *= 0x1p120f;
    } else {
        bits = (u & 0x7Fu) << 21;
        memcpy(&f, &bits, 4);
        f *= 0x1p112f;
    }
    memcpy(&bits, &f, 4);
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

/* One int8 cache row from x[0 .. D-1] (float32), exactly as kv_quant.quantize builds it:
   scale = max|x| / 127 clamped to [2^-14, 65504] (float16's normal range) and rounded to
   float16 (nearest even), then code_i = round_half_even(clamp(x_i / scale, -127, 127)) against
   that stored scale; the scale's float16 bits follow the codes (little-endian). */
static inline void q8_quantize_row_i8(const float* x, int64_t D, int8_t* row) {
    float amax = 0.0f;
    for (int64_t i = 0; i < D; ++i) amax = fmaxf(amax, fabsf(x[i]));
    float s = amax / 127.0f;
    s = s < 0x1p-14f ? 0x1p-14f : s > 65504.0f ? 65504.0f : s;
    /* round the float32 to float16's 10 mantissa bits (nearest even; normal range, so the
       result is a float16 value and no exponent leaves that range) */
    uint32_t u;
    memcpy(&u, &s, 4);
    u = (u + 0xFFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    memcpy(&s, &u, 4);
    const uint16_t h = (uint16_t)((((u >> 23) - 112u) << 10) | ((u >> 13) & 0x3FFu));
    for (int64_t i = 0; i < D; ++i) {
        float y = x[i] / s;
        y = y < -127.0f ? -127.0f : y > 127.0f ? 127.0f : y;
        row[i] = (int8_t)nearbyintf(y);
    }
    memcpy(row + D, &h, 2);
}

#endif /* KV_Q8_H */
