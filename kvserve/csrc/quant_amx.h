/* Block-quantized weights on AMX tiles for steps of many rows (quant_gemm.c's kernel 4; the
   dtype-generic driver is quant_amx_dtype.h).

   Why: from PANEL_ROWS rows on, the float panels (kernel 3) dequantize into float32 and multiply
   with AVX-512 FMAs (32 multiply-adds per cycle and core), while a bfloat16 model's steps run on
   AMX tiles (amx_gemm.c: one TDPBF16PS, 16 x 16 x 32 = 8,192 multiply-adds, every 16 cycles,
   512 per cycle), so the quantized paths' many-row steps fell far behind the bfloat16 path's.
   Here the weights are dequantized into bfloat16 tiles and multiplied on AMX.

   TDPBF16PS C, A, B (Intel Architecture Instruction Set Extensions Programming Reference, ch. 3):
   C[m][n] (16 x 16 float32) += sum over p < 16 of A[m][2p] B[p][n][0] + A[m][2p + 1] B[p][n][1],
   A 16 rows of 32 bfloat16, B 16 rows of 16 bfloat16 pairs, float32 accumulation (products of
   two bfloat16 are exact in float32; denormals are flushed).

   Operands: the weights are A and the activations B, so C holds 16 output features by 16 tokens
   (transposed on the way out). Then an A row is one weight row's 32 consecutive input features:
   exactly one quant block (Q8_0 / Q4_0 / Q4_1, or a 32-chunk of a K-quant superblock), in its
   natural order, which dequant_block / x4q_dequant already produce as two float32 vectors
   (elements 0-15, 16-31; Q4_1: the low and the high nibbles of the block's 16 bytes). With the
   weights as B instead (amx_gemm.c's order) a B row holds one input-feature pair of 16 different
   weight rows, a byte transpose of 16 blocks per tile.

   Values: w = d q (+ m) in float32, as the float kernels, then rounded to nearest even bfloat16
   (one VCVTNE2PS2BF16 per 32 weights): the scales are folded in, so a tile accumulates over the
   whole K with no per-block work. Activations are rounded to bfloat16 the same way (bfloat16 x
   is used as it is). Against the float64 product of the dequantized weights and x, each product
   is off by at most (2 u + u^2) |x w| (u = 2^-8, bfloat16's unit roundoff; 0 for x's part when
   x is bfloat16) and the float32 sum of K terms adds at most K 2^-24 sum |x w|; a bfloat16
   output is rounded once more (u |y|). tests/ops/test_quant_amx.py checks that bound.

   Scratch per thread: x in blocks of up to QAMX_MB rows as B tiles, [16-token block][K / 32]
   [16 pairs][16 tokens][2] (1 KB per tile; rows past M zero), and two dequantized groups of 32
   weight rows as A tiles, [K / 32][2 tiles][16 rows][32] (32 K bf16 each: 36 KB at K = 576,
   96 KB at 1,536; L1 / L2-resident). The weight stays in its own layout (GGUF, or Q4_1's x4):
   no second copy. */
#ifndef KV_QUANT_AMX_H
#define KV_QUANT_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QAMX 1
#include "amx_tiles.h"

#define QAMX_MB 256 /* rows of x per L2-resident block (amx_gemm.c's MB_ROWS) */
/* Software prefetch distance of the weight stream in bytes (the quants; x4 scales a quarter of
   it): the dequantization walks each thread's weights front to back, and the hardware
   prefetcher alone does not keep the lines ahead of it; shorter and longer distances, up to the
   group after next, did no better (docs/benchmarks.md, CPU kernels). */

#define QAMX_PF 4096

/* Block j of a Q4_1 x4 group of four rows (q: its 64 quant bytes, sc: its 16 scale bytes) as four
   A-tile rows (o, o + 32, o + 64, o + 96). A row has only 16 values, d q + m for q = 0..15, so
   they are computed once (two rows' tables, 32 bfloat16, per register) and looked up by nibble
   with VPERMW: per four rows 4 FMAs, 2 conversions, 2 widenings, 2 AND / shift pairs, 4 lane
   shuffles and 4 lookups, against ~40 operations for widening, converting and scaling each
   weight as float32 (the values are the same: one float32 FMA each, rounded to bfloat16). */
