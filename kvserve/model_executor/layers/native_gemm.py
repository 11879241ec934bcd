"""Linear layers on CPU: ``y = x @ W^T (+ b)`` with the weight packed once into column panels.

Why our own GEMM: a decode step's GEMMs have few rows (1-64 tokens) and read every weight once.
oneDNN's prepacked float32 matmul reaches ~55 % of this CPU's FMA peak at 59 rows and reads
weights at ~17 of ~23 GB/s at 1-8 rows. The register-blocked kernel here (the Goto/BLIS
decomposition: Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication", ACM
TOMS 2008; Van Zee & van de Geijn, "BLIS", ACM TOMS 2015) measured, on the 30 layers of
SmolLM2-135M (2 cores, AVX-512, ``benchmarks/gemm_micro.py``), 1.3-1.6x faster than oneDNN at
1-128 rows and level with it at 8,192 rows. In the engine (w64 workload, float32, two engines
stepped alternately in one process, both orders) decode steps took 0.80x the time and prefill
steps the same; the whole run 0.84x.

Layout: ``W [N, K]`` becomes ``panels [P, K, PANEL_WIDTH]`` (``P = ceil(N / PANEL_WIDTH)``,
zero padded): panel ``p`` holds output columns ``p * 48 .. p * 48 + 47`` with the 48 weights
of one input feature contiguous, so the micro-kernel streams each panel once, sequentially.

Micro-kernel: 8 rows of ``x`` x 48 columns = 24 accumulator vectors of 16 floats; per input
feature it loads 3 weight vectors and broadcasts 8 ``x`` values (outer-product update). The
threads split the panels; within a thread a panel (<= 300 KB) stays in L2 while every 8-row block
of a ~1 MB chunk of ``x`` rows passes over it, and those blocks prefetch the thread's next panel
so that its first block does not wait on memory. Sums run over ``k`` in order in float32
(results differ from MKL's by rounding, ~1e-6 relative).

bfloat16 weights also work (widened to float32 in registers, ``x`` widened once per call, the
output rounded to nearest even), but oneDNN's AMX GEMM beat it from ~8 rows and in the engine
(w64 run 0.79x the speed even when used only up to 32 rows), so ``llama.prepack_weight`` packs
float32 weights only.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_executor.layers.native_lib import DTYPE_SUFFIX, PRELUDE, NativeLibrary, instantiate

#: Output columns per packed panel: 3 AVX-512 vectors of float32.
PANEL_WIDTH = 48
_MR = 8  # rows of x per micro-kernel call; 8 x 3 accumulators + 3 weights + 1 broadcast <= 32 registers

_KERNELS = r"""
/* mr (<= 8) rows of x times one 48-column panel, all K; while it runs, one cache line per k of
   `pf` (up to pf_len bytes: the thread's next panel) is prefetched into L2. */
