/*
 * Fused CPU kernels for the elementwise parts of a step (C/OpenMP, built by native_lib).
 *
 * At 64 decode rows each torch elementwise op costs ~10-60 us of dispatch and a pass over memory;
 * a prefill of 6,000 tokens in bfloat16 spent ~40 % of its time in the RMSNorm, SiLU and dtype
 * conversions between its GEMMs (torch.profiler). These kernels do each of them in one pass:
 *
 * - rms_norm: optional residual add, then RMSNorm (Zhang & Sennrich, 2019) -- the numerics of
 *   HF transformers' LlamaRMSNorm: statistics in float32, the normalised value rounded to the
 *   model dtype before the weight multiply.
 * - silu_and_mul: silu(gate) * up over a fused [T, 2 * I] gate/up projection
 *   (SwiGLU, Shazeer 2020), each product rounded like torch's silu then mul.
 * - rope_write_kv: rotary embedding of q and k from the fused qkv projection, with the
 *   rotated k and the v written straight into their KV-cache slots (replaces four elementwise ops,
 *   a stack, a transpose and an index_copy_ per layer).
 * - greedy_sample: per row, the first index of the maximum (torch.argmax) and its
 *   log-probability -log(sum(exp(x - max))), in two passes over a row that stays in cache.
 *
 * All take contiguous CPU tensors, float32 or bfloat16 (greedy_sample: float32 logits).
 * supported(t) says whether a tensor can take the native path; callers fall back to torch.
 */
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
