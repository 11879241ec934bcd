"""Linear layers and embedding lookups on GGUF block-quantized weights (``QuantWeight``).

The weight stays in llama.cpp's block layout (``kvserve/csrc/quant_gemm.c`` gives the formats
and the algorithm): ``[out_features, row_bytes(qtype, in_features)]`` uint8, one row per
output feature, so a row permutation (llama.cpp's q/k order) is a plain row gather. The C
kernels dequantize in registers; without them (``KVSERVE_NATIVE=0``, no compiler) the torch
fallback dequantizes the weight on every call (slow, but the same values).

Activations are float32 or bfloat16; sums are float32. Two ways to multiply them
(``activation_mode``, env ``KVSERVE_QUANT_ACT``):

- ``float``: the activations stay float; the result is dequantize-then-matmul up to float32
  rounding.
- ``int8`` (the default where the kernels use AVX-512 VNNI; Q8_0 / Q4_0 / Q4_1 weights only,
  the K-quants always run ``float``): below ``PANEL_ROWS`` rows each activation row is
  quantized per 32 elements as llama.cpp's Q8 activations (``quantize_activations``) and
  multiplied with integer dot products, which changes the numerics by that rounding.

Q8_0 and Q4_1 weights in the ``int8`` mode run on a copy of their bytes repacked for the int8
GEMV (``QuantWeight.x4``, ``pack_x4``: four rows interleaved per block, scales apart,
``csrc/quant_x4.h``), built at load (``prepare``) or on first use: ``act8`` / ``act16`` on
them read it (the kernels ``act8_gguf`` / ``act16_gguf`` force the GGUF-layout ones, for
comparisons; ``KVSERVE_QUANT_X4=0`` makes Q4_1's default ones the GGUF-layout kernels again).
A Q8_0 weight keeps ``data`` beside it (the embedding lookup, the panels and the float mode
read it: the weight's bytes once more in memory). A Q4_1 GEMM weight keeps only the x4 copy
(``QuantWeight.drop_gguf``; the same size as the GGUF bytes): its panels read x4 too, and a
kernel of the GGUF layout (the float mode's) rebuilds ``data`` on first use.

The LM head (``head_kernel``) never reads one int8 plane: in the ``int8`` mode it runs
``act16``, the activations as two int8 planes (``quantize_activations2``: the rounding residual
quantized again on a 254 times finer step, ~2^-16 of each block's largest value, finer than
bfloat16), whose integer dot products stream the weights about twice as fast as the
float-activation kernel; in the ``float`` mode the float kernel.

Many rows on AMX (``amx_enabled()``: the ``int8`` mode, a CPU and kernel build with AMX tiles,
``$KVSERVE_QUANT_AMX`` not ``0``): from ``AMX_ROWS[qtype]`` rows (Q4_1 8, Q8_0 12, else
``PANEL_ROWS``; where the int8 GEMV's cost, growing with each row, passes the AMX kernel's) the
``amx`` kernel (``csrc/quant_amx.h``) dequantizes each group of 32 weight rows once per call
into bfloat16 AMX tiles (w = d q + m in float32, rounded to nearest even) and multiplies them
with TDPBF16PS against the activations rounded to bfloat16, float32 sums (Intel's AMX
programming reference). Its error against float64 dequantize-then-matmul is at most
``(2 u + u^2) sum |x w| + (K + 1) 2^-24 sum |x w|`` per output (``u = 2^-8``; ``u`` alone for
bfloat16 x), plus ``u |y|`` for a bfloat16 output (tests/ops/test_quant_amx.py). It reads
the GGUF bytes, or a Q4_1 weight's x4 copy when that is all it holds. It outruns both the
bfloat16 AMX kernel (fewer bytes per weight) and the float32 panels at 8-64 rows
(benchmarks/quantized.py --layer-kernels; docs/benchmarks.md, CPU kernels).

Many rows with AVX-512 VNNI and no AMX (``vnni_enabled``: the ``int8`` mode, Q8_0 and Q4_1 on
their x4 copy, ``$KVSERVE_QUANT_VNNI`` not ``0``): from ``VNNI_ROWS[qtype]`` rows (Q8_0 6, Q4_1
8) the ``vnni`` kernel (``csrc/quant_vnni.h``) repacks each 48 weight rows once per call (per
~256 KB of activation rows) into int8 panels whose vector lanes are output features and sums
the int8 activations (the act8 kernels' per-32-block quantization) times the weight bytes
exactly with vpdpbusd, one conversion and scaling per block: the act8 numerics, with more
multiply-adds per instruction than the float panels. The LM head keeps ``act16`` / the
panels (``head_kernel``). bfloat16 activations take it only below ``PANEL_ROWS`` rows
(``VNNI_BF16_MAX_ROWS``): a bfloat16 prefill on int8 activations missed the documented 1% of
the float model's perplexity (tests/model_executor/test_int8_quantization.py), so from ``PANEL_ROWS``
rows a bfloat16 step keeps float activations on the panels.

Otherwise (the ``float`` mode, other weight types, no AMX nor VNNI, or both switched off), from
``PANEL_ROWS`` rows on the weights are dequantized once per call into float32 panels and a float
micro-kernel runs (float activations).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from kvserve import envs
from kvserve.ops import gemm_amx
from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary, check_linear_inputs

#: Weights per block of the 32-weight types (the unit of ``quantize_q8_0``).
BLOCK_ELEMS = 32
#: Supported GGUF types (lower-case ggml names) -> bytes per block.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176, "q6_k": 210}
#: Weights per block: 32, or 256 for the K-quants' superblocks.
BLOCK_WEIGHTS = {t: 256 if t.endswith("_k") else 32 for t in BLOCK_BYTES}


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights (a multiple of ``BLOCK_WEIGHTS[qtype]``)."""
    return in_features // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]


