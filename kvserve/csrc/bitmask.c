/*
 * Structured-output token masks applied to float32 logits rows (C/OpenMP, built by ops/library.py).
 *
 * A grammar's mask row is int32 [W]: bit t % 32 of word t / 32 is 1 when token t is allowed
 * (llguidance's layout, little-endian words); tokens at or past 32 * W are not allowed, and the
 * bits of the last word past the vocabulary V are ignored (V % 32 need not be 0).
 *
 * In torch, masking 64 rows of a 49,152-token vocabulary took a gather through a byte -> 8 bools
 * table (3 M bools), a negation, an index_select / masked_fill_ / index_copy_ round trip, each
 * a pass over memory (docs/benchmarks.md, CPU kernels), plus a second pass of the greedy sampler
 * over the masked rows. Here:
 *
 * - apply_token_bitmask_f32: in place, per constrained row and 32-token word: an all-ones word is
 *   skipped, otherwise its two 16-lane halves are blended with -inf under the bits (one pass
 *   over the mask, writes only where a word forbids something).
 * - greedy_sample_masked_f32: the greedy sampler of ops.c (first index of the maximum, as
 *   torch.argmax; log-probability -log(sum(exp(x - max))) over the allowed tokens only) with the
 *   mask fused in: all-zero words are skipped, so nothing is written and a row whose grammar
 *   allows a few tokens is read only there. Its result equals masking to -inf, then
 *   greedy_sample_f32 / torch (argmax + logsumexp); a row with no allowed token gives token 0
 *   and a NaN log-probability, as argmax and -inf - logsumexp(-inf) do.
 *
 * Logits rows are contiguous float32 [N, V]; mask rows are picked per logits row (row index
 * arrays), so a batch that mixes constrained and free rows needs no gather or copy.
 */
#include <math.h>

#include "kv_vec.h"

/* Word w of a mask row (free: every token allowed); words past W allow nothing. m is not
   read when W is 0 (an empty mask's pointer may be NULL). */
static inline uint32_t mask_word(const int32_t* m, int free, int64_t w, int64_t W) {
    if (free) return 0xffffffffu;
    return w < W ? (uint32_t)m[w] : 0u;
}

/* -1 lanes where the 16 bits of `half` are set (lane k <- bit k). */
static inline v16i lanes_of(uint32_t half) {
    const v16u shift = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16u b = (v16u){} + half;
    return (v16i)(((b >> shift) & 1u) != 0u);
}

static inline v16 blend(v16i sel, v16 a, v16 b) { return (v16)(((v16i)a & sel) | ((v16i)b & ~sel)); }

void apply_token_bitmask_f32(float* logits, int64_t V, const int64_t* rows, const int32_t* mask, int64_t R,
                             int64_t W, int nthreads) {
    const int64_t Vfull = V & ~(int64_t)31;
    const v16 ninf = (v16){} - INFINITY;
#pragma omp parallel for schedule(static) num_threads(R >= 4 ? nthreads : 1)
    for (int64_t r = 0; r < R; ++r) {
        float* x = logits + (rows ? rows[r] : r) * V;
        const int32_t* m = mask + r * W;
        const int free = 0;
        for (int64_t t = 0; t < Vfull; t += 32) {
            uint32_t bits = mask_word(m, free, t >> 5, W);
            if (bits == 0xffffffffu) continue;
            for (int h = 0; h < 2; ++h) {
                uint32_t half = (bits >> (16 * h)) & 0xffffu;
                float* p = x + t + 16 * h;
                if (half == 0xffffu) continue;
                *(v16*)p = half ? blend(lanes_of(half), *(const v16*)p, ninf) : ninf;
            }
        }
        for (int64_t t = Vfull; t < V; ++t)
            if (!((mask_word(m, free, t >> 5, W) >> (t & 31)) & 1u)) x[t] = -INFINITY;
    }
}

void greedy_sample_masked_f32(const float* logits, int64_t N, int64_t V, const int32_t* mask,
                              const int64_t* mask_rows, int64_t W, int64_t* tok, float* logprob,
                              int nthreads) {
    const int64_t Vfull = V & ~(int64_t)31;
    const v16 ninf = (v16){} - INFINITY;
    const v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for schedule(static) num_threads(N >= 4 ? nthreads : 1)
    for (int64_t r = 0; r < N; ++r) {
        const float* x = logits + r * V;
        const int free = mask_rows[r] < 0;
        const int32_t* m = free ? mask : mask + mask_rows[r] * W;
        /* Pass 1: per-lane maximum over allowed tokens; strictly greater keeps the first index. */
        v16 mv = ninf;
        v16i iv = (v16i){};
        for (int64_t t = 0; t < Vfull; t += 32) {
            uint32_t bits = mask_word(m, free, t >> 5, W);
            if (!bits) continue;
            for (int h = 0; h < 2; ++h) {
                uint32_t half = (bits >> (16 * h)) & 0xffffu;
                if (!half) continue;
                v16 v = *(const v16*)(x + t + 16 * h);
                if (half != 0xffffu) v = blend(lanes_of(half), v, ninf);
                v16i gt = v > mv;
                mv = blend(gt, v, mv);
                iv = (v16i)blend(gt, (v16)(iota + (int32_t)(t + 16 * h)), (v16)iv);
            }
        }
        float mx = mv[0];
        int64_t best = iv[0];
        for (int k = 1; k < 16; ++k)
            if (mv[k] > mx || (mv[k] == mx && iv[k] < best)) {
                mx = mv[k];
                best = iv[k];
            }
        for (int64_t t = Vfull; t < V; ++t)
            if (((mask_word(m, free, t >> 5, W) >> (t & 31)) & 1u) && x[t] > mx) {
                mx = x[t];
                best = t;
            }
        if (mx == -INFINITY) { /* nothing allowed (or every allowed logit -inf): as torch */
            tok[r] = 0;
            logprob[r] = NAN;
            continue;
        }
        /* Pass 2: sum of exp(x - max) over the allowed tokens. */
        v16 sv = (v16){};
        const v16 vmx = (v16){} + mx;
        for (int64_t t = 0; t < Vfull; t += 32) {
            uint32_t bits = mask_word(m, free, t >> 5, W);
            if (!bits) continue;
            for (int h = 0; h < 2; ++h) {
                uint32_t half = (bits >> (16 * h)) & 0xffffu;
                if (!half) continue;
                v16 e = exp16(*(const v16*)(x + t + 16 * h) - vmx);
                sv += half == 0xffffu ? e : (v16)((v16i)e & lanes_of(half));
            }
        }
        float s = hsum16(sv);
        for (int64_t t = Vfull; t < V; ++t)
            if ((mask_word(m, free, t >> 5, W) >> (t & 31)) & 1u) s += expf(x[t] - mx);
        tok[r] = best;
        logprob[r] = -logf(s);
    }
}
