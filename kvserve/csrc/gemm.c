/*
 * Linear layers on CPU: y = x @ W^T (+ b) with the weight packed once into column panels.
 *
 * Why our own GEMM: a decode step's GEMMs have few rows (1-64 tokens) and read every weight once,
 * where a general library GEMM neither reaches the FMA peak nor streams weights at memory speed.
 * The register-blocked kernel here follows the Goto/BLIS decomposition (Goto & van de Geijn,
 * "Anatomy of High-Performance Matrix Multiplication", ACM TOMS 2008; Van Zee & van de Geijn,
 * "BLIS", ACM TOMS 2015); its speed against oneDNN is in docs/benchmarks.md (CPU kernels,
 * benchmarks/gemm_micro.py).
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
 * weight stream GEMM_STREAM_AHEAD bytes ahead itself, so that the FMAs of each extra row hide
 * under the memory time instead of adding to it. Steps of 9-16 rows run as two blocks of
 * balanced size (12 = 6 + 6) that each prefetch a slice of the next panel in proportion to
 * their rows, so the memory stream runs under both blocks' FMAs; only the thread's first panel
 * streams in its first block. From ~24 rows the kernel is FMA-bound and needs no streaming.
 *
 * bfloat16 weights also work (widened to float32 in registers, x widened once per call, the
 * output rounded to nearest even). oneDNN's AMX and AVX512-BF16 GEMMs beat this from a few rows,
 * so model_executor/layers/linear.py packs bfloat16 weights here only on CPUs with neither AMX
 * nor AVX512-BF16, where oneDNN emulates bfloat16.
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
