"""Linear layers on CPU with kvserve's own GEMM: ``y = x @ W^T (+ b)``, the weight packed once
into column panels (``PanelWeight``). Used for float32 weights on CPUs with AVX-512F
(``linear.prepack_weight``, ``beats_onednn``); the algorithm and the layout are in
``kvserve/csrc/gemm.c``, its speed in docs/benchmarks.md (CPU kernels).

Layout: ``W [N, K]`` becomes ``panels [ceil(N / 48), K, 48]`` (zero padded): panel ``p`` holds
output columns ``48p .. 48p + 47``, the 48 weights of one input feature contiguous.
float32 and bfloat16 both work (``gemm_f32`` / ``gemm_bf16``); sums are float32.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary, check_linear_inputs

#: Output columns per packed panel: 3 AVX-512 vectors of float32.
PANEL_WIDTH = 48
_MR = 8  # rows of x per micro-kernel call; 8 x 3 accumulators + 3 weights + 1 broadcast <= 32 registers


_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGS = {f"gemm_{s}": [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int] for s in DTYPE_SUFFIX.values()}
_LIB = NativeLibrary("kv_gemm", "gemm.c", _SIGS)


def available() -> bool:
    """Whether the kernels built and loaded (False with ``KVSERVE_NATIVE=0`` or no C compiler)."""
    return _LIB.available()


def beats_onednn() -> bool:
    """Whether the panels are the host's GEMM at decode sizes: the kernels are available and the
    CPU has AVX-512F. The micro-kernel keeps 24 accumulator vectors of 16 floats in registers;
    AVX-512 has 32 such registers, while AVX2 (16 registers of 8 floats) spills them to memory
    and oneDNN's GEMM is several times faster there (docs/benchmarks.md, CPU kernels)."""
    from kvserve.ops import cpu

    return available() and cpu.has_avx512f


def packs_bfloat16() -> bool:
    """Whether ``linear.prepack_weight`` packs bfloat16 weights here for every step size (hosts
    without AMX): the panels beat oneDNN here (``beats_onednn``: AVX-512F) and the CPU has no
    bfloat16 dot product faster than its float32 FMAs -- none at all (no AVX512-BF16: oneDNN
    emulates bfloat16), or a slow one (``gemm_bf16dot.dot_beats_fma`` False). On both the panels beat oneDNN's bfloat16 matmul
    at every row count (docs/benchmarks.md, CPU kernels). Where the dot product is fast (AMD
    Zen 4) ``gemm_bf16dot.DotWeight`` takes every step instead."""
    from kvserve.ops import cpu, gemm_bf16dot

    if not beats_onednn():
        return False
    if "avx512_bf16" not in cpu.cpu_flags():
        return True
    # with AVX512-BF16: unknown speed (kernel not built, e.g. an older compiler) keeps oneDNN
    return gemm_bf16dot.available() and not gemm_bf16dot.dot_beats_fma()


#: On a CPU with AVX512-BF16 and no AMX whose build lacks the dot-product kernel (its speed
#: unknown; with the kernel and a fast dot product ``gemm_bf16dot.DotWeight`` takes every step),
#: bfloat16 steps of up to this many rows run the panels and larger ones oneDNN's dot-product
#: kernel (``PanelWeight.large``). Why: few rows are weight-bound, and the panels stream the
#: same bytes better; from a few dozen rows the step is compute-bound and oneDNN's bfloat16 dot
#: product does twice the multiply-adds per instruction; around 12-16 rows the two are level
#: (docs/benchmarks.md, CPU kernels). Up to 16 rows the panels also keep the step on the fused
#: decode step's one-call path (no Python per layer) and a batch-8 verify step on the same
#: kernel as its plain decode steps (rows round alike). Where the dot product is slow
#: (``packs_bfloat16``) the panels take every step.
BF16_DOT_MAX_ROWS = 16


class PanelWeight:
    """A linear weight ``[out_features, in_features]`` packed into column panels for ``linear``.

    Attributes:
        panels: ``[ceil(out / 48), in, 48]`` contiguous CPU tensor (float32 or bfloat16), the
            padding columns zero.
        out_features, in_features: the original ``[out, in]`` shape.
        large: None, or the weight for steps of more than ``max_rows`` rows (oneDNN's packed
            copy on CPUs whose bfloat16 dot product beats the panels there): two copies, the
            price of both speeds (as ``gemm_amx.AmxWeight``).
        max_rows: the most rows the panels take when ``large`` is set (else None: any).
    """

    __slots__ = ("panels", "out_features", "in_features", "large", "max_rows")

    def __init__(self, weight: torch.Tensor, large=None, max_rows: int | None = None):
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in DTYPE_SUFFIX:
            raise ValueError(
                f"PanelWeight: need a 2-D CPU float32/bfloat16 weight, got "
                f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        p = -(-n // PANEL_WIDTH)
        src = weight.detach()
        if n % PANEL_WIDTH:  # zero columns up to a whole panel (a copy only then: at 1B sizes a
            # second full-size temporary per weight made loading slower and its peak higher)
            src = weight.new_zeros(p * PANEL_WIDTH, k)
            src[:n] = weight.detach()
        panels = src.reshape(p, PANEL_WIDTH, k).transpose(1, 2).contiguous()
        # one input feature makes the transpose a no-op: never alias the caller's weight
        self.panels = panels.clone() if panels.data_ptr() == weight.data_ptr() else panels
        self.out_features, self.in_features = n, k
        self.large = large
        self.max_rows = max_rows if large is not None else None

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs on the panels (else on ``large``)."""
        return self.max_rows is None or rows <= self.max_rows

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
    check_linear_inputs(
        x,
        bias,
        weight.in_features,
        weight.out_features,
        (weight.dtype,),
        f"native linear, weight {tuple(weight.shape)} {weight.dtype}",
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
    _LIB.call(
        f"gemm_{DTYPE_SUFFIX[x.dtype]}",
        x,
        xf,
        weight.panels,
        bias,
        y,
        m,
        weight.out_features,
        weight.in_features,
        torch.get_num_threads(),
    )
    return y