static inline __attribute__((always_inline)) void qamx_q41x4(const uint8_t* q, const uint8_t* sc,
                                                             uint16_t* o) {
    float f[8]; /* d0-d3, m0-m3: in memory, so the broadcasts below are loads */
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sc)));
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lo4 = _mm512_set1_epi16(0x0F), sel = _mm512_set1_epi16(16);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) { /* rows 2h, 2h + 1 */
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(f[2 * h]), _mm512_set1_ps(f[4 + 2 * h]));
        const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(f[2 * h + 1]), _mm512_set1_ps(f[5 + 2 * h]));
        const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(t1, t0); /* words 0-15 row 2h, 16-31 row 2h + 1 */
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + 32 * h)));
        const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_srli_epi16(v, 4);
        /* [row's low nibbles (k 0-15), its high ones (k 16-31)] per row */
        const __m512i a = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i b = _mm512_or_si512(_mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)), sel);
        _mm512_store_si512((void*)(o + 64 * h), _mm512_permutexvar_epi16(a, tab));
        _mm512_store_si512((void*)(o + 64 * h + 32), _mm512_permutexvar_epi16(b, tab));
    }
}

/* Items t0 .. t1 - 1 of weight rows n0 .. n0 + 31 dequantized into bfloat16 A-tile rows of buf
   ([K / 32][2][16][32]); rows at or past N zero. An item is one row's block j (32 weights), in
   the order of the bytes in memory, so the reads walk the group's bytes front to back (32
   interleaved row streams per group are slower from DRAM): GGUF rows (row_bytes apart):
   t = r nb + j; Q4_1 in the x4 layout of G groups of four (quant_x4.h): t = (r / 4 nb + j) 4 +
   r % 4 (t0, t1 multiples of 4). */
static inline __attribute__((always_inline)) void qamx_dequant(const int qt, const int x4, const uint8_t* w,
                                                               const int64_t row_bytes, const int64_t G,
                                                               const int64_t N, const int64_t n0,
                                                               const int64_t nb, const int64_t t0,
                                                               const int64_t t1, uint16_t* buf) {
    if (x4) {
        const uint8_t* scales = w + G * nb * 64;
        int64_t r = t0 / (4 * nb) * 4, j = t0 / 4 % nb; /* first row of the group of four, block */
        for (int64_t t = t0; t < t1; t += 4) {
            uint16_t* o = buf + ((j * 2 + (r >> 4)) * 16 + (r & 15)) * 32;
            if (n0 + r < N) {
                const int64_t u = (n0 + r) / 4 * nb + j; /* the group's block */
                _mm_prefetch((const char*)w + u * 64 + QAMX_PF, _MM_HINT_T0);
                if ((u & 3) == 0) _mm_prefetch((const char*)scales + u * 16 + QAMX_PF / 4, _MM_HINT_T0);
                qamx_q41x4(w + u * 64, scales + u * 16, o);
            } else {
                for (int i = 0; i < 4; ++i) _mm512_store_si512((void*)(o + 32 * i), _mm512_setzero_si512());
            }
            if (++j == nb) j = 0, r += 4;
        }
        return;
    }
    int64_t r = t0 / nb, j = t0 % nb; /* row, block */
    for (int64_t t = t0; t < t1; ++t) {
        __m512i v = _mm512_setzero_si512();
        if (n0 + r < N) {
            v16 a, b;
            if ((j & 1) == 0) /* (a line per two blocks: Q8_0's 34 bytes, Q4's 18-20) */
                _mm_prefetch((const char*)w + (n0 + r) * row_bytes + j * block_bytes(qt) + QAMX_PF,
                             _MM_HINT_T0);
            dequant_block(qt, w + (n0 + r) * row_bytes, j, &a, &b);
            v = (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a); /* [a (k 0-15), b (k 16-31)] */
        }
        _mm512_store_si512((void*)(buf + ((j * 2 + (r >> 4)) * 16 + (r & 15)) * 32), v);
        if (++j == nb) j = 0, ++r;
    }
}

#endif

#endif /* KV_QUANT_AMX_H */