_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGS: dict[str, list] = {}
for _t in BLOCK_BYTES:
    for _s in DTYPE_SUFFIX.values():
        _SIGS[f"quant_gemm_{_t}_{_s}"] = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
        _SIGS[f"quant_rows_{_t}_{_s}"] = [_P, _P, _I, _I, _P, ctypes.c_int]
        _SIGS[f"quant_gemm_panel_{_t}_{_s}"] = _SIGS[f"quant_gemm_{_t}_{_s}"]
        if _t in ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k"):
            _SIGS[f"quant_gemm_act8_{_t}_{_s}"] = _SIGS[f"quant_gemm_{_t}_{_s}"]
            _SIGS[f"quant_gemm_act16_{_t}_{_s}"] = _SIGS[f"quant_gemm_{_t}_{_s}"]
for _s in DTYPE_SUFFIX.values():
    for _t in ("q8_0", "q4_1"):
        _SIGS[f"quant_gemm_act8x4_{_t}_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
        _SIGS[f"quant_gemm_act16x4_{_t}_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
    _SIGS[f"quant_gemm_panelx4_q4_1_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
    _SIGS[f"quant_gemm_amxx4_q4_1_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
    for _t in ("q8_0", "q4_1"):
        _SIGS[f"quant_gemm_vnnix4_{_t}_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
    for _t in BLOCK_BYTES:
        _SIGS[f"quant_gemm_amx_{_t}_{_s}"] = _SIGS[f"quant_gemm_q8_0_{_s}"]
_SIGS["quant_amx_built"] = []
_SIGS["quant_act8_isa"] = []
_SIGS["quant_x4_set_prefetch"] = [ctypes.c_int]
_SIGS["quant_stream_read"] = [_P, _I, ctypes.c_int, _I]
_LIB = NativeLibrary("kv_quant_gemm", "quant_gemm.c", _SIGS)


#: Weight types with an int8-activation kernel (Q4_K / Q6_K on their GGUF layout:
#: ``csrc/quant_dot8_k.h``).
ACT8_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
#: Rows from which ``linear`` runs the dequantized-panel kernel (benchmarks/quantized.py
#: --kernels: the register-dequantizing kernels win below, the panels from here on).
PANEL_ROWS = 16
#: Environment variable choosing the activation mode (``float`` or ``int8``; unset: the default).
ACT_ENV = "KVSERVE_QUANT_ACT"
ACT_MODES = ("float", "int8")
_KERNELS = ("tile", "act8", "act16", "panel", "amx", "vnni", "act8_gguf", "act16_gguf")
#: Kernels on int8 activations (``ACT8_TYPES`` only).
_INT8_KERNELS = ("act8", "act16", "act8_gguf", "act16_gguf")
#: Weight rows per group of the x4 layout (``pack_x4``).
X4_ROWS = 4
#: Types with an x4 layout (``pack_x4``) that ``act8`` / ``act16`` read.
X4_TYPES = ("q8_0", "q4_1")
#: Environment variable: ``0`` keeps Q4_1 weights on their GGUF-layout int8 kernels (no x4 copy;
#: for comparisons), anything else or unset: the x4 layout.
X4_ENV = "KVSERVE_QUANT_X4"


#: Rows from which ``linear`` runs the AMX kernel (weights dequantized into bfloat16 tiles,
#: ``csrc/quant_amx.h``) where ``amx_enabled()``, per weight type. Its cost hardly grows with
#: the rows below ~32 (the dequantization is the work) while the int8 GEMV's grows with each row;
#: the values are where the two are level on the 30 layers of SmolLM2-135M
#: (benchmarks/quantized.py --layer-kernels; docs/benchmarks.md, CPU kernels). The other types
#: have no x4 GEMV and keep ``PANEL_ROWS``.
AMX_ROWS = {t: {"q4_1": 8, "q8_0": 12}.get(t, PANEL_ROWS) for t in BLOCK_BYTES}
#: Weight types the AMX kernel serves (every type: it dequantizes with the float kernels' code).
AMX_TYPES = tuple(AMX_ROWS)
#: Environment variable: ``0`` turns the AMX kernel off (the float panels run from
#: ``PANEL_ROWS`` rows, as on a CPU without AMX; for A/B comparisons), unset or anything else: on
#: where ``amx_supported()``.
AMX_ENV = "KVSERVE_QUANT_AMX"
#: Rows from which ``linear`` runs the VNNI kernel where ``vnni_enabled``: its cost grows
#: slowly with the rows (the per-call repack of the weights is the fixed part) while the x4
#: GEMV's grows with each row; the values sit just past where the two are level on
#: SmolLM2-135M's GEMM shapes (bfloat16 x, the no-AMX Xeon; docs/benchmarks.md, CPU kernels),
#: and from there the VNNI kernel pulls ahead of both the GEMV and the float panels.
VNNI_ROWS = {"q8_0": 6, "q4_1": 8}
#: Weight types of the VNNI many-row kernel (``csrc/quant_vnni.h``: it reads the x4 layout).
VNNI_TYPES = tuple(VNNI_ROWS)
#: Most rows of bfloat16 activations ``pick_kernel`` gives the VNNI kernel; more (prefill) run
#: the float panels. Why: int8 activations on top of bfloat16 rounding put the default model's
#: prefill perplexity past the documented 1% of the float model's (by how much depends on the
#: attention kernel's rounding; tests/model_executor/test_int8_quantization.py), while float
#: activations stay well within it, and so did the same int8 numerics over one-row decode
#: steps (act8). float32 activations take it at any row count.
VNNI_BF16_MAX_ROWS = PANEL_ROWS - 1
#: Environment variable: ``0`` turns the VNNI many-row kernel off (the float panels run from
#: ``PANEL_ROWS`` rows; for A/B comparisons), unset or anything else: on where ``vnni_enabled()``.
VNNI_ENV = "KVSERVE_QUANT_VNNI"


def available() -> bool:
    """Whether the kernels built and loaded (False with ``KVSERVE_NATIVE=0`` or no C compiler)."""
    return _LIB.available()


_isa: str | None = None


def act8_isa() -> str | None:
    """The int8 dot product the kernels were built with: ``"avx512-vnni"``, ``"avx2"``,
    ``"scalar"``, or None without the kernels (asked once: ``pick_kernel`` reads it per call)."""
    global _isa
    if _isa is None and available():
        fn = _LIB.fn("quant_act8_isa")
        fn.restype = ctypes.c_int
        _isa = {2: "avx512-vnni", 1: "avx2"}.get(int(fn()), "scalar")
    return _isa


_amx_ok: bool | None = None


def amx_supported() -> bool:
    """Whether the AMX kernel can run here: the kernels built with AMX and this CPU and Linux
    grant the process the tile state (``gemm_amx.available()``)."""
    global _amx_ok
    if _amx_ok is None:
        _amx_ok = False
        if available() and gemm_amx.available():
            fn = _LIB.fn("quant_amx_built")
            fn.restype = ctypes.c_int
            _amx_ok = int(fn()) == 1
    return _amx_ok


def amx_enabled() -> bool:
    """Whether ``pick_kernel`` chooses the AMX kernel from ``AMX_ROWS`` rows: in the ``int8``
    activation mode (the ``float`` mode keeps dequantize-then-matmul up to float32 rounding; the
    AMX kernel rounds weights and activations to bfloat16, finer than the int8 mode's activation
    quantization), where ``amx_supported()`` and ``$KVSERVE_QUANT_AMX`` is not ``0``."""
    return envs.KVSERVE_QUANT_AMX and activation_mode() == "int8" and amx_supported()


def vnni_enabled(qtype: str) -> bool:
    """Whether ``pick_kernel`` chooses the VNNI many-row kernel (``csrc/quant_vnni.h``: int8
    activations, integer sums) from ``VNNI_ROWS[qtype]`` rows of a ``qtype`` weight (bfloat16
    activations: up to ``VNNI_BF16_MAX_ROWS`` rows): in the
    ``int8`` mode, kernels built with AVX-512 VNNI, ``qtype`` in ``VNNI_TYPES`` (Q4_1 while
    ``x4_enabled()``: the kernel reads the x4 copy), and ``$KVSERVE_QUANT_VNNI`` not ``0``. AMX,
    where enabled, comes first (``pick_kernel``). The many-row numerics are then the act8
    kernels' (the same int8 activations) instead of the float panels'."""
    return (
        qtype in VNNI_TYPES
        and (qtype == "q8_0" or x4_enabled())
        and envs.KVSERVE_QUANT_VNNI
        and activation_mode() == "int8"
        and act8_isa() == "avx512-vnni"
    )


_default_mode: str | None = None


def activation_mode() -> str:
    """``"int8"`` or ``"float"``: ``$KVSERVE_QUANT_ACT`` when set, else ``"int8"`` where the
    kernels use AVX-512 VNNI and ``"float"`` elsewhere (re-read when the variable changes).

    Raises:
        ValueError: ``KVSERVE_QUANT_ACT`` set to something other than ``float`` / ``int8``.
    """
    global _default_mode
    mode: str | None = envs.KVSERVE_QUANT_ACT  # parsed: "float" / "int8" / None
    if mode is not None:
        return mode
    if _default_mode is None:
        _default_mode = "int8" if act8_isa() == "avx512-vnni" else "float"
    return _default_mode


class QuantWeight:
    """A linear (or embedding) weight ``[out_features, in_features]`` in GGUF blocks.

    Args:
        data: ``[out_features, in_features / 32 * BLOCK_BYTES[qtype]]`` uint8 CPU tensor.
        qtype: a key of ``BLOCK_BYTES``.
        in_features: weights per row (a multiple of ``BLOCK_WEIGHTS[qtype]``: 32, or 256 for
            the K-quants).

    Raises:
        ValueError: unknown ``qtype``, ``in_features`` not a multiple of the block, or ``data``
            of the wrong dtype, device or row length.
    """

    __slots__ = ("_data", "qtype", "out_features", "in_features", "_x4")

    def __init__(self, data: torch.Tensor, qtype: str, in_features: int):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"QuantWeight: type {qtype!r} is not one of {sorted(BLOCK_BYTES)}")
        block = BLOCK_WEIGHTS[qtype]
        if in_features <= 0 or in_features % block:
            raise ValueError(
                f"QuantWeight: {qtype} in_features={in_features} is not a positive multiple of {block}"
            )
        nbytes = row_bytes(qtype, in_features)
        if (
            data.dtype != torch.uint8
            or data.dim() != 2
            or data.shape[1] != nbytes
            or data.device.type != "cpu"
        ):
            raise ValueError(
                f"QuantWeight: {qtype} data must be a CPU uint8 [out, {nbytes}] tensor, got "
                f"{tuple(data.shape)} {data.dtype} on {data.device}"
            )
        self._data: torch.Tensor | None = data.contiguous()
        self.qtype = qtype
        self.out_features, self.in_features = int(data.shape[0]), int(in_features)
        self._x4: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor:
        """The GGUF-layout bytes ``[out_features, row_bytes]`` uint8. After ``drop_gguf`` they
        are rebuilt from the x4 copy on first use (``unpack_x4``) and kept again."""
        if self._data is None:
            assert self._x4 is not None
            self._data = unpack_x4(self._x4, self.qtype, self.out_features, self.in_features)
        return self._data

    @property
    def x4(self) -> torch.Tensor:
        """The bytes repacked for the int8 GEMV (``pack_x4``; Q8_0 and Q4_1), made on first use
        and kept (``data`` must not change afterwards).

        Raises:
            ValueError: not a type of ``X4_TYPES``.
        """
        if self._x4 is None:
            if self.qtype not in X4_TYPES:
                raise ValueError(f"QuantWeight.x4: only {list(X4_TYPES)} weights repack, not {self.qtype}")
            self._x4 = pack_x4(self.data, self.qtype, self.in_features)
        return self._x4

    def drop_gguf(self) -> None:
        """Keep only the x4 copy of a Q4_1 weight (made here if missing), freeing the GGUF bytes:
        the int8 kernels and the panels read x4 (the float tile kernel and the embedding lookup
        would rebuild ``data``). No-op for other types (Q8_0's panels read ``data``)."""
        if self.qtype == "q4_1":
            self.x4  # noqa: B018 (made and kept)
            self._data = None

    @property
    def layout(self) -> str:
        """Which copies the weight holds: ``"gguf"``, ``"gguf+x4"`` or ``"x4"``."""
        if self._data is None:
            return "x4"
        return "gguf" if self._x4 is None else "gguf+x4"

    @property
    def resident_bytes(self) -> int:
        """Bytes of the copies held (``data`` and / or ``x4``)."""
        return sum(t.numel() for t in (self._data, self._x4) if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # (checked at construction; not ``data``: that may be rebuilt)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        """Bytes of one copy in the GGUF layout (what one pass over the weight reads)."""
        return self.out_features * row_bytes(self.qtype, self.in_features)


def _x4_views(out: np.ndarray, qtype: str, g: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """The quant and scale regions of x4 bytes ``out`` (uint8 numpy) as ``[g, nb, 4]`` items of
    a row's block quants (``V32`` / ``V16``) and ``[g, nb, s, 4]`` int16 (Q8_0: ``s = 1``, d; Q4_1:
    ``s = 2``, d then m): copies item by item, not byte by byte (far faster at load than torch's
    byte-strided copies)."""
    qb, ns = (32, 1) if qtype == "q8_0" else (16, 2)
    nq = g * nb * X4_ROWS * qb
    return out[:nq].view(f"V{qb}").reshape(g, nb, X4_ROWS), out[nq:].view("<i2").reshape(g, nb, ns, X4_ROWS)


def _gguf_views(b: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks ``b`` ``[n, nb * BLOCK_BYTES]`` uint8 (numpy) as their quants ``[n, nb]`` items
    and their header ``[n, nb, s]`` int16 (d, and m for Q4_1), as ``_x4_views``'s."""
    n, nb = b.shape[0], b.shape[1] // BLOCK_BYTES[qtype]
    if qtype == "q8_0":
        blk = b.view(np.dtype([("d", "<i2"), ("q", "V32")])).reshape(n, nb)
        return blk["q"], blk["d"][..., None]
    blk = b.view(np.dtype([("dm", "<i2", (2,)), ("q", "V16")])).reshape(n, nb)
    return blk["q"], blk["dm"]


def pack_x4(data: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The x4 layout (``csrc/quant_x4.h``) of Q8_0 or Q4_1 blocks ``data``
    ``[n, in_features / 32 * BLOCK_BYTES[qtype]]``: 1-D uint8 of
    ``ceil(n / 4) * (in_features / 32) * 4 * BLOCK_BYTES[qtype]`` bytes, per group of 4 rows and
    block the 4 rows' quants (Q8_0: 32 bytes each, plus 128; Q4_1: the 16 GGUF nibble bytes
    each), then every group's float16 scales (Q8_0: 4 d per block; Q4_1: 4 d, then 4 m); rows
    past ``n`` are zero weights.

    Raises:
        ValueError: ``qtype`` not in ``X4_TYPES``.
    """
    if qtype not in X4_TYPES:
        raise ValueError(f"pack_x4: {qtype} has no x4 layout (only {list(X4_TYPES)})")
    n, nb, bb = data.shape[0], in_features // BLOCK_ELEMS, BLOCK_BYTES[qtype]
    g, full = (n + X4_ROWS - 1) // X4_ROWS, n // X4_ROWS
    out = torch.empty(g * nb * X4_ROWS * bb, dtype=torch.uint8)
    q, d = _x4_views(out.numpy(), qtype, g, nb)
    bq, bd = _gguf_views(data.contiguous().numpy().reshape(n, nb * bb), qtype)
    # strided views straight into the output: no weight-sized temporaries (load RSS)
    q[:full] = bq[: full * X4_ROWS].reshape(full, X4_ROWS, nb).transpose(0, 2, 1)
    d[:full] = bd[: full * X4_ROWS].reshape(full, X4_ROWS, nb, d.shape[2]).transpose(0, 2, 3, 1)
    if full < g:  # the last, partial group: zero weights in the rows past n
        r = n - full * X4_ROWS
        q[full] = np.zeros(1, q.dtype)
        d[full] = 0
        q[full, :, :r] = bq[full * X4_ROWS :].T
        d[full, :, :, :r] = bd[full * X4_ROWS :].transpose(1, 2, 0)
    if qtype == "q8_0":
        out[: g * nb * X4_ROWS * 32].bitwise_xor_(128)  # q + 128 as a byte
    return out


def unpack_x4(x4: torch.Tensor, qtype: str, n: int, in_features: int) -> torch.Tensor:
    """The GGUF blocks ``[n, in_features / 32 * BLOCK_BYTES[qtype]]`` uint8 of x4 bytes ``x4``
    (the inverse of ``pack_x4``; a new tensor)."""
    nb, bb = in_features // BLOCK_ELEMS, BLOCK_BYTES[qtype]
    g = (n + X4_ROWS - 1) // X4_ROWS
    q, d = _x4_views(x4.numpy(), qtype, g, nb)
    out = torch.empty(g * X4_ROWS, nb * bb, dtype=torch.uint8)
    oq, od = _gguf_views(out.numpy(), qtype)
    # (splitting the first dimension: views, so the assignments land in ``out``)
    oq.reshape(g, X4_ROWS, nb)[:] = q.transpose(0, 2, 1)
    od.reshape(g, X4_ROWS, nb, d.shape[2])[:] = d.transpose(0, 3, 1, 2)
    if qtype == "q8_0":
        out.view(g * X4_ROWS, nb, bb)[..., 2:] ^= 128
    return out[:n].contiguous()


def x4_enabled() -> bool:
    """Whether Q4_1 weights use the x4 layout (``$KVSERVE_QUANT_X4`` is not ``0``)."""
    return envs.KVSERVE_QUANT_X4


def prepare(weight: QuantWeight, gemm_only: bool = True) -> None:
    """Make at load what the kernels of the current mode will read, so the first decode step
    does not pay for it: in the ``int8`` mode the x4 copy of a Q8_0 weight (kept beside
    ``data``: the panels read that), and of a Q4_1 one, whose GGUF bytes are then freed when
    ``gemm_only`` (nothing but the int8 kernels and the panels reads the weight; False for a
    table that is also an embedding, whose lookup reads ``data``) and ``x4_enabled()``."""
    if not available() or activation_mode() != "int8":
        return
    if weight.qtype == "q8_0":
        weight.x4  # noqa: B018 (made and kept)
    elif weight.qtype == "q4_1" and x4_enabled():
        if gemm_only:
            weight.drop_gguf()
        else:
            weight.x4  # noqa: B018


def dequantize_blocks(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 ``[rows, blocks * 32]`` from ``data`` ``[rows, blocks * BLOCK_BYTES[qtype]]`` uint8
    (the torch reference of the kernels' dequantization)."""
    rows = data.shape[0]
    if BLOCK_WEIGHTS[qtype] != 32:  # K-quants: the gguf package's numpy reference
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        arr = gguf_dequantize(data.numpy(), GGMLQuantizationType[qtype.upper()])
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(rows, -1)
    b = data.reshape(rows, -1, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if qtype == "q8_0":
        q = b[..., 2:34].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, -1)
    qs = b[..., (4 if qtype == "q4_1" else 2) :]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()
    if qtype == "q4_0":
        return ((q - 8) * d).reshape(rows, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (q * d + m).reshape(rows, -1)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight (a new tensor)."""
    return dequantize_blocks(weight.data, weight.qtype)


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """``weight`` ``[out, in]`` (float, CPU) as Q8_0 blocks: per 32 weights a float16 scale
    ``d = max|w| / 127`` and ``q = round(w / d)``, bit-identical to ggml's reference Q8_0
    quantizer (the ``gguf`` package's), so each weight is off by at most ``d / 2`` (plus the
    scale's float16 rounding).

    Raises:
        ValueError: not a 2-D CPU float tensor, or ``in`` not a positive multiple of 32.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.device.type != "cpu":
        raise ValueError(
            f"quantize_q8_0: need a 2-D CPU float weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    n, k = weight.shape
    if k <= 0 or k % BLOCK_ELEMS:
        raise ValueError(f"quantize_q8_0: in_features={k} is not a positive multiple of {BLOCK_ELEMS}")
    blocks = weight.detach().float().reshape(n, k // BLOCK_ELEMS, BLOCK_ELEMS)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros((), dtype=torch.float32))
    scaled = blocks * inv  # rounded half away from zero, as ggml's reference quantizer
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
    data = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1)
    return QuantWeight(data, "q8_0", k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activations of the ``int8`` mode (the torch reference of the kernels' step):
    per row and 32 elements ``d = max|x| / 127`` (float32), ``q = round(x * (1 / d))`` (to
    nearest even; 0 where ``d`` is 0, subnormal (``1 / d`` would overflow: the block counts as
    zero) or not finite: ``d`` NaN for a block holding a NaN, inf for one holding an infinity, so
    the products of that row are NaN).

    Args:
        x: ``[T, K]`` float32 or bfloat16, ``K`` a multiple of 32.

    Returns:
        ``q`` ``[T, K]`` int8 and ``d`` ``[T, K / 32]`` float32 (``x ~= q * d`` per block).
    """
    t, k = x.shape
    blocks = x.float().reshape(t, k // BLOCK_ELEMS, BLOCK_ELEMS)
    d = blocks.abs().amax(dim=-1) / 127  # (amax propagates NaN)
    ok = (d >= torch.finfo(torch.float32).tiny) & torch.isfinite(d)
    inv = torch.where(ok, 1.0 / d, torch.zeros((), dtype=torch.float32))
    zero = torch.zeros((), dtype=torch.float32)
    q = torch.round(torch.where(ok.unsqueeze(-1), blocks * inv.unsqueeze(-1), zero)).to(torch.int8)
    return q.reshape(t, k), d


def quantize_activations2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two int8 planes of the ``act16`` kernels (the torch reference of the kernels' step):
    ``q, d = quantize_activations(x)``, then the residual ``r = x - q * d`` rounded on the step
    ``d / 254``: ``q2 = clamp(round(r * 254 / d), -127, 127)``, so ``x ~= d * (q + q2 / 254)``
    to within ``d / 508`` per element.

    Args:
        x: ``[T, K]`` float32 or bfloat16, ``K`` a multiple of 32.

    Returns:
        ``q``, ``q2`` ``[T, K]`` int8 and ``d`` ``[T, K / 32]`` float32.
    """
    t, k = x.shape
    q, d = quantize_activations(x)
    blocks = x.float().reshape(t, k // BLOCK_ELEMS, BLOCK_ELEMS)
    r = blocks - q.float().reshape(blocks.shape) * d.unsqueeze(-1)
    ok = (d >= torch.finfo(torch.float32).tiny) & torch.isfinite(d)  # (else q = q2 = 0)
    inv = torch.where(ok, 254.0 / d, torch.zeros((), dtype=torch.float32))
    r = torch.where(ok.unsqueeze(-1), r * inv.unsqueeze(-1), torch.zeros((), dtype=torch.float32))
    q2 = torch.round(r).clamp(-127, 127).to(torch.int8)
    return q, q2.reshape(t, k), d


def head_kernel(rows: int, qtype: str) -> str | None:
    """The kernel of the LM head (``compute_logits``) for ``rows`` rows of a ``qtype`` weight:
    never one int8 plane, so ``"act16"`` / ``"panel"`` (below / from ``PANEL_ROWS`` rows) where
    ``pick_kernel`` picks ``"vnni"``; None (``pick_kernel``) where that picks ``"amx"`` or from
    ``PANEL_ROWS`` rows (the panels); else ``"act16"`` in the ``int8`` mode on ``ACT8_TYPES`` and
    ``"tile"`` otherwise."""
    kind = pick_kernel(rows, qtype)
    if kind == "vnni":  # (one int8 plane: act16's two, or the panels' float activations)
        return "act16" if rows < PANEL_ROWS else "panel"
    if rows >= PANEL_ROWS or kind == "amx":
        return None
    return "act16" if qtype in ACT8_TYPES and activation_mode() == "int8" else "tile"


def pick_kernel(rows: int, qtype: str, dtype: torch.dtype = torch.float32) -> str:
    """Which kernel ``linear`` runs for ``rows`` activation rows of ``dtype`` on a ``qtype``
    weight: ``"amx"`` from ``AMX_ROWS[qtype]`` rows where ``amx_enabled()``, ``"vnni"`` from
    ``VNNI_ROWS[qtype]`` rows where ``vnni_enabled(qtype)`` (bfloat16: up to
    ``VNNI_BF16_MAX_ROWS`` rows), ``"panel"`` from ``PANEL_ROWS`` rows, else ``"act8"`` in the
    ``int8`` mode on ``ACT8_TYPES``, else ``"tile"`` (float activations, weights dequantized in
    registers). Callers that run the kernel pass the activations' dtype here and to
    ``kernel_fn`` / ``kernel_weight`` alike (the kernel decides which bytes are read)."""
    if qtype in AMX_TYPES and rows >= AMX_ROWS[qtype] and amx_enabled():
        return "amx"
    if (
        rows >= VNNI_ROWS.get(qtype, rows + 1)
        and (dtype != torch.bfloat16 or rows <= VNNI_BF16_MAX_ROWS)
        and vnni_enabled(qtype)
    ):
        return "vnni"
    if rows >= PANEL_ROWS:
        return "panel"
    if qtype in ACT8_TYPES and activation_mode() == "int8":
        return "act8"
    return "tile"


def _symbol(kind: str, qtype: str, layout: str = "gguf") -> str:
    """The C symbol prefix of kernel ``kind`` on a ``qtype`` weight holding ``layout``
    (``QuantWeight.layout``): act8 / act16 of Q8_0, and of Q4_1 while ``x4_enabled()``, run the
    x4 layout's; the panels of a Q4_1 weight holding only x4 its x4 panels."""
    if kind == "tile":
        return "quant_gemm_"
    if kind in ("act8", "act16") and (qtype == "q8_0" or (qtype == "q4_1" and x4_enabled())):
        return f"quant_gemm_{kind}x4_"
    if kind == "panel" and layout == "x4":
        return "quant_gemm_panelx4_"
    if kind == "amx":
        return "quant_gemm_amxx4_" if layout == "x4" else "quant_gemm_amx_"
    if kind == "vnni":
        return "quant_gemm_vnnix4_"
    return f"quant_gemm_{kind.removesuffix('_gguf')}_"


def weight_attr(
    weight: QuantWeight, rows: int, kernel: str | None = None, dtype: torch.dtype = torch.float32
) -> str:
    """The ``QuantWeight`` attribute holding the bytes kernel ``kernel`` (None: ``pick_kernel``
    for ``dtype`` activations) reads for ``rows`` rows of ``weight``: ``"x4"`` for the x4
    kernels (``_symbol``), else ``"data"``."""
    kind = kernel or pick_kernel(rows, weight.qtype, dtype)
    return "x4" if "x4_" in _symbol(kind, weight.qtype, weight.layout) else "data"


def kernel_weight(
    weight: QuantWeight, rows: int, kernel: str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The bytes ``kernel_fn``'s function reads (``weight_attr``; the same ``dtype``)."""
    return getattr(weight, weight_attr(weight, rows, kernel, dtype))


def kernel_fn(weight: QuantWeight, rows: int, dtype: torch.dtype, kernel: str | None = None):
    """The C function ``linear`` calls for ``rows`` rows of ``dtype`` activations (``kernel``:
    as ``linear``'s); arguments ``(x, w, bias, y, M, N, K, nthreads)`` with ``w`` the bytes of
    ``kernel_weight``, returning nonzero when it could not allocate its scratch (nothing
    written). The kernels must be available."""
    kind = kernel or pick_kernel(rows, weight.qtype, dtype)
    fn = _LIB.fn(f"{_symbol(kind, weight.qtype, weight.layout)}{weight.qtype}_{DTYPE_SUFFIX[dtype]}")
    if kind != "tile" and fn.restype is not ctypes.c_int:
        fn.restype = ctypes.c_int
    return fn


def linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, *, kernel: str | None = None
) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` ``[T, in]`` (CPU float32 or bfloat16); returns ``[T, out]``
    in ``x``'s dtype.

    Args:
        kernel: None (``pick_kernel``), or force ``"tile"``, ``"act8"`` (int8 activations;
            ``ACT8_TYPES`` only; Q8_0 on its x4 copy), ``"act16"`` (two int8 planes,
            ``quantize_activations2``; ``ACT8_TYPES`` only), ``"act8_gguf"`` / ``"act16_gguf"``
            (the same on the GGUF layout, Q8_0 included), ``"panel"`` (benchmarks, tests, the
            LM head), ``"amx"`` (``amx_supported()`` only, whatever ``$KVSERVE_QUANT_AMX``) or
            ``"vnni"`` (``VNNI_TYPES`` with AVX-512 VNNI kernels, whatever
            ``$KVSERVE_QUANT_VNNI``; int8 activations).
            Ignored without the kernels (the torch fallback is float).

    Raises:
        ValueError: ``x`` or ``bias`` does not fit the weight (shape, dtype, device), or an
            unknown ``kernel`` / ``act8`` on another type.
        MemoryError: the kernel's scratch buffer could not be allocated.
    """
    if kernel is not None and (
        kernel not in _KERNELS or (kernel in _INT8_KERNELS and weight.qtype not in ACT8_TYPES)
    ):
        raise ValueError(f"quantized linear: kernel {kernel!r} is not one of {_KERNELS} for {weight.qtype}")
    if kernel == "amx" and available() and not amx_supported():
        raise ValueError("quantized linear: kernel 'amx' needs AMX tiles (amx_supported() is False)")
    if kernel == "vnni" and available() and (weight.qtype not in VNNI_TYPES or act8_isa() != "avx512-vnni"):
        raise ValueError(
            f"quantized linear: kernel 'vnni' needs a {list(VNNI_TYPES)} weight and AVX-512 VNNI kernels "
            f"(got {weight.qtype}, {act8_isa()})"
        )
    check_linear_inputs(
        x,
        bias,
        weight.in_features,
        weight.out_features,
        tuple(DTYPE_SUFFIX),
        f"quantized linear, {weight.qtype} weight {tuple(weight.shape)}",
    )
    if not available():
        return F.linear(x, dequantize(weight).to(x.dtype), bias)
    x = x.contiguous()  # (referenced until the call returns)
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    kind = kernel or pick_kernel(x.shape[0], weight.qtype, x.dtype)
    rc = kernel_fn(weight, x.shape[0], x.dtype, kind)(
        x.data_ptr(),
        kernel_weight(weight, x.shape[0], kind).data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        weight.out_features,
        weight.in_features,
        torch.get_num_threads(),
    )
    if rc:
        raise MemoryError(f"quantized linear: no memory for the {kind} kernel's scratch ({tuple(x.shape)})")
    return y


def set_x4_prefetch(nbytes: int) -> int:
    """Set the x4 kernels' software prefetch distance (bytes of weights ahead; 0: none) and
    return the previous one (benchmarks; not while a kernel runs). Kernels must be available."""
    fn = _LIB.fn("quant_x4_set_prefetch")
    fn.restype = ctypes.c_int
    return int(fn(int(nbytes)))


def stream_read(t: torch.Tensor, threads: int, prefetch: int = 0) -> int:
    """Read every 64 bytes of contiguous CPU tensor ``t`` once on ``threads`` threads (the
    bandwidth ceiling of a GEMV over the same bytes; ``prefetch``: software prefetch distance in
    bytes, 0 none); returns an XOR of the bytes read. Kernels must be available."""
    fn = _LIB.fn("quant_stream_read")
    fn.restype = ctypes.c_uint64
    return int(fn(t.data_ptr(), t.numel() * t.element_size(), threads, prefetch))


def embedding(ids: torch.Tensor, weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``) of the weight, dequantized: ``[T, in_features]`` in ``dtype``
    (float32 or bfloat16).

    Raises:
        IndexError: an id outside ``[0, out_features)`` (as ``F.embedding``).
        ValueError: ``ids`` not 1-D, or an unsupported ``dtype``.
    """
    if ids.dim() != 1 or dtype not in DTYPE_SUFFIX:
        raise ValueError(f"quantized embedding: ids {tuple(ids.shape)} / dtype {dtype} not supported")
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
        raise IndexError(f"token id out of range [0, {weight.out_features})")
    if not available():
        return dequantize_blocks(weight.data.index_select(0, ids), weight.qtype).to(dtype)
    out = torch.empty(ids.numel(), weight.in_features, dtype=dtype)
    _LIB.call(
        f"quant_rows_{weight.qtype}_{DTYPE_SUFFIX[dtype]}",
        weight.data,
        ids,
        ids.numel(),
        weight.in_features,
        out,
        torch.get_num_threads(),
    )
    return out
