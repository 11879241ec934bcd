/*
 * Linear layers on GGUF block-quantized weights: y = x @ W^T (+ b), W dequantized in registers.
 *
 * Why: a batch-1 decode step reads every weight once, so its speed is the memory bandwidth
 * divided by the bytes per weight (float32 4, bfloat16 2, Q8_0 1.0625, Q4_0 0.5625, Q4_1 0.625).
 * The weights stay in llama.cpp's block layout (ggml-common.h of llama.cpp; the GGUF file
 * format): a row of K weights is K / 32 blocks of 32, each one float16 scale d (and, for Q4_1,
 * a float16 minimum m) followed by the quants:
 *   Q8_0 (34 bytes): d, int8 q[32];                     w[i] = d * q[i]
 *   Q4_0 (18 bytes): d, uint8 qs[16];                   w[i] = d * (nibble(i) - 8)
 *   Q4_1 (20 bytes): d, m, uint8 qs[16];                w[i] = d * nibble(i) + m
 * where nibble(i) is the low nibble of qs[i] for i < 16 and the high nibble of qs[i - 16] else.
 *
 * Algorithm: the activations stay float32 (bfloat16 ones are widened on load), so the result
 * equals dequantize-then-matmul up to float32 rounding (no int8 activations as in llama.cpp,
 * whose kernels quantize x too). Tiles of MR (<= 8) rows of x by NC = 3 output columns: per
 * block of 32 the kernel widens the quants of each column into two 16-lane float vectors
 * (w = q * d + m) and multiplies them into its MR accumulators, x read from L1 as the FMAs'
 * memory operands (24 accumulators + 2 weight vectors fit AVX-512's 32 registers); each
 * accumulator is summed horizontally at the end. The 3 weight rows of a tile (~1 KB for
 * K = 576) stay in L1 while every row tile of a ~256 KB chunk of x passes over them; the
 * threads split the output columns. GCC vector extensions (kv_vec.h): one AVX-512 register per
 * vector with -march=native on an AVX-512 CPU, two AVX2 registers otherwise, scalar code
 * elsewhere. Measured on one core of this project's AVX-512 VM (SmolLM2-135M shapes): ~10
 * GFMA/s at 1 row (the dequantization is the cost: ~6 GB/s of Q4_1 per core), ~39 GFMA/s at
 * 8-64 rows (float32 panels: ~90 at 64); MR = 4, NC = 4 gave 28 at 64 rows.
 *
 * Also: quant_rows_*, the embedding lookup (the rows of ids dequantized).
 * Measured: benchmarks/quantized.py, docs/benchmarks.md.
 */
#include "kv_vec.h"
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { QT_Q8_0 = 0, QT_Q4_0 = 1, QT_Q4_1 = 2 };
#define QK 32 /* weights per block */
#define NC 3  /* output columns per tile */
#define MR 8  /* rows of x per tile */

/* 16 bytes at p widened to 16 int32 lanes, zero- (u8) or sign-extended (s8). By intrinsics:
   GCC 12 turns the generic __builtin_convertvector of a byte vector into scalar code. */
static inline v16i widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char*)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; ++i) r[i] = p[i];
    return r;
#endif
}
static inline v16i widen_s8(const uint8_t* p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i*)p);
    const __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char*)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; ++i) r[i] = (int8_t)p[i];
    return r;
#endif
}

static inline int block_bytes(const int qt) { return qt == QT_Q8_0 ? 34 : qt == QT_Q4_0 ? 18 : 20; }

/* IEEE half -> float (the block scales). */
static inline float fp16_to_f32(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                ++e;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* The 32 weights of block `b` as two 16-lane vectors (elements 0-15, 16-31). The type is a
   compile-time constant at every call site (always_inline), so the switch folds away. */
static inline __attribute__((always_inline)) void dequant_block(const int qt, const uint8_t* b, v16* w0,
                                                                v16* w1) {
    const float d = fp16_to_f32(b);
    if (qt == QT_Q8_0) {
        *w0 = __builtin_convertvector(widen_s8(b + 2), v16) * d;
        *w1 = __builtin_convertvector(widen_s8(b + 18), v16) * d;
        return;
    }
    const v16i qs = widen_u8(b + (qt == QT_Q4_1 ? 4 : 2)), q0 = qs & 0xF, q1 = qs >> 4;
    if (qt == QT_Q4_0) {
        *w0 = __builtin_convertvector(q0 - 8, v16) * d;
        *w1 = __builtin_convertvector(q1 - 8, v16) * d;
    } else {
        const float m = fp16_to_f32(b + 2);
        *w0 = __builtin_convertvector(q0, v16) * d + m;
        *w1 = __builtin_convertvector(q1, v16) * d + m;
    }
}

#define KV_DTYPE_TEMPLATE "quant_gemm_dtype.h"
#include "kv_instantiate.h"
