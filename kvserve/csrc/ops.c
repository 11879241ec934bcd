/*
 * Fused CPU kernels for the elementwise parts of a step (C/OpenMP, built by ops/library.py).
 *
 * Each torch elementwise op costs a dispatch and a pass over memory, and a long bfloat16 prefill
 * spends a large share of its time in the RMSNorm, SiLU and dtype conversions between its GEMMs
 * (torch.profiler; docs/benchmarks.md, CPU kernels). These kernels do each of them in one pass:
 *
 * - rms_norm: optional residual add, then RMSNorm (Zhang & Sennrich, 2019) -- the numerics of
 *   HF transformers' LlamaRMSNorm: statistics in float32, the normalised value rounded to the
 *   model dtype before the weight multiply.
 * - offset_rms_norm: Gemma's RMSNorm (scale 1 + weight, all in float32, one rounding), over whole
 *   rows or over the heads of q/k columns in place, optionally followed by the residual add.
 * - silu_and_mul: silu(gate) * up over a fused [T, 2 * I] gate/up projection
 *   (SwiGLU, Shazeer 2020), each product rounded like torch's silu then mul.
 * - gelu_tanh_and_mul: gelu_tanh(gate) * up, the same for GeGLU (Gemma's MLP).
 * - rope_write_kv: rotary embedding of q and k from the fused qkv projection, with the
 *   rotated k and the v written straight into their KV-cache slots (replaces four elementwise ops,
 *   a stack, a transpose and an index_copy_ per layer); rope_write_kv_q8 writes an int8 cache
 *   (codes + float16 scale per row, bit-identical to kv_quant.quantize's rows).
 * - greedy_sample: per row, the first index of the maximum (torch.argmax) and its
 *   log-probability -log(sum(exp(x - max))), in two passes over a row that stays in cache.
 * - prompt_logprob_stats: per row, what prompt logprobs report -- log(sum(exp(x))), the rank
 *   of a target token (1 + the count of strictly larger logits) and the k largest logits with
 *   their ids -- in two passes over the row: torch needs a log-sum-exp, a [rows, vocab] mask, a
 *   reduction of it and a top-k, each a pass (and the mask an allocation) of its own.
 *
 * All take contiguous CPU tensors, float32 or bfloat16 (greedy_sample: float32 logits).
 * supported(t) says whether a tensor can take the native path; callers fall back to torch.
 */
#include "kv_q8.h"
#include "kv_vec.h"

static inline v16 vmin(v16 a, v16 b) {
    v16i m = a < b;
    return (v16)(((v16i)a & m) | ((v16i)b & ~m));
}

#define KV_DTYPE_TEMPLATE "ops_dtype.h"
#include "kv_instantiate.h"

void greedy_sample_f32(const float* logits, int64_t N, int64_t V, int64_t* tok, float* logprob,
                       int nthreads) {
    const int64_t V16 = V & ~(int64_t)15;
#pragma omp parallel for schedule(static) num_threads(N >= 4 ? nthreads : 1)
    for (int64_t r = 0; r < N; ++r) {
        const float* x = logits + r * V;
        float m = -INFINITY;
        int64_t best = 0;
        if (V16) {
            v16 mv = *(const v16*)x;
            v16i iv = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            v16i cur = iv;
            for (int64_t i = 16; i < V16; i += 16) {
                cur += 16;
                v16 v = *(const v16*)(x + i);
                v16i gt = v > mv; /* strictly greater: keeps the first index */
                mv = (v16)(((v16i)v & gt) | ((v16i)mv & ~gt));
                iv = (cur & gt) | (iv & ~gt);
            }
            m = mv[0];
            best = iv[0];
            for (int k = 1; k < 16; ++k)
                if (mv[k] > m || (mv[k] == m && iv[k] < best)) {
                    m = mv[k];
                    best = iv[k];
                }
        }
        for (int64_t i = V16; i < V; ++i)
            if (x[i] > m) {
                m = x[i];
                best = i;
            }
        v16 sv = (v16){};
        for (int64_t i = 0; i < V16; i += 16) sv += exp16(*(const v16*)(x + i) - m);
        float s = hsum16(sv);
        for (int64_t i = V16; i < V; ++i) s += expf(x[i] - m);
        tok[r] = best;
        logprob[r] = -logf(s);
    }
}

