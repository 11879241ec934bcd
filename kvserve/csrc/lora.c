/*
 * The batched LoRA delta of one fused target linear, for the small steps of decoding
 * (C/OpenMP, built by kvserve/ops/library.py; wrapper kvserve/ops/lora.py).
 *
 *   out[t, cols_p] += (x[t] @ A[s_t][:, p*R:(p+1)*R]) @ B[s_t][p*R:(p+1)*R, cols_p]
 *
 * for every row t of the step with an adapter slot s_t and every part p of the fused linear
 * (q, k, v of qkv; gate, up of gate_up; one part for o and down). The rows come grouped by slot
 * (the step's LoRAMapping: a permutation and (slot, start, end) segments), so each slot's A and
 * B are read once per chunk of up to LORA_MR rows, in the manager's storage layout, no packing.
 *
 * Why a kernel: at decode sizes (a few rows per slot) the op is a stream over the slots'
 * weights -- ~1 MB per slot and decoder layer in float32 for a rank-16 adapter on all seven
 * targets of a 576-wide model -- and torch spent it in 2-4 small BLAS calls per slot and linear
 * (each packs its weight operand, then a few FLOPs per byte) plus the masks, gathers and casts
 * around them, each with its own dispatch cost. Here one call per linear reads each weight once, in
 * registers: the shrink keeps LORA_MR rows x up to 48 rank columns in 24 accumulators over the
 * input features (one broadcast of x and one weight vector per FMA row); the expand keeps LORA_MR
 * rows x 48 output columns over the rank. It reads only each part's diagonal block of B: the
 * manager stores a fused linear's B block-diagonal ([P*R, out]: part p's rank rows times its own
 * columns), so two thirds of qkv's B and half of gate_up's are zeros that torch multiplied.
 *
 * Its speed against the torch forms is in docs/benchmarks.md (CPU kernels). It streams the
 * slots at about what one core reads beyond L2 at all, so software prefetching adds nothing.
 *
 * Numerics: products accumulated in float32 (FMA) over the input features, then over the rank;
 * bfloat16 activations and weights are widened exactly; the delta is added to out in float32 and
 * rounded once to out's dtype. Weights may be float32 or bfloat16 (the slot dtype), activations
 * float32 or bfloat16 (the model dtype): symbols lora_add_<x>_w<weight>.
 *
 * Threads: a small step (up to LORA_SPLIT_MAX_CHUNKS chunks of LORA_MR rows of one slot, not a
 * multiple of the thread count) on 2+ threads splits every chunk's shrink in 16-rank-column
 * blocks and its expand in 48-output-column blocks over the threads, a barrier between
 * (lora_add_split): a decode step of 1 or 3 adapters kept one thread idle for a third to all of
 * its LoRA time when whole chunks were the unit (2 or 4 chunks still are: balanced, and the split
 * is slower there). The splits fall on the register tiles' own column boundaries, so
 * each element is the same FMA chain as on one thread: the result does not depend on the
 * thread count. Larger steps split whole chunks over the threads (many chunks balance by
 * themselves). Returns 1 (nothing written) when the scratch rows (LORA_MR x (in + P * R)
 * floats per thread, or per chunk in the split form) cannot be allocated, else 0.
 *
 * Called per target linear by ops/lora.py (the per-layer paths) and by decode_layers.c's
 * one-call decode step, which passes the step's rows and segments once for all 120 calls.
 */
#include <omp.h>

#include "kv_vec.h"

/* Rows per register tile: 8 rows x 3 vectors = 24 of the 32 AVX-512 registers. */
#define LORA_MR 8

/* Steps of up to this many chunks (LORA_MR rows of one slot), not a multiple of the threads, on
   2+ threads run the split form (lora_add_split: the blocks of every chunk over the threads);
   more chunks are whole chunks per thread, which balances by itself. */
#define LORA_SPLIT_MAX_CHUNKS 32

/* A broadcast (without the `+ 0.0f` that `(v16){} + s` costs: that is no identity for -0.0). */
static inline v16 splat16(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

#define X_DTYPE f32
#define X_ELEM float
#define W_DTYPE f32
#define W_ELEM float
#include "lora_dtype.h"
#define X_DTYPE bf16
#define X_ELEM uint16_t
#define W_DTYPE f32
#define W_ELEM float
#include "lora_dtype.h"
#define X_DTYPE bf16
#define X_ELEM uint16_t
#define W_DTYPE bf16
#define W_ELEM uint16_t
#include "lora_dtype.h"
#define X_DTYPE f32
#define X_ELEM float
#define W_DTYPE bf16
#define W_ELEM uint16_t
#include "lora_dtype.h"
