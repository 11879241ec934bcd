/*
 * Every decoder layer of a pure-decode step (and the final norm) in one call.
 *
 * Why: cpu_decode_step.py's per-layer path makes nine ctypes calls per layer (two RMSNorms, four
 * GEMMs, rotary + cache write, attention, SiLU-and-mul), 270 for the default model's 30 layers;
 * each costs a few microseconds of argument conversion and Python around it, a noticeable
 * share of a batch-1 step whose GEMVs are short (docs/benchmarks.md, CPU kernels). This file
 * runs the same sequence in C:
 *
 *   h = norm(residual (+= mlp_out of the layer before))
 *   qkv = h @ Wqkv^T (+ b); [per-head q / k norms]; rope(q, k), k and v written to their cache slots
 *   attn = decode attention from the paged cache; o = attn @ Wo^T (+ b)
 *   h = norm(residual += o); gate_up = h @ Wgu^T; act = silu(gate) * up; mlp_out = act @ Wd^T
 *   ... every layer, then out = norm(residual += mlp_out)
 *
 * or Gemma's layer (dl_model.gemma: four norms of scale 1 + weight, each sub-block's output
 * normed before the residual add, GeGLU; per layer its own window's key ranges and rotary table):
 *
 *   h = in_norm(residual); qkv = h @ Wqkv^T; q / k head norms; rope; attention; o = attn @ Wo^T
 *   residual += post_norm(o); h = pre_ff_norm(residual); act = gelu_tanh(gate) * up
 *   residual += post_ff_norm(act @ Wd^T) ... every layer, then out = final_norm(residual)
 *
 * with the kernels of the other libraries (ops.c, decode_attention.c, gemm.c, amx_gemm.c,
 * quant_gemm.c) called through function pointers that the Python side resolves once per model
 * and step regime (a dispatch table: per layer and weight the kernel of its format, its weight
 * bytes, bias and shape; dl_model / dl_layer / dl_gemm below) -- no kernel is compiled twice,
 * and each keeps its own threads (OpenMP) and ISA paths (AVX-512, AVX2, scalar). The kernels,
 * arguments and order are the per-layer path's, so the result is bit-identical to it.
 *
 * The activations live in buffers of the dispatch table (allocated once, for max_rows rows);
 * residual (the embedded tokens) is updated in place. Nothing here is vectorised: the work is
 * in the kernels.
 *
 * LoRA: a step with adapter rows (dl_model.lora_nseg > 0) adds each target's batched delta
 * right after its GEMM by lora.c's kernel (dl_model.lora, the slots' dl_lora entries per layer,
 * the step's rows and (slot, start, end) segments), the per-layer path's call with the same
 * arguments: bit-identical to it, without its ~120 Python add_lora calls (and 270 ctypes calls)
 * per step.
 *
 * int8 KV caches (dl_model.kv_quant): the rope pointer is ops.c's rope_write_kv_q8 (k and v
 * quantized into their slots) and the attend pointer decode_attention.c's q8 kernel, as in the
 * per-layer path.
 *
 * Not covered (the per-layer path runs): tensor-parallel all-reduces between the GEMMs (Python
 * operations); Gemma layers then take the module path. Attention logit soft-capping (Gemma 2):
 * the decode attention kernel has none, so such models never build native decode inputs.
 */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "kv_vec.h"

/* A kernel entry point: stored as this generic function pointer type, called through its real
   one (conversions between function pointer types are well defined in C). */
typedef void (*dl_fn)(void);

/* How a GEMM kernel is called (all compute y[M, N] = x[M, K] @ W^T (+ bias)):
   DL_TILE    void f(x, w, bias, y, M, N, K, nthreads)       quant_gemm_<type> (float activations)
   DL_STATUS  int f(x, w, bias, y, M, N, K, nthreads)        quant_gemm_{act8,act16,panel}_<type>:
                                                             nonzero = no memory for its scratch
   DL_PANEL   void f(x, xf, w, bias, y, M, N, K, nthreads)   gemm_<dtype> (packed float panels)
   DL_AMX     void f(x, w, bias, y, M, N, K, nthreads)       amx_gemm_bf16, bf16dot_gemm (bfloat16 only) */
typedef void (*dl_amx_fn)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                          int64_t, int);
enum { DL_TILE = 0, DL_STATUS = 1, DL_PANEL = 2, DL_AMX = 3 };

/* decode_layers_* results */
enum { DL_OK = 0, DL_ENOMEM = -1, DL_EINVAL = -2 };

typedef struct {
    dl_fn fn;
    int64_t kind;     /* DL_* above */
    const void* w;    /* the weight's bytes in the kernel's layout */
    const void* bias; /* [n] in the storage dtype, or NULL */
    int64_t n, k;     /* out_features, in_features */
} dl_gemm;

/* One target's LoRA slots (lora.c's lora_add arguments): slot s's A element (j, c) at
   a[s * a_slot + j * a_row + c] (input feature j, rank column c < P * R), B element (r, n) at
   b[s * b_slot + r * b_row + n]; part p owns rank columns [p R, (p + 1) R) and output columns
   [cols[p], cols[p + 1]). a == NULL: no delta for this target. */
