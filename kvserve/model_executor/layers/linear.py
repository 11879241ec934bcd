"""The linear method: which kernel runs ``y = x @ W^T + b`` for each weight, in one place.

A weight's form is chosen once, at load (``prepack_weight`` for float weights, ``quantize_weight``
for block-quantized ones); every call then dispatches on that form (``linear``):

- ``quant.QuantWeight`` (GGUF blocks): the quantized GEMMs of ``kvserve.ops.quant``, which pick
  their kernel by row count themselves.
- ``gemm_amx.AmxWeight`` (bfloat16, AMX hosts): the tile kernel up to ``gemm_amx.MAX_ROWS`` rows,
  oneDNN's packed copy above.
- ``gemm.PanelWeight`` (float32 with AVX-512F; bfloat16 where the panels beat oneDNN): the panel
  GEMM up to its ``max_rows``, oneDNN's packed copy above when it holds one.
- ``gemm_bf16dot.DotWeight`` (bfloat16, no AMX, a VDPBF16PS faster than the float32 FMAs: AMD
  Zen 4): the AVX512-BF16 dot-product GEMM at every row count, one copy of the weight.
- a oneDNN-packed (``is_mkldnn``) tensor: oneDNN's matmul, rows padded to a bucket.
- a plain tensor (off CPU, float16, float32 without AVX-512F, no kernels): ``F.linear``.
- ``InputPermutedWeight`` (GPTQ act-order): the input columns gathered, then the inner weight's
  method.

The one-call CPU decode step resolves the same choice per step (``native_gemm``), so both paths
run the same kernel for a weight and row count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.permuted_linear import InputPermutedWeight
from kvserve.model_executor.layers.row_buckets import onednn_rows as bucket_rows
from kvserve.model_executor.layers.row_buckets import pad_rows
from kvserve.ops import gemm, gemm_amx, gemm_bf16dot, huge_pages, quant, quant_pack
from kvserve.ops.library import DTYPE_SUFFIX

#: A linear weight in any of the forms above.
LinearWeight = Any


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[T, in]`` and ``weight`` ``[out, in]``: a plain tensor,
    or a weight prepacked by ``prepack_weight`` (``gemm.PanelWeight``,
    ``gemm_amx.AmxWeight`` or oneDNN's), a GGUF-quantized ``quant.QuantWeight``, or one
    whose input columns were permuted at load (``InputPermutedWeight``: GPTQ act-order), or
    ``gemm_bf16dot.DotWeight``."""
    if isinstance(weight, InputPermutedWeight):
        x, weight = weight.gather(x), weight.weight
    if isinstance(weight, quant.QuantWeight):
        return quant.linear(x, weight, bias)
    if isinstance(weight, gemm_bf16dot.DotWeight):
        return gemm_bf16dot.linear(x, weight, bias)
    if isinstance(weight, gemm_amx.AmxWeight):
        if x.shape[0] <= gemm_amx.MAX_ROWS:
            return gemm_amx.linear(x, weight, bias)
        weight = weight.large
    if isinstance(weight, gemm.PanelWeight):
        if weight.takes(x.shape[0]):
            return gemm.linear(x, weight, bias)
        weight = weight.large
    if weight.is_mkldnn:
        if x.shape[0] == 1:
            # oneDNN's 1-row kernel sums in another order than its 2+-row one (bfloat16; seen at
            # in_features 1536, not 576: ~1 output in 600 rounds differently), so a decode step
            # would disagree with the same row inside a verify chunk and flip near-ties between
            # speculation on and off; two copies of the row take the 2+-row kernel.
            return torch.ops.mkldnn._linear_pointwise(
                x.expand(2, -1).contiguous(), weight, bias, "none", [], ""
            )[:1]
        # padded to a row bucket: a new row count costs oneDNN a primitive build (row_buckets)
        rows = x.shape[0]
        return torch.ops.mkldnn._linear_pointwise(pad_rows(x), weight, bias, "none", [], "")[:rows]
    return F.linear(x, weight, bias)