static inline __attribute__((always_inline)) void CAT(ukernel_, SFX)(
        const int mr, int64_t K, const float* x, int64_t ldx, const ELEM* w, const ELEM* bias,
        ELEM* y, int64_t ldy, int ncols, const char* pf, int64_t pf_len)
{
    v16 a0[8], a1[8], a2[8];
    #pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) { a0[r] = (v16){}; a1[r] = (v16){}; a2[r] = (v16){}; }
    for (int64_t k = 0; k < K; ++k) {
        if (pf && k * 64 < pf_len) __builtin_prefetch(pf + k * 64, 0, 2);
        const ELEM* wk = w + k * 48;
        const v16 w0 = CAT(ld16_, SFX)(wk), w1 = CAT(ld16_, SFX)(wk + 16), w2 = CAT(ld16_, SFX)(wk + 32);
        #pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const float b = x[r * ldx + k];
            a0[r] += b * w0; a1[r] += b * w1; a2[r] += b * w2;
        }
    }
    v16 b0 = {}, b1 = {}, b2 = {};
    if (bias) {
        ELEM bb[48] = {0};
        for (int j = 0; j < ncols; ++j) bb[j] = bias[j];
        b0 = CAT(ld16_, SFX)(bb); b1 = CAT(ld16_, SFX)(bb + 16); b2 = CAT(ld16_, SFX)(bb + 32);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < mr; ++r) {
        ELEM* yr = y + r * ldy;
        if (ncols == 48) {
            CAT(st16_, SFX)(yr, a0[r] + b0); CAT(st16_, SFX)(yr + 16, a1[r] + b1);
            CAT(st16_, SFX)(yr + 32, a2[r] + b2);
        } else {
            ELEM t[48];
            CAT(st16_, SFX)(t, a0[r] + b0); CAT(st16_, SFX)(t + 16, a1[r] + b1);
            CAT(st16_, SFX)(t + 32, a2[r] + b2);
            memcpy(yr, t, ncols * sizeof(ELEM));
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); w: panels [ceil(N / 48), K, 48]; xf: float32 x (the
   caller's x when ELEM is float, else a scratch copy widened here). Rows go in chunks of
   ~1 MB of x so a chunk stays in L2 while every panel of the thread passes over it; the 8-row
   blocks after a panel's first one prefetch the thread's next panel, so its first block
   computes from L2 instead of waiting on memory. */
void CAT(gemm_, SFX)(const ELEM* x, float* xf, const ELEM* w, const ELEM* bias, ELEM* y,
                     int64_t M, int64_t N, int64_t K, int nthreads)
{
    const int64_t P = (N + 47) / 48;
    const int64_t panel_bytes = K * 48 * (int64_t)sizeof(ELEM);
    int64_t mc = K > 0 ? ((int64_t)(1 << 18) / K) & ~(int64_t)7 : 8;
    if (mc < 8) mc = 8;
    #pragma omp parallel num_threads(nthreads)
    {
        if ((const void*)xf != (const void*)x) {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < M * K; ++i) xf[i] = CAT(ld1_, SFX)(x + i);
        }
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t p_begin = P * tid / nth, p_end = P * (tid + 1) / nth;
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m_end = m0 + mc < M ? m0 + mc : M;
            for (int64_t p = p_begin; p < p_end; ++p) {
                const ELEM* wp = w + p * K * 48;
                const ELEM* bp = bias ? bias + p * 48 : NULL;
                const int ncols = N - p * 48 < 48 ? (int)(N - p * 48) : 48;
                const char* next = p + 1 < p_end ? (const char*)(wp + K * 48) : NULL;
                for (int64_t m = m0, blk = 0; m < m_end; m += 8, ++blk) {
                    const float* xm = xf + m * K;
                    ELEM* ym = y + m * N + p * 48;
                    const int64_t pf_off = (blk - 1) * K * 64;
                    const char* pf = next && blk > 0 && pf_off < panel_bytes ? next + pf_off : NULL;
                    const int64_t pf_len = panel_bytes - pf_off;
                    switch (m_end - m < 8 ? (int)(m_end - m) : 8) {
                    case 8: CAT(ukernel_, SFX)(8, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 7: CAT(ukernel_, SFX)(7, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 6: CAT(ukernel_, SFX)(6, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 5: CAT(ukernel_, SFX)(5, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 4: CAT(ukernel_, SFX)(4, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 3: CAT(ukernel_, SFX)(3, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    case 2: CAT(ukernel_, SFX)(2, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    default: CAT(ukernel_, SFX)(1, K, xm, K, wp, bp, ym, N, ncols, pf, pf_len); break;
                    }
                }
            }
        }
    }
}
"""

_SOURCE = PRELUDE + "#include <omp.h>\n" + instantiate(_KERNELS)
_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGS = {f"gemm_{s}": [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int] for s in DTYPE_SUFFIX.values()}
_LIB = NativeLibrary("kv_gemm", _SOURCE, _SIGS)


def available() -> bool:
    """Whether the kernels built and loaded (False with ``KVSERVE_NATIVE=0`` or no C compiler)."""
    return _LIB.available()


class PanelWeight:
    """A linear weight ``[out_features, in_features]`` packed into column panels for ``linear``.

    Attributes:
        panels: ``[ceil(out / 48), in, 48]`` contiguous CPU tensor (float32 or bfloat16), the
            padding columns zero.
        out_features, in_features: the original ``[out, in]`` shape.
    """

    __slots__ = ("panels", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in DTYPE_SUFFIX:
            raise ValueError(
                f"PanelWeight: need a 2-D CPU float32/bfloat16 weight, got "
                f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        p = -(-n // PANEL_WIDTH)
        padded = weight.new_zeros(p * PANEL_WIDTH, k)
        padded[:n] = weight.detach()
        self.panels = padded.view(p, PANEL_WIDTH, k).transpose(1, 2).contiguous()
        self.out_features, self.in_features = n, k

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def device(self) -> torch.device:
        return self.panels.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def unpack(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].clone()


def linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` ``[T, in]`` (CPU, the weight's dtype); returns ``[T, out]``.

    Raises:
        ValueError: ``x`` or ``bias`` does not match the weight in shape, dtype or device.
    """
    if (
        x.dim() != 2
        or x.shape[1] != weight.in_features
        or x.dtype != weight.dtype
        or x.device.type != "cpu"
        or (
            bias is not None
            and (bias.shape != (weight.out_features,) or bias.dtype != x.dtype or bias.device.type != "cpu")
        )
    ):
        raise ValueError(
            f"native linear: x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
            f"{tuple(weight.shape)} {weight.dtype}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.dtype)} do not fit"
        )
    m = x.shape[0]
    if weight.in_features == 0:  # an empty sum: torch gives the bias (or zeros)
        y = torch.zeros(m, weight.out_features, dtype=x.dtype)
        return y if bias is None else y + bias
    # the contiguous copies must stay referenced until the C call returns
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(m, weight.out_features, dtype=x.dtype)
    xf = x if x.dtype == torch.float32 else torch.empty(m, weight.in_features, dtype=torch.float32)
    _LIB.fn(f"gemm_{DTYPE_SUFFIX[x.dtype]}")(
        x.data_ptr(),
        xf.data_ptr(),
        weight.panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        weight.out_features,
        weight.in_features,
        torch.get_num_threads(),
    )
    return y
