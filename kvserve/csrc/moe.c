/*
 * Mixture-of-experts MLP on CPU: top-k softmax routing, and every active expert's SwiGLU MLP in
 * one call (C/OpenMP, built by kvserve/ops/library.py; wrapper kvserve/ops/moe.py).
 *
 *   out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = experts[t, j]
 *
 * Routing (moe_route_f32): softmax over the E logits, the k largest (ties to the lower expert
 * id), renormalised to sum 1 when asked (Shazeer et al. 2017; the top-k softmax gate of Mixtral,
 * Jiang et al. 2024).
 *
 * Why one call: torch runs the grouped form as a sort, a gather, two GEMMs per active expert (or
 * a grouped GEMM), a multiply by the routing weights and an index_add, each its own dispatch and
 * pass over memory; a tiny model's layer was mostly that overhead, and a large one's decode step
 * should stream every active expert's weights once, at memory speed.
 *
 * Layout: the expert weights k-major, w13t [E, H, 2I] (for each input feature, the gate then
 * the up outputs) and w2t [E, I, H]: the transposes of the stacks [E, 2I, H] / [E, H, I] that
 * fused_moe keeps as strided views of this storage (no second copy), so that the micro-kernel
 * is gemm.c's outer product (8 rows x 48 columns in 24 accumulators; per input feature 3
 * contiguous weight vectors and 8 broadcasts) reading the weights in place, row stride 2I or H.
 *
 * Steps, one OpenMP region:
 *  0. (serial) a counting sort of the T * k (token, expert) pairs by expert, tokens in order
 *     within an expert: slot of each pair, token of each slot, each expert's slot range;
 *  1. each slot's token row widened to float32 into xs [n, H] (gathered once);
 *  2. tasks (active expert, block of MOE_NB intermediate columns), dynamically scheduled: for
 *     every 8-row block of the expert's slots, the gate and the up block, then
 *     h = silu(gate) * up into h [n, I]; the first row block streams the weights from memory
 *     (prefetching MOE_PF_K input features ahead), the others read them from L2;
 *  3. tasks (active expert, block of MOE_NB output columns): ys [n, H] = h @ w2 the same way;
 *  4. per token: out[t] = sum over its k pairs, in pair order, of w * ys[slot], rounded once.
 *
 * Numerics: float32 throughout (bfloat16 inputs and weights widened exactly), sums over the
 * input features in order, one rounding to the output dtype at the end; torch's bfloat16 path
 * rounds the gate/up and down outputs and each expert's weighted sum, so bfloat16 results differ
 * from it by those roundings.
 */
#include "kv_vec.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

/* columns per task: 3 vectors of 16; a gate/up task's two blocks (H = 1024: 2 x 192 KB
   float32) stay in L2 while the expert's row blocks pass over them */
#define MOE_NB 48
/* input features ahead that the first row block prefetches its weight rows */
#ifndef MOE_PF_K
#define MOE_PF_K 8
#endif

/* Routing of T tokens over E experts: weights [T, k] (float32; rounded to bfloat16 values when
   round_bf16) and experts [T, k] (int64), by descending probability. */
void moe_route_f32(const float* logits, int64_t T, int64_t E, int64_t k, int renormalize, int round_bf16,
                   float* weights, int64_t* experts, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < T; ++t) {
        const float* l = logits + t * E;
        float mx = l[0];
        for (int64_t e = 1; e < E; ++e) mx = l[e] > mx ? l[e] : mx;
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) sum += expf(l[e] - mx);
        float* w = weights + t * k;
        int64_t* ids = experts + t * k;
        float picked = 0.f;
        for (int64_t j = 0; j < k; ++j) {
            // the largest logit not taken yet (logit order is probability order); NaN never wins
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                int taken = 0;
                for (int64_t i = 0; i < j; ++i) taken |= ids[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ids[j] = best;
            w[j] = expf(l[best] - mx) / sum;
            picked += w[j];
        }
        for (int64_t j = 0; j < k; ++j) {
            float v = renormalize ? w[j] / picked : w[j];
            if (round_bf16) {
                uint16_t b;
                st1_bf16(&b, v);
                v = ld1_bf16(&b);
            }
            w[j] = v;
        }
    }
}

/* silu(g) * u, 16 lanes: g / (1 + e^-g) with e^-g clamped at e^88 (ops_dtype.h's SiLU: below
   -88 the clamped exp no longer cancels g, and silu there is +-0) */
static inline v16 silu_mul16(v16 g, v16 u) {
    const v16 e = exp16((v16){} - vmax(g, (v16){} - 88.0f));
    v16 s = g / (1.0f + e);
    const v16i far = g < -88.0f;
    s = (v16)(((v16i)s & ~far) | ((v16i)(g * 0.0f) & far));
    return s * u;
}

/* The float32 scratch of a call (xs, h, ys). Kept between calls, per calling thread, up to
   MOE_KEEP_BYTES: a multi-megabyte malloc that is freed again comes back from the system each
   time as fresh pages, and faulting them in cost more than the whole call at prefill sizes of a
   small model. Larger requests are allocated for the call (*owned set: the caller frees). */
#ifndef MOE_KEEP_BYTES
#define MOE_KEEP_BYTES ((size_t)64 << 20)
#endif
static _Thread_local float* moe_keep;
static _Thread_local size_t moe_keep_bytes;

static float* moe_scratch(size_t bytes, int* owned) {
    bytes = (bytes + 63) & ~(size_t)63; // aligned_alloc: a multiple of the alignment
    *owned = bytes > MOE_KEEP_BYTES;
    if (*owned) return aligned_alloc(64, bytes);
    if (bytes > moe_keep_bytes) {
        free(moe_keep);
        moe_keep = aligned_alloc(64, bytes);
        moe_keep_bytes = moe_keep ? bytes : 0;
    }
    return moe_keep;
}

#define KV_DTYPE_TEMPLATE "moe_dtype.h"
#include "kv_instantiate.h"