/* Insert (v, id) into the descending top list vals/ids of n (< cap) or cap entries, after the
   entries equal to v (the lower index of a tie first, as the row is scanned in order). */
static inline void topk_insert(float* vals, int64_t* ids, int64_t* n, int64_t cap, float v, int64_t id) {
    int64_t j = *n < cap ? (*n)++ : cap - 1;
    while (j > 0 && vals[j - 1] < v) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        --j;
    }
    vals[j] = v;
    ids[j] = id;
}

/* Per row r of logits [N, V]: lse[r] = log(sum(exp(x))); rank[r] = 1 + #{i : x[i] > x[t]} for
   t = targets[r]; top_vals[r, :k] / top_ids[r, :k] the k (1 <= k <= V) largest logits in
   descending order, ties by lower index (a NaN logit counts as -inf and is never listed;
   fewer than k others list NaN with id 0). Pass 1 keeps the running max, the count and the top
   list (a 16-lane block is looked at lane by lane only when a lane beats the list's smallest);
   pass 2 sums exp(x - max). */
void prompt_logprob_stats_f32(const float* logits, int64_t N, int64_t V, const int64_t* targets, int64_t k,
                              float* lse, int64_t* rank, float* top_vals, int64_t* top_ids, int nthreads) {
    const int64_t V16 = V & ~(int64_t)15;
#pragma omp parallel for schedule(static) num_threads(N >= 4 ? nthreads : 1)
    for (int64_t r = 0; r < N; ++r) {
        const float* x = logits + r * V;
        float* tv = top_vals + r * k;
        int64_t* ti = top_ids + r * k;
        const float xt = x[targets[r]];
        const v16 xtv = (v16){} + xt;
        int64_t n = 0;
        float thr = -INFINITY; /* what enters the list: anything while it is not full */
        v16 mv = (v16){} - INFINITY;
        v16i cnt = (v16i){};
        for (int64_t i = 0; i < V16; i += 16) {
            v16 v = *(const v16*)(x + i);
            mv = vmax(v, mv);
            cnt -= (v16i)(v > xtv); /* a true lane is -1 */
            v16i in;
            if (n < k) in = (v16i)(v == v);
            else in = (v16i)(v > ((v16){} + thr));
            uint32_t any = 0;
            for (int l = 0; l < 16; ++l) any |= (uint32_t)in[l];
            if (!any) continue;
            for (int l = 0; l < 16; ++l)
                if (v[l] == v[l] && (n < k || v[l] > thr)) {
                    topk_insert(tv, ti, &n, k, v[l], i + l);
                    if (n == k) thr = tv[k - 1];
                }
        }
        float m = hmax16(mv);
        int64_t c = 0;
        for (int l = 0; l < 16; ++l) c += cnt[l];
        for (int64_t i = V16; i < V; ++i) {
            float v = x[i];
            if (v > m) m = v;
            if (v > xt) ++c;
            if (v == v && (n < k || v > thr)) {
                topk_insert(tv, ti, &n, k, v, i);
                if (n == k) thr = tv[k - 1];
            }
        }
        for (; n < k; ++n) { /* fewer than k non-NaN logits */
            tv[n] = NAN;
            ti[n] = 0;
        }
        v16 sv = (v16){};
        if (m == -INFINITY || m == INFINITY) {
            lse[r] = m;
        } else {
            for (int64_t i = 0; i < V16; i += 16) sv += exp16(*(const v16*)(x + i) - m);
            float s = hsum16(sv);
            for (int64_t i = V16; i < V; ++i)
                if (x[i] == x[i]) s += expf(x[i] - m);
            lse[r] = m + logf(s);
        }
        rank[r] = 1 + c;
    }
}
