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
 * The K-quants Q4_K / Q5_K / Q6_K have superblocks of 256 weights with 6-bit (Q6_K: int8)
 * scales per 32 (16) weights (dequant_kchunk below); the kernels treat every type as chunks of
 * 32 weights, a K-quant chunk decoding its sub-block scale first (extra work per chunk, so at
 * 1 row they run slower than Q4_1).
 *
 * Three kernels per type (and act16, 2b, Q8_0's / Q4_1's x4 kernels, 2c, and AMX, 4); ops/quant.py's pick_kernel
 * chooses per call (rows, mode):
 *
 * 1. quant_gemm_* ("tile", float activations): the activations stay float32 (bfloat16 ones are
 * widened on load), so the result equals dequantize-then-matmul up to float32 rounding. Tiles
 * of MR (<= 8) rows of x by NC = 3 output columns: per block of 32 the kernel widens the quants
 * of each column into two 16-lane float vectors (w = q * d + m) and multiplies them into its MR
 * accumulators, x read from L1 as the FMAs' memory operands (24 accumulators + 2 weight vectors
 * fit AVX-512's 32 registers); each accumulator is summed horizontally at the end. The 3 weight
 * rows of a tile (~1 KB for K = 576) stay in L1 while every row tile of a ~256 KB chunk of x
 * passes over them; the threads split the output columns. GCC vector extensions (kv_vec.h): one
 * AVX-512 register per vector with -march=native on an AVX-512 CPU, two AVX2 registers
 * otherwise, scalar code elsewhere. At 1 row the dequantization is the cost, so the weights
 * stream well below the memory's rate; more rows share it.
 *
 * 2. quant_gemm_act8_* (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; int8 activations, as llama.cpp's kernels): each row
 * of x is first quantized per 32-block to int8 with a float32 scale d_x (act8_quant_row in
 * quant_gemm_dtype.h; d_x = max|x| / 127, round to nearest even), stored in the pair layout of
 * quant_dot8.h with its per-lane scales and block-sum terms. Then per pair of blocks and weight
 * row: unpack 64 quants to bytes once (Q4: one shift, insert and AND), one vpdpbusd per row of
 * x (64 u8 x s8 products into 16 int32 lanes, 8 per block), and in float32 per lane
 * acc += d_w (d_x dot - c) (c = OFF d_x sum(q_x) / 8 undoes the unsigned offset of the weight
 * bytes: Q4_0 8, Q8_0 128) or, for Q4_1, acc += d_w d_x dot + m c (c = d_x sum(q_x) / 8: the
 * minimum times the activation sum). Integer products are exact, so the result is the float64
 * product of the quantized activations and the weights up to float32 rounding of the scaled
 * sums. Tiles of MR8 = 4 rows by NC8 = 4 columns (16 accumulators). AVX2: maddubs + madd
 * (Q8_0 by the sign trick instead of the offset); no AVX2: scalar C. At 1 row it outruns the
 * tile kernel, whose float dequantization is the cost there; by 8 rows the two are close.
 * Q4_K / Q6_K run it on their GGUF superblocks, a pair being two 32-weight chunks with per-lane
 * sub-block scales (Q6_K's per 16 weights: 4 lanes) and, for Q6_K, per-16 activation sums
 * (quant_dot8_k.h).
 *
 * 2b. quant_gemm_act16_* (the same types; the LM head in the int8 mode): as act8 with the rounding
 * residual of each activation quantized again on the step d_x / 254 into a second int8 plane
 * (x ~= d_x (q + q2 / 254), within d_x / 508 per element), each weight pair's unpacked bytes
 * multiplied with both planes: one int8 plane of the final hidden state flipped near-tie tokens,
 * two keep the float result to ~2^-16 of a block's largest value at about act8's speed when the
 * weights stream from memory, faster than the tile kernel.
 *
 * 2c. quant_gemm_act8x4_{q8_0,q4_1}_* / quant_gemm_act16x4_{q8_0,q4_1}_* (Q8_0 and Q4_1 in the
 * int8 mode, below the panel rows): act8 / act16 on the weight repacked at load into the x4
 * layout of quant_x4.h (four rows interleaved per block, scales apart). Q8_0: quants offset to
 * unsigned, the activations quantized with int32 seeds that cancel the offset inside vpdpbusd:
 * per block of four rows two aligned 64-byte loads and two vpdpbusd, then per row two
 * conversions, multiplies and FMAs (the GGUF layout's act8 needed about twice the vector
 * operations per weight). Q4_1: one 64-byte load holds the 16 nibble bytes of each of the four
 * rows; an AND and a shift + AND split it into elements 0-15 and 16-31 of every row (once for
 * all activation rows), each times the matching activation half broadcast to the four 128-bit
 * lanes: two vpdpbusd per block, row and activation row, then one conversion, a multiply and
 * two FMAs (d_w d_x dot, and the minimum's m_w d_x sum(q_x) / 4 per lane). The threads split
 * the groups of four rows. Same values as act8 / act16 up to float32 rounding (the integer dot
 * products are exact in both). A Q4_1 GEMM weight keeps only this copy (ops/quant.py's
 * prepare): quant_gemm_panelx4_q4_1_* runs the panels of 3. on it.
 *
 * 3. quant_gemm_panel_* (every type, float activations, for many rows): per 48 output columns
 * the weights are dequantized once into a float32 panel [K, 48] in a per-thread buffer (16 x 16
 * register transposes turn dequantized rows into panel rows) and an 8 x 48 outer-product
 * micro-kernel (as gemm.c's) runs every 8 rows of x over it; rows in chunks of ~256 KB of x,
 * the panel re-dequantized per chunk. At many rows it comes close to float32 gemm.c's speed,
 * well ahead of the tile and act8 kernels.
 *
 * 4. quant_gemm_amx_* / quant_gemm_amxx4_q4_1_* (every type; the int8 mode on AMX CPUs, from
 * ops/quant.py's AMX_ROWS): the weights dequantized into bfloat16 AMX tiles and multiplied with
 * TDPBF16PS, float32 sums (quant_amx.h: layout, tolerance).
 *
 * 5. quant_gemm_vnnix4_{q8_0,q4_1}_* (the int8 mode where the kernels have AVX-512 VNNI, from
 * ops/quant.py's VNNI_ROWS; AMX comes first where enabled): the x4 copy repacked per call into
 * int8 panels whose 16 lanes are output features and int8 activations per 32-block, summed
 * exactly with vpdpbusd (64 multiply-adds per instruction) and scaled once per block
 * (quant_vnni.h: layout, cost).
 *
 * Also: quant_rows_*, the embedding lookup (the rows of ids dequantized).
 * The kernels' speed: benchmarks/quantized.py (--kernels, --layer-kernels), docs/benchmarks.md
 * (CPU kernels).
 */
#include "kv_vec.h"
#include "quant_dot8.h"
#include "transpose16.h"
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { QT_Q8_0 = 0, QT_Q4_0 = 1, QT_Q4_1 = 2, QT_Q4_K = 3, QT_Q5_K = 4, QT_Q6_K = 5 };
#define QK 32 /* weights per chunk: the unit the kernels dequantize (a block, or 1/8 of a K-quant one) */
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

static inline int block_bytes(const int qt) {
    switch (qt) {
    case QT_Q8_0: return 34;
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}
/* 32-weight chunks per block: K-quants have superblocks of 256. */
static inline int block_chunks(const int qt) { return qt >= QT_Q4_K ? 8 : 1; }

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

/* Scale and minimum (6 bits each) of sub-block j of a Q4_K / Q5_K superblock: ggml packs the
   8 pairs into 12 bytes, the low 6 bits of bytes 0-7 for j < 4, the rest split over nibbles of
   bytes 8-11 and the top 2 bits of bytes 0-7. */
static inline void scale_min_k4(const int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Where the codes of chunk s (0-7) of a Q4_K / Q5_K superblock b sit: 32 bytes whose low (s
   even) or high (s odd) nibbles they are (layout: dequant_kchunk). */
static inline const uint8_t* k4_codes(const int qt, const uint8_t* b, const int s) {
    return b + (qt == QT_Q5_K ? 48 : 16) + 32 * (s >> 1);
}
/* Where chunk s (0-7) of a Q6_K superblock b sits: its low 4 bits are (ql[l] >> sl) & 0xF and its
   high 2 bits (qh[l] >> sh) & 3 (l = 0..31), its two int8 sub-scales sc[0] (weights 0-15) and
   sc[1] (16-31) (layout: dequant_kchunk). */
static inline void q6k_chunk(const uint8_t* b, const int s, const uint8_t** ql, const uint8_t** qh,
                             const int8_t** sc, int* sl, int* sh) {
    const int h = s >> 2, t = s & 3;
    *ql = b + 64 * h + 32 * (t & 1);
    *qh = b + 128 + 32 * h;
    *sc = (const int8_t*)(b + 192 + 8 * h + 2 * t);
    *sl = t >= 2 ? 4 : 0;
    *sh = 2 * t;
}

/* The K-quant chunk s (0-7: weights 32 s .. 32 s + 31) of superblock b (ggml-common.h):
   Q4_K (144 bytes): d, dmin, scales[12], qs[128]; chunks 2i / 2i + 1 are the low / high nibbles
     of qs[32 i .. 32 i + 31]; w = d * sc_s * q - dmin * m_s.
   Q5_K (176 bytes): as Q4_K with qh[32] after scales: bit s of qh[l] adds 16 to q.
   Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], d (last); per half h = s / 4 (128
     weights) and quarter t = s % 4: q = (ql[64 h + 32 (t & 1) + l] >> 4 (t >= 2)) & 0xF
     | ((qh[32 h + l] >> 2 t) & 3) << 4, w = d * scales[8 h + 2 t + l / 16] * (q - 32). */
static inline __attribute__((always_inline)) void dequant_kchunk(const int qt, const uint8_t* b, const int s,
                                                                 v16* w0, v16* w1) {
    if (qt == QT_Q6_K) {
        const float d = fp16_to_f32(b + 208);
        const uint8_t *ql, *qh;
        const int8_t* sc;
        int sl, sh;
        q6k_chunk(b, s, &ql, &qh, &sc, &sl, &sh);
        const v16i q0 = ((widen_u8(ql) >> sl) & 0xF) | (((widen_u8(qh) >> sh) & 3) << 4);
        const v16i q1 = ((widen_u8(ql + 16) >> sl) & 0xF) | (((widen_u8(qh + 16) >> sh) & 3) << 4);
        *w0 = __builtin_convertvector(q0 - 32, v16) * (d * sc[0]);
        *w1 = __builtin_convertvector(q1 - 32, v16) * (d * sc[1]);
        return;
    }
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
    int sc, m;
    scale_min_k4(s, b + 4, &sc, &m);
    const float ds = d * sc, dm = dmin * m;
    const uint8_t* qs = k4_codes(qt, b, s);
    const int shift = (s & 1) * 4;
    v16i q0 = (widen_u8(qs) >> shift) & 0xF, q1 = (widen_u8(qs + 16) >> shift) & 0xF;
    if (qt == QT_Q5_K) {
        q0 |= ((widen_u8(b + 16) >> s) & 1) << 4;
        q1 |= ((widen_u8(b + 32) >> s) & 1) << 4;
    }
    *w0 = __builtin_convertvector(q0, v16) * ds - dm;
    *w1 = __builtin_convertvector(q1, v16) * ds - dm;
}

/* The 32 weights of chunk j of a row (blocks of type qt from `row`) as two 16-lane vectors
   (elements 0-15, 16-31). The type is a compile-time constant at every call site
   (always_inline), so the switches fold away. */
static inline __attribute__((always_inline)) void dequant_block(const int qt, const uint8_t* row,
                                                                const int64_t j, v16* w0, v16* w1) {
    if (qt >= QT_Q4_K) {
        dequant_kchunk(qt, row + (j >> 3) * block_bytes(qt), (int)(j & 7), w0, w1);
        return;
    }
    const uint8_t* b = row + j * block_bytes(qt);
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

/* int8-activation kernels (quant_dot8.h): tiles of MR8 rows by NC8 columns. */
#define MR8 4
#define NC8 4
/* Software prefetch of the weight stream of the 1-row kernels (tile, act8): a decode step's
   weights come from L3 or DRAM (96 MB per step for the default model's Q4_1 file), and the
   hardware prefetcher alone holds a 1-row act8 GEMV well below its speed from L2; asking for
   the tile ~PF_BYTES ahead (into L1) closes much of that gap (docs/benchmarks.md, CPU kernels).
   A thread's column tiles are contiguous rows, so "ahead" is a plain address offset. */
#ifndef PF_BYTES
#define PF_BYTES 12288
#endif
/* Tiles of tile_bytes each that make up PF_BYTES (at least one; PF_BYTES = 0: no prefetch). */
static inline int64_t prefetch_tiles(const int64_t tile_bytes) {
    if (PF_BYTES <= 0) return INT64_MAX;
    const int64_t t = tile_bytes > 0 ? PF_BYTES / tile_bytes : 1;
    return t > 0 ? t : 1;
}
/* Prefetch the tile `ahead` tiles past wt when the thread has that many left (`left`, wt's
   included). */
static inline void prefetch_tile(const uint8_t* wt, const int64_t tile_bytes, const int64_t ahead,
                                 const int64_t left) {
    if (ahead >= left) return;
    const uint8_t* p = wt + ahead * tile_bytes;
    for (int64_t o = 0; o < tile_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}
#define PW 48 /* panel width of the large-batch path (output columns per dequantized panel) */

/* Bytes per row of the quantized activations: per pair of 32-blocks 64 int8 quants per plane, then
   (after all quants) 16 float lanes of d_x and 16 of the block-sum term (quant_gemm_dtype.h's
   act8_quant_row); a multiple of 64, so every row's quants stay 64-byte aligned. */
static inline int64_t act8_row_bytes(const int64_t K, const int planes) {
    return (K / QK + 1) / 2 * (64 * planes + 128);
}

/* A 64-byte aligned scratch buffer of at least `bytes`, one per calling thread and slot (0: the
   quantized activations, 1: a thread's dequantized panel, 2: float32 copies of bfloat16 x, 3 and
   4: the AMX kernel's B tiles of x and dequantized A tiles, 5: a thread's VNNI int8 panel),
   kept between calls (OpenMP's threads persist) so a call does not page-fault a fresh mmap;
   NULL when out of memory. */
static void* scratch(const int slot, const size_t bytes) {
    static __thread void* buf[6];
    static __thread size_t cap[6];
    if (cap[slot] < bytes || !buf[slot]) { /* (0 rows: still a buffer, so NULL means no memory) */
        free(buf[slot]);
        const size_t n = (bytes + 64) / 64 * 64;
        buf[slot] = aligned_alloc(64, n);
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

static inline v16 vabs16(const v16 x) { return (v16)((v16i)x & 0x7fffffff); }
/* Lanes of `hi` from b, the others from a (scalars broadcast). */
static inline v16 select16(const v16i hi, const float a, const float b) {
    return (v16)((((v16i)((v16){} + a)) & ~hi) | (((v16i)((v16){} + b)) & hi));
}

/* The scales d (and Q4_1's minima m) of blocks b and b + bb (0 for a missing second block) as
   lane vectors of the pair layout (hi: the second block's lanes). With F16C and AVX-512 the four
   halves convert in one instruction and two lane permutes spread them (the bytes after Q4_0's /
   Q8_0's d are quants, read but unused); scalar conversions and blends elsewhere. */
static inline __attribute__((always_inline)) void pair_scales(const int qt, const uint8_t* b,
                                                              const int64_t bb, const int two, const v16i hi,
                                                              v16* dw, v16* mw) {
#if defined(__AVX512F__) && defined(__F16C__)
    (void)qt;
    uint32_t lo = 0, up = 0;
    memcpy(&lo, b, 4);
    if (two) memcpy(&up, b + bb, 4);
    const __m128 f = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)lo), (int)up, 1)); /* d0 m0 d1 m1 */
    const __m512i idx = (__m512i)(hi & 2);
    *dw = (v16)_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
    *mw = (v16)_mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(1)), _mm512_castps128_ps512(f));
#else
    *dw = select16(hi, fp16_to_f32(b), two ? fp16_to_f32(b + bb) : 0.0f);
    *mw = qt == QT_Q4_1 ? select16(hi, fp16_to_f32(b + 2), two ? fp16_to_f32(b + bb + 2) : 0.0f) : (v16){};
#endif
}

#include "quant_dot8_k.h"
#include "quant_x4.h"
#include "quant_vnni.h"
#include "quant_amx.h"

#define KV_DTYPE_TEMPLATE "quant_gemm_dtype.h"
#include "kv_instantiate.h"

/* 1 when the AMX kernels (quant_amx.h) were built (the CPU may still refuse the tiles: the caller
   asks amx_gemm.c's amx_init first), else 0. */
int quant_amx_built(void) {
#ifdef QAMX
    return 1;
#else
    return 0;
#endif
}

/* Which int8 dot product the act8 kernels compiled to: 2 AVX-512 VNNI, 1 AVX2, 0 scalar. */
int quant_act8_isa(void) { return DOT8_ISA; }

/* The x4 kernels' software prefetch distance in bytes of weights ahead (0: none; negative
   values count as 0); returns the previous value. For benchmarks: not thread-safe against a
   running kernel. */
int quant_x4_set_prefetch(int bytes) {
    const int old = x4_prefetch_bytes;
    x4_prefetch_bytes = bytes > 0 ? bytes : 0;
    return old;
}

/* Reads `bytes` at p (a multiple of 64 is read fully; a tail under 64 is skipped) with 64-byte
   loads on nthreads threads, each a contiguous share, and returns an XOR of what it read (so the
   loads cannot be dropped): the memory-bandwidth ceiling a GEMV over the same bytes could reach
   (ops/quant.py's stream_read). prefetch: bytes ahead to prefetch in software (0: the hardware
   prefetcher alone). */
uint64_t quant_stream_read(const uint8_t* p, int64_t bytes, int nthreads, int64_t prefetch) {
    const int64_t lines = bytes / 64;
    uint64_t result = 0;
#pragma omp parallel num_threads(nthreads) reduction(^ : result)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t b = lines * tid / nth, e = lines * (tid + 1) / nth;
        v16i a0 = {}, a1 = {};
        int64_t i = b;
        for (; i + 1 < e; i += 2) {
            if (prefetch > 0) {
                __builtin_prefetch(p + i * 64 + prefetch, 0, 3);
                __builtin_prefetch(p + i * 64 + 64 + prefetch, 0, 3);
            }
            v16i v0, v1;
            memcpy(&v0, p + i * 64, 64);
            memcpy(&v1, p + i * 64 + 64, 64);
            a0 ^= v0;
            a1 ^= v1;
        }
        if (i < e) {
            v16i v0;
            memcpy(&v0, p + i * 64, 64);
            a0 ^= v0;
        }
        a0 ^= a1;
        uint64_t r = 0;
        for (int l = 0; l < 16; ++l) r ^= (uint64_t)(uint32_t)a0[l] << (l & 1 ? 32 : 0);
        result ^= r;
    }
    return result;
}
