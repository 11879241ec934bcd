/*
 * Optional native (C, OpenMP) decode attention reading K/V in place from the paged cache.
 *
 * The pure-torch decode path gathers every sequence's K/V blocks into a padded tensor and then
 * runs scaled_dot_product_attention: the cache is read once, written once and read again.
 * On CPU that path is memory-bound; this kernel reads each K/V row exactly once, straight from
 * its block, for all query heads that share it (GQA).
 *
 * The fast path (head_dim % 16 == 0, up to 16 query heads per KV head) uses GCC vector
 * extensions (16 floats: AVX-512 with -march=native, 2 x AVX2 otherwise): queries kept in
 * registers, one horizontal sum per (key, query head), a vectorised exp (degree-6 polynomial
 * after range reduction, relative error ~1e-7), value accumulators in registers. Cache rows are
 * reached through a (block, offset) cursor, with the row two blocks ahead prefetched; for
 * bfloat16 on CPUs with AVX512-BF16 the q.k products use vdpbf16ps (exact bf16 products,
 * float32 sums) instead of widening every key: a DRAM-resident cache then streams closer to
 * the memory's rate (docs/benchmarks.md, CPU kernels).
 *
 * Speculative decoding's verify chunks arrive as consecutive rows of one sequence (kend rising by
 * one, the same blocks): verify_rows finds them, and one work item per chunk and KV head reads
 * each key and value row once for all its rows, every row keeping the arithmetic it has alone
 * (bit-identical to a decode of that position). The reads are shared, the per-row compute is
 * not: several sequences' chunks gain, a single sequence's chunk is better as single rows (items
 * enough for the threads).
 *
 * bfloat16 on CPUs and processes with AMX tiles (head_dim 32 or 64, block size a multiple of
 * 16) runs both products on tiles instead (da_item_amx below): a work item's rows x query heads
 * (up to 16) are the rows of one tile, so a verify chunk of R rows costs about what one row
 * costs (docs/benchmarks.md, CPU kernels). Rows still equal their decodes bit for bit.
 *
 * Other shapes use a plain scalar loop. There is one version per cache dtype, float32 and
 * bfloat16 (K/V and queries widened to float32 on load, but for the vdpbf16ps products; the
 * output rounded to nearest even on store); all sums are float32.
 *
 * Kernel contract (all contiguous; q, cache and out of one dtype, float32 or bfloat16)::
 *
 *     q      [B, KH, G, D]    queries, G = num_heads // num_kv_heads
 *     cache  [2, KH, NB, BS, D]  one layer's cache ([0] = K, [1] = V)
 *     table  [B, NBMAX] int64 row b: block ids of block indices kstart[b]//BS, kstart[b]//BS + 1, ...
 *     kstart [B] int64         first key position attended (0, or the window start)
 *     kend   [B] int64         one past the last key position (= query position + 1)
 *     out    [B, KH, G, D]
 */
#include "kv_vec.h"

#include <immintrin.h>
#define MAXG 16 /* query heads per KV head */
#define MAXC 16 /* D / 16 chunks: head_dim <= 256 */

/* Lane-pair sums of x and y: out lanes from x's pairs (lo, hi halves per group) then y's. */
#define PAIRSUM(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))

/* out[j] = sum of a[j]'s 16 lanes, for j = 0..15: a transposing tree of 15 shuffle-add pairs
   (the leaves end up in bit-reversed order, undone by the last shuffle). */