def prepack_weight(weight: torch.Tensor) -> LinearWeight:
    """``weight`` ``[out, in]`` reordered once, at load, for the fastest CPU GEMM for its dtype on
    this CPU; ``linear`` dispatches on the result.

    - float32: ``gemm.PanelWeight`` (our register-blocked kernel: faster than oneDNN's
      prepacked matmul at decode sizes, level at prefill sizes; see ``gemm``) where the CPU has
      AVX-512F (``gemm.beats_onednn``); with AVX2 only, the weight as it is (oneDNN's GEMM).
    - bfloat16: oneDNN's blocked layout (its AMX/AVX512-BF16 GEMM). Plain ``F.linear`` reorders
      a bfloat16 weight on every call; prepacked, it skips that work with bit-identical
      results. Where the process may use AMX tiles and
      ``in % 32 == 0`` (and ``$KVSERVE_GEMM_AMX`` is not ``0``), also ``gemm_amx.AmxWeight``
      (our tile kernel, for steps of up to ``gemm_amx.MAX_ROWS`` tokens) holding the oneDNN
      copy for larger steps: two copies of each weight, the price of both speeds.
      Without AMX, where the CPU has no bfloat16 dot product faster than its float32 FMAs
      (``gemm.packs_bfloat16``): ``gemm.PanelWeight`` for every step size, one
      copy -- without AVX512-BF16 oneDNN emulates bfloat16, and with a slow VDPBF16PS
      (``gemm_bf16dot.dot_beats_fma`` False) its bfloat16 matmul does no more multiply-adds per
      cycle than the panels, which beat it at every row count -- so decode and verify steps of
      any batch also stay on the one-call decode step. With a fast AVX512-BF16 dot product and
      no AMX (AMD Zen 4; ``gemm_bf16dot.dot_beats_fma``): ``gemm_bf16dot.DotWeight`` for every
      step size, one copy -- at Llama-3.2-1B's layer shapes it is about level with oneDNN's
      matmul (the same instruction) from 32 rows up, a little behind at K = 8192, and faster
      than the panels at every row count (docs/benchmarks_shapes.md); one kernel at every row count
      also keeps a row's numbers the same in decode, verify and prefill steps. Where that CPU's
      build lacks the kernel (an older compiler): ``gemm.PanelWeight`` for steps of up to
      ``gemm.BF16_DOT_MAX_ROWS`` rows, holding oneDNN's copy for larger ones. The other
      figures are in docs/benchmarks.md (CPU kernels).

    Returns ``weight`` unchanged off CPU, for other dtypes (a ``QuantWeight`` too), for float32
    without AVX-512F, or when neither kernel is available.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return weight
    if weight.dtype == torch.float32:
        return gemm.PanelWeight(weight) if gemm.beats_onednn() else weight
    amx = weight.shape[1] % gemm_amx.K_TILE == 0 and gemm_amx.USE_FOR_GEMM and gemm_amx.available()
    if not amx and gemm.packs_bfloat16():
        return gemm.PanelWeight(weight)
    if not amx and gemm_bf16dot.dot_beats_fma():
        return gemm_bf16dot.DotWeight(weight)
    large = weight
    if torch.backends.mkldnn.is_available():
        try:
            large = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except (RuntimeError, AttributeError):
            pass
    if amx:
        return gemm_amx.AmxWeight(weight, large=large)
    if gemm.beats_onednn():
        return gemm.PanelWeight(weight, large=large, max_rows=gemm.BF16_DOT_MAX_ROWS)
    return large


def lm_head_logits(hidden: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """float32 ``hidden @ weight.T`` for the LM head (``hidden`` ``[N, hidden_size]``).

    A quantized head runs its own kernel choice (``quant.head_kernel``): never one int8 plane,
    since int8-quantizing the final hidden state (its outlier channels) flips near-tie first
    tokens that the layers' GEMVs do not; two planes (~2^-16 of a block's largest value) keep
    the float result and stream faster.
    """
    if isinstance(weight, quant.QuantWeight):
        return quant.linear(hidden, weight, kernel=quant.head_kernel(len(hidden), weight.qtype)).float()
    return linear(hidden, weight).float()


def move_to_huge_pages(packed: list[LinearWeight]) -> None:
    """The kernels' weight streams (AMX tiles, float panels, bfloat16 pairs) of ``packed`` moved into 2 MiB
    pages (``huge_pages.move_weights``: fewer TLB misses at decode); nothing moves where
    unavailable."""
    huge_pages.move_weights(packed, ("tiles", "panels", "pairs"))


def onednn_rows(weight: LinearWeight, limit: int) -> tuple[torch.Tensor | None, int]:
    """``(onednn_weight, first_row)``: the oneDNN-packed tensor that ``linear`` runs for
    ``weight`` at ``first_row`` rows and above (up to ``limit``), or ``(None, 0)`` when no row
    count reaches oneDNN (plain, quantized, or panels without a large copy)."""
    onednn = weight
    if isinstance(weight, gemm_amx.AmxWeight | gemm.PanelWeight):
        onednn = weight.large
    if not isinstance(onednn, torch.Tensor) or not onednn.is_mkldnn:
        return None, 0
    if isinstance(weight, gemm_amx.AmxWeight):
        return onednn, gemm_amx.MAX_ROWS + 1
    if isinstance(weight, gemm.PanelWeight):
        return onednn, (weight.max_rows or limit) + 1
    return onednn, 2


def gemm_rows(weight: LinearWeight, rows: int) -> int:
    """The row count ``linear`` runs ``weight`` at for an input of ``rows`` rows: the oneDNN row
    bucket (``row_buckets.onednn_rows``) where oneDNN runs it, else ``rows``. A caller that
    lays its rows out padded to this count up front saves every such GEMM the copy into a
    padded buffer."""
    onednn, first = onednn_rows(weight, rows)
    return bucket_rows(rows) if onednn is not None and rows >= max(first, 2) else rows


#: ``quantize_weight``'s methods: name -> (quantizer, GGUF block type).
QUANT_METHODS: dict[str, tuple[Callable[[torch.Tensor], quant.QuantWeight], str]] = {
    "int8": (quant.quantize_q8_0, "Q8_0"),
    "int4": (quant_pack.quantize_q4_1, "Q4_1"),
}
#: Input features per quantization block: a quantized weight's ``in_features`` divides by it.
QUANT_BLOCK = quant.BLOCK_ELEMS


def check_quant_activations() -> None:
    """Raises ValueError when ``KVSERVE_QUANT_ACT`` is neither ``float`` nor ``int8`` (so a bad
    value fails at load, not in a request)."""
    quant.activation_mode()


def quantize_weight(weight: torch.Tensor, method: str) -> quant.QuantWeight:
    """``weight`` ``[out, in]`` (``in % QUANT_BLOCK == 0``) block-quantized by ``method`` (a key
    of ``QUANT_METHODS``: ``int8`` Q8_0, int8 with a scale per 32 weights; ``int4`` Q4_1, 4-bit
    codes with a scale and offset per 32 weights searched for the lowest squared error) and
    prepared for its kernels (``quant.prepare``).

    Raises:
        KeyError: an unknown ``method``.
    """
    q = QUANT_METHODS[method][0](weight)
    quant.prepare(q)
    return q


def native_gemm(
    weight: LinearWeight, bias: torch.Tensor | None, rows: int, dtype: torch.dtype
) -> tuple[Any, int, int | None, int, int, bool] | None:
    """The native kernel ``linear`` runs for ``weight`` at ``rows`` rows of ``dtype``, for callers
    that make the C call themselves (the one-call decode step): ``(fn, weight_ptr, bias_ptr,
    out_features, in_features, is_panel)``, or None when that is not a native kernel."""
    b = None if bias is None else bias.data_ptr()
    if isinstance(weight, quant.QuantWeight) and quant.available():
        return (
            quant.kernel_fn(weight, rows, dtype),
            quant.kernel_weight(weight, rows, dtype=dtype).data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            False,
        )
    if isinstance(weight, gemm_amx.AmxWeight) and rows <= gemm_amx.MAX_ROWS and gemm_amx.available():
        return (
            gemm_amx._LIB.fn("amx_gemm_bf16"),
            weight.tiles.data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            False,
        )
    # built(), not available(): a DotWeight exists only where prepack_weight found the kernel,
    # and available() reads /proc/cpuinfo, which this per-step call must not
    if isinstance(weight, gemm_bf16dot.DotWeight) and dtype == torch.bfloat16 and gemm_bf16dot.built():
        # called as the AMX kernel is: (x, w, bias, y, M, N, K, nthreads)
        return (
            gemm_bf16dot._LIB.fn("bf16dot_gemm"),
            weight.pairs.data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            False,
        )
    if (
        isinstance(weight, gemm.PanelWeight)
        and weight.dtype == dtype
        and weight.takes(rows)
        and gemm.available()
    ):
        return (
            gemm._LIB.fn(f"gemm_{DTYPE_SUFFIX[dtype]}"),
            weight.panels.data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            True,
        )
    return None


#: The tensor holding each native weight form's bytes (the pointer ``native_gemm`` passes; a
#: ``QuantWeight``'s depends on the kernel: ``quant.weight_attr``).
WEIGHT_BYTES: dict[type, str] = {
    quant.QuantWeight: "data",
    gemm_amx.AmxWeight: "tiles",
    gemm.PanelWeight: "panels",
    gemm_bf16dot.DotWeight: "pairs",
}
