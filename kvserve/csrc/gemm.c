/*
 * Linear layers on CPU: y = x @ W^T (+ b) with the weight packed once into column panels.
 *
 * Why our own GEMM: a decode step's GEMMs have few rows (1-64 tokens) and read every weight once.
 * oneDNN's prepacked float32 matmul reaches ~55 % of this CPU's FMA peak at 59 rows and reads
 * weights at ~17 of ~23 GB/s at 1-8 rows. The register-blocked kernel here (the Goto/BLIS
 * decomposition: Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM
 * TOMS 2008; Van Zee & van de Geijn, "BLIS", ACM TOMS 2015) measured, on the 30 layers of
 * SmolLM2-135M (2 cores, AVX-512, benchmarks/gemm_micro.py), 1.3-1.6x faster than oneDNN at
 * 1-128 rows and level with it at 8,192 rows. In the engine (w64 workload, float32, two engines
 * stepped alternately in one process, both orders) decode steps took 0.80x the time and prefill
 * steps the same; the whole run 0.84x.
 *
 * Layout: W [N, K] becomes panels [P, K, PANEL_WIDTH] (P = ceil(N / PANEL_WIDTH),
 * zero padded): panel p holds output columns p * 48 .. p * 48 + 47 with the 48 weights
 * of one input feature contiguous, so the micro-kernel streams each panel once, sequentially.
 *
 * Micro-kernel: 8 rows of x x 48 columns = 24 accumulator vectors of 16 floats; per input
 * feature it loads 3 weight vectors and broadcasts 8 x values (outer-product update). The
 * threads split the panels; within a thread a panel (<= 300 KB) stays in L2 while every 8-row block
 * of a ~1 MB chunk of x rows passes over it, and those blocks prefetch the thread's next panel
 * so that its first block does not wait on memory. Sums run over k in order in float32
 * (results differ from MKL's by rounding, ~1e-6 relative).
 *
 * Steps of at most 8 rows (decodes; speculative verify chunks of k + 1 tokens) have one block
 * per panel, so nothing above prefetches their weights: the micro-kernel then prefetches the
 * weight stream GEMM_STREAM_AHEAD bytes ahead itself. Without it the FMAs of each extra row
 * added to the memory time instead of hiding under it: the default model's 30 layers + LM head
 * at 5 rows took 1.37x the 1-row time on one thread; with it 1.06-1.08x (2048 B ahead: 1.18x,
 * 8192: 1.07-1.11x; measured on the 2-core AVX-512F VM under load, thread CPU time). Steps of
 * 9-16 rows (batch-8 verify steps) have two blocks a panel, whose second prefetches only a third
 * of the next float32 panel: there the first block streams too (60 layers of the default model's
 * shapes, 2 threads, benchmarks/gemm_micro.py: 9 rows 51.4 -> 34.2 ms, the 8-row time 30-32 ms).
 * Since then 9-16 rows run as two blocks of balanced size (12 = 6 + 6) that each prefetch a slice
 * of the next panel in proportion to their rows, so the memory stream runs under both blocks'
 * FMAs; only the thread's first panel streams in its first block (12 rows 0.92-0.96x the time,
 * 16 rows 0.97-0.98x, 9 rows level; bit-identical; on an AMD EPYC 2-core VM where 1 row took
 * 20 ms, 8 rows 25, 16 rows 36 and 512 rows ran at ~206 GFLOP/s, the FMA peak: from 24 rows
 * (~185 GFLOP/s) the kernel is FMA-bound and keeps the scheme above).
 *
 * bfloat16 weights also work (widened to float32 in registers, x widened once per call, the
 * output rounded to nearest even), but oneDNN's AMX GEMM beat it from ~8 rows and in the engine
 * (w64 run 0.79x the speed even when used only up to 32 rows), so llama.prepack_weight packs
 * bfloat16 weights here only on CPUs with neither AMX nor AVX512-BF16, where oneDNN emulates
 * bfloat16 and this kernel measured 1.4-1.7x its speed at 1 row, 2.9x at 5, 3.7x at 512.
 */
#include "kv_vec.h"
#include <omp.h>

#ifndef GEMM_STREAM_AHEAD
#define GEMM_STREAM_AHEAD 4096
#endif
#ifndef GEMM_PF_NEXT /* 0: no software prefetch of the next panel (for measuring it) */
#define GEMM_PF_NEXT 1
#endif
#ifndef GEMM_STREAM_HINT
#define GEMM_STREAM_HINT 2
#endif

#define KV_DTYPE_TEMPLATE "gemm_dtype.h"
#include "kv_instantiate.h"