static inline v16 hsum16x16(const v16* a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = PAIRSUM(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            PAIRSUM(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = PAIRSUM(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            PAIRSUM(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = PAIRSUM(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            PAIRSUM(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    v16 e = PAIRSUM(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
        PAIRSUM(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

#define MAXR 16 /* rows of one verify chunk in a work item */

/* Groups rows 0 .. B-1 into runs of one sequence's consecutive query positions -- a verify
   chunk of speculative decoding: the same kstart, kend rising by one, and the same blocks for
   every key a row attends (checked, so rows of different sequences grouped by chance read the
   same memory) -- each chunk cut into equal parts of at most rmax rows. Group i is rows
   starts[i] .. starts[i + 1] - 1; returns the number of groups (B when no rows group: plain
   decodes, or a sliding window). */
static int64_t verify_rows(const int64_t* table, int64_t nbmax, const int64_t* kstart, const int64_t* kend,
                           int64_t B, int64_t BS, int64_t rmax, int64_t* starts) {
    int64_t ng = 0;
    for (int64_t b = 0; b < B;) {
        int64_t e = b + 1;
        while (e < B && kstart[e] == kstart[b] && kend[b] > kstart[b] && kend[e] == kend[e - 1] + 1 &&
               !memcmp(table + e * nbmax, table + (e - 1) * nbmax,
                       sizeof(int64_t) * (size_t)((kend[e - 1] - 1) / BS - kstart[b] / BS + 1)))
            ++e;
        const int64_t n = e - b, parts = (n + rmax - 1) / rmax;
        for (int64_t i = 0; i < parts; ++i) starts[ng++] = b + i * n / parts;
        b = e;
    }
    starts[ng] = B;
    return ng;
}

/* bfloat16 on AMX tiles (da_item_amx; on where the CPU and process have AMX: kv_decode_attention_set_amx).
   One work item is KV head h of rows b0 .. b0+R-1 of one sequence (a decode, R = 1, or part of a
   verify chunk), R * G <= 16: its R rows x G query heads are the 16 rows ("lanes") of a tile, so
   each product is one tile operation per 16 or 32 keys whatever R is. Two passes over the keys,
   as the AVX-512 item:
     S [lanes][keys] = Q [lanes][D] . K^T   (B: 16 keys' K rows as 32-bit d pairs, transposed)
     O [lanes][D]   += P [lanes][keys] . V  (B: V rows interleaved in key pairs; P split into a
                                             bfloat16 high part and the bfloat16 rounding of the
                                             rest, two products, so P keeps ~16 bits, not 8:
                                             the split of Henry, Tang and Heinecke, "Leveraging
                                             the bfloat16 Artificial Intelligence Datatype For
                                             Higher-Precision Computations", ARITH 2019)
   The softmax runs per lane over its keys. A lane's arithmetic depends on its own query and
   keys only -- the same 16-key steps from the same first key, whatever the other lanes hold --
   so a verify row equals the decode of its position bit for bit, as on the AVX-512 path.
   Up to head_dim 64 (O held in 4 tiles); others take the AVX-512 path. */
static int da_amx = 0;

/* Turns the AMX path on or off (on only where this library was built with AMX: -march=native
   on an AMX CPU; the caller has asked Linux for the process's tiles first, amx_gemm.c's
   amx_init). Returns the state now in force. */
int kv_decode_attention_set_amx(int on) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    da_amx = on != 0;
#else
    (void)on;
    da_amx = 0;
#endif
    return da_amx;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DA_AMX 1
#include "amx_tiles.h"
#include "transpose16.h"

/* Lanes of keys k0 .. k0 + 15 that a row attending keys s0 .. e - 1 reads (all ones / zero). */
static inline v16i da_keys_in(int64_t k0, int64_t s0, int64_t e) {
    const v16 p = (v16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + (float)k0;
    return (p >= (float)s0) & (p < (float)e);
}

/* Tiles (config_tiles: all 16 rows x 64 bytes): 0 S [16 lanes][16 keys] f32; 1 Q [16 lanes][32 d]
   bf16, later V pairs [16 key pairs][16 d x 2]; 2 K^T pairs [16 d pairs][16 keys x 2], later P
   high [16 lanes][32 keys]; 3 P low; 4-7 O [16 lanes][16 d] f32 for d = 0-15, .., 48-63.
   Returns 1 on no memory (nothing written). */
static int da_item_amx(int64_t b0, int64_t R, int64_t h, const uint16_t* q, int64_t qs, const uint16_t* cache,
                       const int64_t* table, int64_t nbmax, const int64_t* kstart, const int64_t* kend,
                       uint16_t* out, int64_t KH, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale) {
    const int64_t N = R * G, KC = D / 32, ND = D / 16, bl = b0 + R - 1;
    const int64_t s0 = kstart[b0], s1 = kend[bl];
    if (s1 <= s0) { /* no keys (only ever R = 1): zeros, as the AVX-512 item */
        for (int64_t r = 0; r < R; ++r)
            memset(out + ((b0 + r) * KH + h) * G * D, 0, sizeof(uint16_t) * (size_t)(G * D));
        return 0;
    }
    const int64_t a0 = s0 & ~(int64_t)15;   /* the first 16-key step (inside s0's block) */
    const int64_t nh = (s1 - a0 + 15) / 16; /* 16-key steps */
    const int64_t n32 = (nh + 1) / 2;       /* 32-key steps of the second pass */
    const int64_t Lp = 32 * n32;
    /* scratch (floats): scores / numerators [N][Lp]; Q [KC][16][32] bf16; K^T pairs [KC][16][16];
       P high, low [16][32] bf16 each; V pairs [ND][16][32] bf16; O [16][D] */
    const size_t sc_n = (size_t)(N * Lp), q_n = (size_t)(KC * 256), pv_n = (size_t)(ND * 256);
    float* sc =
        (float*)aligned_alloc(64, sizeof(float) * (sc_n + 2 * q_n + 512 + pv_n + (size_t)(16 * D) + 16));
    if (!sc) return 1;
    uint16_t* qa = (uint16_t*)(sc + ((sc_n + 15) & ~(size_t)15));
    uint32_t* kt = (uint32_t*)(qa + 2 * q_n);
    uint16_t* pa = (uint16_t*)(kt + q_n);
    uint16_t* vb = pa + 1024;
    float* o = (float*)(vb + 2 * pv_n);
    for (int64_t n = 0; n < 16; ++n)
        for (int64_t kc = 0; kc < KC; ++kc)
            *(v16*)(qa + (kc * 16 + n) * 32) =
                n < N ? *(const v16*)(q + (b0 + n / G) * qs + (h * G + n % G) * D + 32 * kc) : (v16){};
    const int64_t* tb = table + bl * nbmax;
    const int64_t fb = s0 / BS;
    const uint16_t* kbase = cache + h * NB * BS * D;
    const uint16_t* vbase = cache + KH * NB * BS * D + h * NB * BS * D;
#define DA_ROW(base, k) ((base) + (tb[(k) / BS - fb] * BS + (k) % BS) * D)
#define DA_PREFETCH(base, k)                                                                                 \
    do {                                                                                                     \
        if ((k) < s1) {                                                                                      \
            const char* p_ = (const char*)DA_ROW(base, k);                                                   \
            for (int64_t o_ = 0; o_ < 16 * D * 2; o_ += 64) __builtin_prefetch(p_ + o_);                     \
        }                                                                                                    \
    } while (0)
    /* Pass 1: scores S = Q . K^T, 16 keys a step (blocks are scattered: the hardware prefetcher
       stops at each, so the block two steps ahead is prefetched). */
    DA_PREFETCH(kbase, a0 + 16);
    for (int64_t i = 0; i < nh; ++i) {
        const int64_t k = a0 + 16 * i;
        DA_PREFETCH(kbase, k + 32);
        const uint16_t* kp = DA_ROW(kbase, k);
        for (int64_t kc = 0; kc < KC; ++kc) {
            v16 x[16];
            for (int64_t j = 0; j < 16; ++j) x[j] = *(const v16*)(kp + j * D + 32 * kc);
            transpose16(x);
            for (int64_t w = 0; w < 16; ++w) *(v16*)(kt + (kc * 16 + w) * 16) = x[w];
        }
        _tile_zero(0);
        for (int64_t kc = 0; kc < KC; ++kc) {
            _tile_loadd(1, qa + kc * 512, 64);
            _tile_loadd(2, kt + kc * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        if (N == 16) _tile_stored(0, sc + 16 * i, Lp * 4);
        else { /* (rows past N are not kept) */ float tmp[256] __attribute__((aligned(64)));
            _tile_stored(0, tmp, 64);
            for (int64_t n = 0; n < N; ++n) *(v16*)(sc + n * Lp + 16 * i) = *(const v16*)(tmp + 16 * n);
        }
    }
    /* Softmax numerators per lane, in place: keys outside [s0, the lane's end) exactly 0, as the
       padding to Lp. */
    v16 inv;
    for (int64_t n = 0; n < N; ++n) {
        float* sn = sc + n * Lp;
        const int64_t e = kend[b0 + n / G]; /* this lane's keys: s0 .. e - 1 */
        v16 mv = (v16){} - INFINITY;
        for (int64_t j = 0; j < 16 * nh; j += 16) {
            v16 x = *(v16*)(sn + j) * scale;
            if (a0 + j < s0 || a0 + j + 16 > e) {
                const v16i in = da_keys_in(a0 + j, s0, e);
                x = (v16)(((v16i)x & in) | ((v16i)((v16){} - INFINITY) & ~in));
            }
            *(v16*)(sn + j) = x;
            mv = vmax(mv, x);
        }
        const float m = hmax16(mv);
        v16 lv = (v16){};
        for (int64_t j = 0; j < 16 * nh; j += 16) {
            v16 x = exp16(*(v16*)(sn + j) - m);
            if (a0 + j < s0 || a0 + j + 16 > e) x = (v16)((v16i)x & da_keys_in(a0 + j, s0, e));
            lv += x;
            *(v16*)(sn + j) = x;
        }
        for (int64_t j = 16 * nh; j < Lp; j += 16) *(v16*)(sn + j) = (v16){};
        inv[n] = 1.0f / hsum16(lv);
    }
    /* Pass 2: O += P . V per 32 keys. V pairs: word (kp, d) = (V[2 kp][d], V[2 kp + 1][d]). */
    _tile_zero(4); /* (tile numbers must be literals) */
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                         38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    memset(pa, 0, sizeof(uint16_t) * 1024); /* rows past N stay 0 */
    DA_PREFETCH(vbase, a0);
    DA_PREFETCH(vbase, a0 + 16);
    for (int64_t st = 0; st < n32; ++st) {
        const int64_t k0 = a0 + 32 * st;
        DA_PREFETCH(vbase, k0 + 32);
        DA_PREFETCH(vbase, k0 + 48);
        for (int64_t kp = 0; kp < 16; ++kp) {
            const int64_t ka = k0 + 2 * kp,
                          kb = ka + 1; /* rows outside [s0, s1) zero: P is 0 there, and 0 x NaN is not */
            const uint16_t* ra = ka >= s0 && ka < s1 ? DA_ROW(vbase, ka) : NULL;
            const uint16_t* rb = kb >= s0 && kb < s1 ? DA_ROW(vbase, kb) : NULL;
            for (int64_t kc = 0; kc < KC; ++kc) {
                const __m512i va =
                    ra ? _mm512_loadu_si512((const void*)(ra + 32 * kc)) : _mm512_setzero_si512();
                const __m512i vv =
                    rb ? _mm512_loadu_si512((const void*)(rb + 32 * kc)) : _mm512_setzero_si512();
                _mm512_store_si512((void*)(vb + ((2 * kc) * 16 + kp) * 32),
                                   _mm512_permutex2var_epi16(va, ilo, vv));
                _mm512_store_si512((void*)(vb + ((2 * kc + 1) * 16 + kp) * 32),
                                   _mm512_permutex2var_epi16(va, ihi, vv));
            }
        }
        for (int64_t n = 0; n < N; ++n) {
            const float* ps = sc + n * Lp + 32 * st;
            const v16 e0 = *(const v16*)ps, e1 = *(const v16*)(ps + 16);
            const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);
            const v16 h0 = (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16);
            const v16 h1 =
                (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16);
            _mm512_store_si512((void*)(pa + n * 32), hi);
            _mm512_store_si512((void*)(pa + 512 + n * 32),
                               (__m512i)_mm512_cvtne2ps_pbh((__m512)(e1 - h1), (__m512)(e0 - h0)));
        }
        _tile_loadd(2, pa, 64);
        _tile_loadd(3, pa + 512, 64);
#define DA_PV(t, T)                                                                                          \
    do {                                                                                                     \
        _tile_loadd(1, vb + (t) * 512, 64);                                                                  \
        _tile_dpbf16ps(T, 2, 1);                                                                             \
        _tile_dpbf16ps(T, 3, 1);                                                                             \
    } while (0)
        DA_PV(0, 4);
        DA_PV(1, 5);
        if (ND > 2) {
            DA_PV(2, 6);
            DA_PV(3, 7);
        }
#undef DA_PV
    }
    _tile_stored(4, o, D * 4);
    _tile_stored(5, o + 16, D * 4);
    if (ND > 2) {
        _tile_stored(6, o + 32, D * 4);
        _tile_stored(7, o + 48, D * 4);
    }
    for (int64_t n = 0; n < N; ++n) {
        uint16_t* dst = out + ((b0 + n / G) * KH + h) * G * D + (n % G) * D;
        for (int64_t d = 0; d < D; d += 16) st16_bf16(dst + d, *(const v16*)(o + n * D + d) * inv[n]);
    }
#undef DA_ROW
#undef DA_PREFETCH
    free(sc);
    return 0;
}
#endif

#define KV_DTYPE_TEMPLATE "decode_attention_dtype.h"
#include "kv_instantiate.h"

/* Quantized caches (int8 / float8 codes + a float16 scale per row), queries of either dtype. */
#define KV_DTYPE_TEMPLATE "decode_attention_q8_dtype.h"
#include "kv_instantiate.h"
