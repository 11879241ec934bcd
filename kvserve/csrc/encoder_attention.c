/*
 * Bidirectional (encoder) attention over packed variable-length sequences, read in place from
 * a fused q/k/v projection: no padding, no gather, no mask.
 *
 * An encoder step lays its sequences one after another ([T, 3H] rows, sequence s = rows
 * cu[s] .. cu[s+1]-1). The torch path pads groups of sequences to their longest (a gather of
 * q/k/v, a mask, one scaled_dot_product_attention call per group, a scatter back); this kernel
 * attends every (sequence, head) straight from the rows, each query row over every key row of
 * its own sequence:
 *
 *     out[i, h] = sum_j softmax_j(scale * q[i, h] . k[j, h]) v[j, h]
 *
 * Work items are (tile of 16 query rows of one sequence, head), shared out dynamically over the
 * OpenMP threads. Inside an item the 16 query rows are the 16 lanes of a vector (queries
 * transposed once to [D][16], pre-scaled), so each key gives one score vector by D broadcast
 * FMAs (4 keys at a time, each query vector load used 4 times), the softmax is lane-wise over a
 * buffer of the sequence's scores (two passes: maximum, then exp and sum; exact, the whole
 * score row fits in memory for encoder lengths), and P.V accumulates O^T ([D][16]) in register
 * blocks of 8 head dimensions (p vector loaded once per key, each v scalar broadcast). Scores,
 * softmax and sums are float32 for both storage dtypes; bfloat16 outputs are rounded to
 * nearest even (as torch rounds).
 *
 * Kernel contract (q/k/v rows qs elements apart, out rows os apart; one dtype, float32 or
 * bfloat16; cu int64)::
 *
 *     qkv   [T, qs]   row i: q (H = NH * D values, head h at h * D), then k, then v
 *     cu    [S + 1]   cu[0] = 0, non-decreasing, cu[S] <= T (checked by the caller)
 *     out   [T, os]   rows < cu[S]: their H outputs written at the row start; the rest untouched
 *
 * D is a multiple of 8, at most 256.
 */
#include "kv_vec.h"

#define EA_MAX_D 256

#define KV_DTYPE_TEMPLATE "encoder_attention_dtype.h"
#include "kv_instantiate.h"