typedef struct {
    const void* a;
    const void* b;
    int64_t a_slot, a_row, b_slot, b_row;
    int64_t P, R;
    const int64_t* cols; /* [P + 1] */
} dl_lora;

/* One window's decode attention inputs (decode_attention.c's block table and key ranges). */
typedef struct {
    const int64_t* table; /* [T, nbmax] */
    int64_t nbmax;
    const int64_t *kstart, *kend; /* [T] */
} dl_keys;

/* The most distinct attention windows of a model's layers (dl_model.keys). */
#define DL_MAX_KEYS 4

typedef struct {
    const void* in_norm;   /* [hidden] input_layernorm weight */
    const void* post_norm; /* [hidden] post_attention_layernorm weight */
    float in_eps, post_eps;
    dl_gemm qkv, o, gate_up, down;
    void* cache;    /* [2, KH, nb, bs, D] this layer's KV cache */
    int64_t nb, bs; /* blocks, block size */
    float scale;    /* softmax scale */
    dl_lora lora_qkv, lora_o, lora_gate_up, lora_down;
    /* per-head q / k norms before the rotary (NULL: none): [D] weights, of the storage dtype
       under rms_norm (Qwen3), float32 1 + weight under offset_rms_norm (Gemma 3) */
    const void *q_norm, *k_norm;
    float q_eps, k_eps;
    /* Gemma: the pre- and post-feedforward norms (float32 1 + weight) */
    const void *pre_ff_norm, *post_ff_norm;
    float pre_ff_eps, post_ff_eps;
    int64_t keys;       /* with dl_model.nkeys > 0: this layer's window, an index into dl_model.keys */
    int64_t local_rope; /* 1: rotate by dl_model.cos_local / sin_local (Gemma 3's sliding layers) */
} dl_layer;

typedef struct {
    dl_fn rms, rope, silu, attend; /* the storage dtype's rms_norm, rope_write_kv, silu_and_mul,
                                      kv_paged_decode_attention */
    const dl_layer* layers;
    int64_t num_layers, hidden, H, KH, D, inter;
    const void* final_norm; /* [hidden] */
    float final_eps;
    int64_t max_rows; /* rows each buffer below holds */
    /* [max_rows, hidden] x3, [max_rows, (H + 2 KH) D], [max_rows, H + KH, D], [max_rows, H D],
       [max_rows, 2 inter], [max_rows, inter] */
    void *h, *o, *mlp_out, *qkv, *qk, *attn_out, *gate_up, *act;
    float* xf;                /* [max_rows, max(hidden, H D, inter)] float32: x widened for the panel GEMM
                  (bfloat16 only; NULL for float32) */
    dl_fn lora;               /* lora_add_<dtype>_w<slot dtype> (lora.c), or NULL */
    int64_t lora_wbf16;       /* the slots' dtype: 1 bfloat16, 0 float32 */
    const int64_t* lora_rows; /* this step's rows with a slot, grouped by slot */
    const int64_t* lora_segs; /* [lora_nseg, 3] (slot, start, end) over lora_rows */
    int64_t lora_nseg;        /* 0: no LoRA rows in this step */
    double lora_seconds;      /* wall seconds in the LoRA kernel calls, accumulated over steps
                                 (benchmarks read the per-step LoRA cost from it) */
    /* Gemma layers (gemma = 1): every norm is offset_rms (scale 1 + weight, float32 weights,
       the residual added after the post-norms) and the MLP activation gelu (gelu_tanh_and_mul);
       0: Llama layers (rms, silu) */
    int64_t gemma;
    dl_fn offset_rms, gelu;
    /* layers of several windows (nkeys > 0): each window's attention inputs, set before each
       call (the step's arguments are then unused); 0: every layer takes the arguments */
    dl_keys keys[DL_MAX_KEYS];
    int64_t nkeys;
    const void *cos_local, *sin_local; /* [T, D / 2] the local rotary table, set before each call */
    /* 0: caches of the storage dtype; 1: int8 caches ([2, KH, nb, bs, D + 2] bytes: codes +
       float16 scale), rope and attend then being rope_write_kv_q8 and kv_paged_decode_attention_q8
       (kind 0) */
    int64_t kv_quant;
} dl_model;

#define KV_DTYPE_TEMPLATE "decode_layers_dtype.h"
#include "kv_instantiate.h"

/* sizeof of the structs, for the Python side's layout check (it refuses to run on a mismatch) */
int64_t decode_layers_struct_sizes(int64_t which) {
    switch (which) {
    case 0: return (int64_t)sizeof(dl_gemm);
    case 1: return (int64_t)sizeof(dl_layer);
    case 2: return (int64_t)sizeof(dl_model);
    case 3: return (int64_t)sizeof(dl_lora);
    case 4: return (int64_t)sizeof(dl_keys);
    default: return -1;
    }
}
