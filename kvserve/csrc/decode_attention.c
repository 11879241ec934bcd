#include "kv_vec.h"

#include <immintrin.h>
#define MAXG 16   /* query heads per KV head */
#define MAXC 16   /* D / 16 chunks: head_dim <= 256 */

/* Lane-pair sums of x and y: out lanes from x's pairs (lo, hi halves per group) then y's. */
#define PAIRSUM(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))

/* out[j] = sum of a[j]'s 16 lanes, for j = 0..15: a transposing tree of 15 shuffle-add pairs
   (the leaves end up in bit-reversed order, undone by the last shuffle). */
static inline v16 hsum16x16(const v16* a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = PAIRSUM(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + PAIRSUM(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = PAIRSUM(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + PAIRSUM(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = PAIRSUM(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + PAIRSUM(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    v16 e = PAIRSUM(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
          + PAIRSUM(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

#define KV_DTYPE_TEMPLATE "decode_attention_dtype.h"
#include "kv_instantiate.h"
