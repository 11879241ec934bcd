"""bfloat16 linear layers with the AVX512-BF16 dot product (``VDPBF16PS``), for CPUs that have it
but no AMX tiles: ``DotWeight`` packs a weight once, ``linear`` runs ``x @ W^T + b``. Where the
dot product outruns the float32 FMAs (``dot_beats_fma``: AMD Zen 4) it is every bfloat16
weight's only copy, for steps of any row count (``linear.prepack_weight``). Algorithm and
layout: ``kvserve/csrc/gemm_bf16dot.c``.

Layout: ``W [N, K]`` becomes ``pairs [ceil(N / 48), ceil(K / 2), 48, 2]`` bfloat16 (zero
padded), element ``[p, kp, j, e] = W[48 p + j, 2 kp + e]``. Products of bfloat16 values are
exact in float32 and summed in float32 (denormal inputs and sums flushed to zero by the
instruction); the output is rounded once to bfloat16, nearest even.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import NativeLibrary, check_linear_inputs

#: Output columns per packed panel (three 16-lane float32 accumulators per row).
PANEL_WIDTH = 48

_P, _I = ctypes.c_void_p, ctypes.c_int64
_LIB = NativeLibrary(
    "kv_gemm_bf16dot",
    "gemm_bf16dot.c",
    {"bf16dot_built": [], "bf16dot_speed": [], "bf16dot_gemm": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]},
    restypes={"bf16dot_built": ctypes.c_int, "bf16dot_speed": ctypes.c_double},
)
_built: bool | None = None
_speed: float | None = None

#: ``dot_speed()`` above which the CPU's bfloat16 dot product counts as faster than its float32
#: FMAs (``dot_beats_fma``). A CPU that issues one 512-bit VDPBF16PS per ~2 cycles against two
#: FMAs per cycle gives about 0.5, one that issues a VDPBF16PS per FMA slot about 2.0; the
#: threshold sits between the two, far from both.
DOT_FAST = 1.0


def built() -> bool:
    """Whether the library loaded and was compiled with the dot-product kernel (the compiler
    targets a CPU with AVX512-BF16; ``-march=native`` builds for this host)."""
    global _built
    if _built is None:
        if _LIB.load() is None:
            _built = False
        else:
            _built = _LIB.call("bf16dot_built") == 1
    return _built


def available() -> bool:
    """Whether ``linear`` can run here: the kernel is built (``built``) and the CPU reports
    ``avx512_bf16`` (``kvserve.ops.cpu.cpu_flags``, which tests override)."""
    from kvserve.ops import cpu

    return "avx512_bf16" in cpu.cpu_flags() and built()


def dot_speed() -> float:
    """Multiply-adds per second of this core's 512-bit ``VDPBF16PS`` over its ``VFMADD231PS``
    (both throughput-bound; best of 5 interleaved runs, measured once per process);
    0.0 where the kernel is not built."""
    global _speed
    if _speed is None:
        if not built():
            _speed = 0.0
        else:
            _speed = float(_LIB.call("bf16dot_speed"))
    return _speed


def dot_beats_fma() -> bool:
    """Whether bfloat16 dot products outrun float32 FMAs here (``dot_speed() > DOT_FAST``; False
    where the kernel is unavailable). Where they do not, a bfloat16 GEMM runs fastest on the
    float32-widening panels (``gemm``) at every row count: this kernel at its best, and
    oneDNN's bfloat16 matmul (the same instruction), stay below them."""
    return available() and dot_speed() > DOT_FAST


class DotWeight:
    """A bfloat16 linear weight ``[out_features, in_features]`` packed in input-feature pairs.

    Attributes:
        pairs: ``[ceil(out / 48), ceil(in / 2), 48, 2]`` contiguous bfloat16, zero padded.
        out_features, in_features: the original ``[out, in]`` shape.

    Raises:
        ValueError: not a 2-D CPU bfloat16 weight.
    """

    __slots__ = ("pairs", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            raise ValueError(
                f"DotWeight: need a 2-D CPU bfloat16 weight, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        p, kp = -(-n // PANEL_WIDTH), -(-k // 2)
        src = weight.detach()
        if n % PANEL_WIDTH or k % 2:  # a zero-padded copy only then: 1B-class widths need none,
            # and a second full-size temporary per weight raises the load's peak memory
            src = weight.new_zeros(p * PANEL_WIDTH, kp * 2)
            src[:n, :k] = weight.detach()
        # [p, 48 cols, kp, 2] -> [p, kp, 48 cols, 2]
        pairs = src.reshape(p, PANEL_WIDTH, kp, 2).transpose(1, 2).contiguous()
        # a single pair makes the transpose a no-op: never alias the caller's weight
        self.pairs = pairs.clone() if pairs.data_ptr() == weight.data_ptr() else pairs
        self.out_features, self.in_features = n, k

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.pairs.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def unpack(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (a copy)."""
        p, kp = self.pairs.shape[:2]
        w = self.pairs.transpose(1, 2).reshape(p * PANEL_WIDTH, kp * 2)
        return w[: self.out_features, : self.in_features].clone()


def linear(x: torch.Tensor, weight: DotWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for bfloat16 ``x`` ``[T, in]``; returns ``[T, out]`` bfloat16.

    Raises:
        ValueError: ``x`` or ``bias`` does not match the weight in shape, dtype or device.
        RuntimeError: the kernel is not available here (check ``available()``).
    """
    check_linear_inputs(
        x,
        bias,
        weight.in_features,
        weight.out_features,
        (torch.bfloat16,),
        f"bf16dot linear, weight {tuple(weight.shape)}",
    )
    if not built():
        raise RuntimeError("the AVX512-BF16 dot-product GEMM is not built for this CPU")
    m, k = x.shape
    if k == 0:  # an empty sum: torch gives the bias (or zeros)
        y = torch.zeros(m, weight.out_features, dtype=x.dtype)
        return y if bias is None else y + bias
    x = x.contiguous()  # referenced until the call returns
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(m, weight.out_features, dtype=torch.bfloat16)
    _LIB.call(
        "bf16dot_gemm",
        x,
        weight.pairs,
        bias,
        y,
        m,
        weight.out_features,
        k,
        torch.get_num_threads(),
    )
    return y
