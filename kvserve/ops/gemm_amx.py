"""bfloat16 linear layers for decode-sized steps (up to ``MAX_ROWS`` tokens) on Intel AMX tiles.

``AmxWeight`` packs a weight once into the tile layout; ``linear`` runs ``x @ W^T + b``.
``available()`` is True only where the kernel built with AMX and Linux granted this process the
tile state. Layout and kernel: ``kvserve/csrc/amx_gemm.c``; its speed: docs/benchmarks.md (CPU
kernels).

Layout: ``W [N, K]`` (``K % 32 == 0``; ``N`` padded to a multiple of 32 with zero rows) becomes
``tiles [N / 32, K / 32, 2, 16, 16, 2]``, element ``[g, kc, t, kp, n, e] =
W[32 g + 16 t + n, 32 kc + 2 kp + e]``. Accumulation is float32, outputs rounded to nearest even.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve import envs
from kvserve.ops.library import NativeLibrary, check_linear_inputs

#: Output columns per group (two 16-column B tiles) and input features per tile (32 bf16).
GROUP_COLS = 32
K_TILE = 32
#: Most rows (tokens) ``linear.linear`` sends here; larger steps (prefill) go to oneDNN, which
#: blocks for cache reuse across many rows: this kernel wins up to 64 rows, is level around 128
#: and loses beyond (``benchmarks/gemm_micro.py --dtype bfloat16 --kernel amx``;
#: docs/benchmarks.md, CPU kernels).
MAX_ROWS = 64

#: Environment variable: ``0`` keeps bfloat16 linear layers off this kernel (``linear.prepack_weight``
#: packs them as on a CPU without AMX: the panels and/or oneDNN), for A/B comparisons and tests
#: of those paths on an AMX host; the tiles stay available to attention and the quantized
#: kernels (their own switches: ``KVSERVE_ATTENTION_AMX``, ``KVSERVE_QUANT_AMX``).
GEMM_ENV = "KVSERVE_GEMM_AMX"
#: ``$KVSERVE_GEMM_AMX`` is not ``0`` (read once, at import).
USE_FOR_GEMM: bool = envs.KVSERVE_GEMM_AMX

_P, _I = ctypes.c_void_p, ctypes.c_int64
_LIB = NativeLibrary(
    "kv_amx_gemm",
    "amx_gemm.c",
    {
        "amx_init": [],
        "amx_gemm_bf16": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int],
    },
    restypes={"amx_init": ctypes.c_int},
)
_ready: bool | None = None


def available() -> bool:
    """True when the kernel is built and this CPU and kernel let the process use AMX tiles."""
    global _ready
    if _ready is None:
        lib = _LIB.load()
        if lib is None:
            _ready = False
        else:
            _ready = _LIB.call("amx_init") == 0
    return _ready


class AmxWeight:
    """A bfloat16 linear weight ``[out_features, in_features]`` in the AMX tile layout.

    Attributes:
        tiles: ``[ceil(out / 32), in / 32, 2, 16, 16, 2]`` bfloat16, zero padded columns.
        out_features, in_features: the original shape.
        large: the weight for steps of more than ``MAX_ROWS`` rows (``large=`` argument, e.g.
            oneDNN's prepacked copy; the plain ``weight`` by default).

    Raises:
        ValueError: not a 2-D CPU bfloat16 weight, or ``in_features`` not a positive multiple
            of 32.
    """

    __slots__ = ("tiles", "out_features", "in_features", "large")

    def __init__(self, weight: torch.Tensor, large: torch.Tensor | None = None):
        if (
            weight.dim() != 2
            or weight.device.type != "cpu"
            or weight.dtype != torch.bfloat16
            or weight.shape[1] % K_TILE
            or weight.shape[1] == 0
        ):
            raise ValueError(
                f"AmxWeight: need a 2-D CPU bfloat16 weight with in_features a positive "
                f"multiple of {K_TILE}, got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        g = -(-n // GROUP_COLS)
        padded = weight.new_zeros(g * GROUP_COLS, k)
        padded[:n] = weight.detach()
        # [g, 2 tiles, 16 cols, kc, 16 pairs, 2] -> [g, kc, 2 tiles, 16 pairs, 16 cols, 2]
        self.tiles = padded.view(g, 2, 16, k // K_TILE, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
        self.out_features, self.in_features = n, k
        self.large = weight if large is None else large

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def unpack(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight (a copy)."""
        g, kc = self.tiles.shape[:2]
        w = self.tiles.permute(0, 2, 4, 1, 3, 5).reshape(g * GROUP_COLS, kc * K_TILE)
        return w[: self.out_features].clone()


def linear(x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for bfloat16 ``x`` ``[T, in]``; returns ``[T, out]`` bfloat16.

    Raises:
        ValueError: ``x`` or ``bias`` does not match the weight.
        RuntimeError: AMX is not available (check ``available()``).
    """
    check_linear_inputs(
        x,
        bias,
        weight.in_features,
        weight.out_features,
        (torch.bfloat16,),
        f"amx linear, weight {tuple(weight.shape)}",
    )
    if not available():
        raise RuntimeError("AMX tiles are not available in this process")
    x = x.contiguous()  # referenced until the call returns
    bias = None if bias is None else bias.contiguous()
    m, k = x.shape
    y = torch.empty(m, weight.out_features, dtype=torch.bfloat16)
    _LIB.call(
        "amx_gemm_bf16",
        x,
        weight.tiles,
        bias,
        y,
        m,
        weight.out_features,
        k,
        torch.get_num_threads(),
    )
    return y
