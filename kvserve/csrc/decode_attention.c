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
 * float32 sums) instead of widening every key. Together these took decode attention over a
 * DRAM-resident cache from 10.3 to 11.6 GB/s (64 sequences of ~225 tokens) and from 12.9 to
 * 16.9 GB/s (8 of ~525), bfloat16.
 *
 * Speculative decoding's verify chunks arrive as consecutive rows of one sequence (kend rising by
 * one, the same blocks): verify_rows finds them, and one work item per chunk and KV head reads
 * each key and value row once for all its rows, every row keeping the arithmetic it has alone
 * (bit-identical to a decode of that position). The reads are shared, the per-row compute is
 * not: 8 sequences x 3-5 rows over 450 keys ran 1.27-1.35x faster (bfloat16, 2 threads, 30
 * layers), a single sequence's chunk is better as single rows (items enough for the threads).
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

#define KV_DTYPE_TEMPLATE "decode_attention_dtype.h"
#include "kv_instantiate.h"
