"""Hugging Face checkpoints quantized by GPTQ, AWQ or compressed-tensors (``quantization_config``
in ``config.json``), repacked at load into GGUF blocks so that ``csrc/quant_gemm.c`` runs them.

Formats read (our own unpacking, from the formats' descriptions):

- GPTQ (``quant_method="gptq"``), 4-bit (8-bit symmetric likewise, 4 values per word, as
  Q8_0 blocks): per linear module ``qweight`` int32 ``[in/8, out]``
  (input row ``i`` in nibble ``i % 8`` of word ``i // 8``), ``qzeros`` int32 ``[groups, out/8]``
  (output column ``j`` in nibble ``j % 8``), ``scales`` float16 ``[groups, out]``, ``g_idx``
  int32 ``[in]`` (the group of each input channel), optional ``bias``. Weight
  ``scale * (q - zero)``; ``checkpoint_format="gptq"`` (the default, AutoGPTQ's) stores
  ``zero - 1``, ``"gptq_v2"`` the zero itself. ``group_size`` -1 is one group per output
  channel. ``desc_act`` (a ``g_idx`` that is not ``i // group_size``): the input channels are
  sorted by group at load and the activations gathered with that permutation at run time
  (``InputPermutedWeight``; q/k/v and gate/up are fused, so one gather per input).
- AWQ (``quant_method="awq"``, ``version="gemm"``), 4-bit: ``qweight`` int32 ``[in, out/8]`` whose
  nibble ``i`` of word ``c`` holds output column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``, ``qzeros``
  int32 ``[groups, out/8]`` packed the same way, ``scales`` ``[groups, out]``; weight
  ``scale * (q - zero)``, groups contiguous runs of ``group_size`` input channels.
- compressed-tensors (``quant_method="compressed-tensors"``, format ``int-quantized`` or
  ``naive-quantized``): ``weight`` int8 ``[out, in]`` and ``weight_scale`` (``[out, 1]`` per
  channel, ``[out, in/group_size]`` per group, or one per tensor), symmetric: weight
  ``scale * q``. Format ``float-quantized`` (8-bit float e4m3 weights with the same scales) is
  dequantized once at load to the model dtype. Activation quantization (``input_activations``,
  W8A8) and a ``kv_cache_scheme`` are not applied: the model runs weight-only, with a log line.

Repacking (tolerances stated against the format's own dequantization in float64):

- 4-bit -> Q4_1 (``d = scale``, ``m = -scale * zero``, a group of 64/128 = 2/4 blocks with the
  same ``d, m``): the codes and ``d`` are exact; ``m`` is rounded to float16, so each weight is
  off by at most ``2^-11 * |scale * zero| <= |scale| / 128`` (what float16 GPTQ/AWQ kernels
  compute too).
- int8 -> Q8_0 (``d = float16(scale)``): exact for float16 scales; other scale dtypes are off
  by the float16 rounding of the scale (relative ``2^-11``). A scale float16 cannot hold (below
  its normal range or above 65504) makes the layer run dequantized in float instead (logged).

A module whose quantized tensors are absent is read as float (``modules_to_not_convert``,
``ignore``: usually the LM head). A fused weight (q/k/v, gate/up) whose parts do not share one
block type and input permutation is dequantized to float at load (logged). Any other method,
bit width, version, format or strategy is a ``ValueError`` naming it; a missing or mis-shaped
tensor is a ``ValueError`` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model_executor.layers.permuted_linear import InputPermutedWeight
from kvserve.ops import quant, quant_pack
from kvserve.ops.quant import BLOCK_ELEMS

logger = logging.getLogger("kvserve.quantized_checkpoint")

#: ``quant_method`` values this module loads.
SUPPORTED_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_CT_FORMATS = ("int-quantized", "naive-quantized", "float-quantized")
_CT_STRATEGIES = ("channel", "tensor", "group")
#: Tensors of a GPTQ / AWQ module (``bias`` is read as an ordinary tensor).
_PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
#: Tensors of a compressed-tensors module besides ``weight`` (activation scales are unused).
_CT_SUFFIXES = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
#: Tensors of a compressed-tensors ``kv_cache_scheme`` (unused: the KV cache stays float).
_KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "output_scale", "output_zero_point")
#: AWQ's nibble order: nibble ``i`` of a word holds column ``_AWQ_ORDER[i]`` of its 8.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class QuantScheme:
    """A parsed ``quantization_config``.

    Attributes:
        method: one of ``SUPPORTED_QUANT_METHODS``.
        bits: weight bits (4 or 8 for GPTQ, 4 for AWQ, 8 for compressed-tensors).
        group_size: input channels per scale (GPTQ / AWQ); -1 = one group per output channel.
        zero_offset: added to the stored zeros (1 for GPTQ's ``checkpoint_format="gptq"``).
        ignored: what of the config is not applied (logged at load), e.g. activation
            quantization; empty when everything is.
    """

    method: str
    bits: int
    group_size: int = -1
    zero_offset: int = 0
    ignored: tuple[str, ...] = ()


def quant_method_of(hf_config) -> str | None:
    """The ``quant_method`` of ``hf_config``'s ``quantization_config`` (lower-case), or ``None``
    for an unquantized checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(method).lower() if method is not None else "<missing>"


def _as_dict(qc, where: str) -> dict:
    if isinstance(qc, dict):
        return qc
    to_dict = getattr(qc, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise ValueError(
        f"{where}: quantization_config must be an object (with a quant_method), got "
        f"{type(qc).__name__} {qc!r:.80}"
    )


def _group_size(value, where: str, field: str) -> int:
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or (value != -1 and (value <= 0 or value % 32)):
        raise ValueError(
            f"{where}: quantization_config {field}={value!r} is not supported "
            f"(supported: -1 = per channel, or a positive multiple of {BLOCK_ELEMS}: 32, 64, 128, ...)"
        )
    return value


def parse_quantization_config(qc, where: str) -> QuantScheme:
    """Check ``qc`` (a ``quantization_config`` dict) and return its ``QuantScheme``.

    Args:
        where: named in errors (the ``config.json`` path).
    Raises:
        ValueError: naming the field and value: an unknown or unsupported ``quant_method``
            (bitsandbytes, hqq, marlin, exl2, ...), bit width, GPTQ ``checkpoint_format``, AWQ
            ``version`` or ``zero_point=False``, compressed-tensors ``format``, weight type,
            strategy or asymmetric weights.
    """
    qc = _as_dict(qc, where)
    method = str(qc.get("quant_method", "<missing>")).lower()
    if method == "gptq":
        bits = qc.get("bits")
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ValueError(
                f"{where}: GPTQ quantization_config bits={bits!r} is not supported (supported: 4, 8)"
            )
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in _GPTQ_FORMATS:
            raise ValueError(
                f"{where}: GPTQ checkpoint_format={fmt!r} is not supported (supported: "
                f"{', '.join(_GPTQ_FORMATS)})"
            )
        gs = _group_size(qc.get("group_size", -1), where, "group_size")
        return QuantScheme("gptq", int(bits), gs, zero_offset=1 if fmt == "gptq" else 0)
    if method == "awq":
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(
                f"{where}: AWQ quantization_config bits={bits!r} is not supported (supported: 4)"
            )
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"{where}: AWQ quantization_config version={qc.get('version')!r} is not supported "
                "(supported: 'gemm')"
            )
        if qc.get("zero_point", True) is False:
            raise ValueError(f"{where}: AWQ quantization_config zero_point=False is not supported")
        gs = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), where, "group_size")
        return QuantScheme("awq", 4, gs)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, where)
    raise ValueError(
        f"{where}: quantization_config quant_method={qc.get('quant_method')!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)}, or GGUF files with quantization='gguf')"
    )


def _parse_compressed_tensors(qc: dict, where: str) -> QuantScheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    top_format = qc.get("format")
    ignored = []
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"{where}: compressed-tensors config_groups[{gname!r}] is not an object")
        fmt = str(g.get("format") or top_format or "<missing>")
        if fmt not in _CT_FORMATS:
            raise ValueError(
                f"{where}: compressed-tensors format={fmt!r} (config_groups[{gname!r}]) is not supported "
                f"(supported: {', '.join(_CT_FORMATS)})"
            )
        w = g.get("weights")
        if not isinstance(w, dict):
            raise ValueError(
                f"{where}: compressed-tensors config_groups[{gname!r}] quantizes no weights "
                "(activation-only quantization is not supported)"
            )
        kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
        field = f"config_groups[{gname!r}].weights"
        if (kind, bits) not in (("int", 8), ("float", 8)):
            raise ValueError(
                f"{where}: compressed-tensors {field} type={kind!r} num_bits={bits!r} is not supported "
                "(supported: int 8, float 8)"
            )
        if (kind == "float") != (fmt == "float-quantized") and fmt != "naive-quantized":
            raise ValueError(
                f"{where}: compressed-tensors {field} type={kind!r} does not match format={fmt!r}"
            )
        if w.get("symmetric", True) is not True:
            raise ValueError(
                f"{where}: compressed-tensors {field} symmetric=False is not supported (only symmetric weights)"
            )
        if strategy not in _CT_STRATEGIES:
            raise ValueError(
                f"{where}: compressed-tensors {field} strategy={strategy!r} is not supported "
                f"(supported: {', '.join(_CT_STRATEGIES)})"
            )
        if strategy == "group":
            gs = _group_size(w.get("group_size"), where, f"{field}.group_size")
            if gs == -1:
                raise ValueError(f"{where}: compressed-tensors {field} strategy='group' needs a group_size")
        if w.get("dynamic", False):
            raise ValueError(f"{where}: compressed-tensors {field} dynamic=True is not supported for weights")
        act = g.get("input_activations")
        if act:
            ignored.append(
                f"activation quantization ({act.get('type', 'int')}{act.get('num_bits', '')}, "
                f"{'dynamic' if act.get('dynamic') else 'static'} per {act.get('strategy', 'tensor')})"
            )
    if qc.get("kv_cache_scheme"):
        ignored.append("KV cache quantization (kv_cache_scheme)")
    return QuantScheme("compressed-tensors", 8, ignored=tuple(sorted(set(ignored))))


# --------------------------------------------------------------------------------- unpacking
def unpack_int32_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``bits``-bit values (4 or 8) of int32 words packed along dim 0: ``[R, C]`` -> uint8
    ``[R * 32 / bits, C]``, value ``r * 32 / bits + i`` in bits ``bits*i ..`` of word ``r``
    (GPTQ's ``qweight``)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    vals = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_int32_cols(
    packed: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4
) -> torch.Tensor:
    """``bits``-bit values (4 or 8) of int32 words packed along dim 1: ``[R, C]`` -> uint8
    ``[R, C * 32 / bits]``; column ``c * 32 / bits + j`` sits in field ``j`` of word ``c``
    (GPTQ's ``qzeros``), or, with ``order``, in the field ``i`` where ``order[i] == j`` (AWQ's
    4-bit order)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, 1, per)
    vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, field]
    if order is not None:
        inverse = [order.index(j) for j in range(per)]
        vals = vals[..., inverse]
    return vals.reshape(packed.shape[0], -1).to(torch.uint8)


def repack_grouped(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    what: str,
    bits: int = 4,
) -> tuple[quant.QuantWeight, torch.Tensor | None]:
    """Blocks of ``w[o, i] = scales[g, o] * (codes[o, i] - zeros[g, o])``, ``g = g_idx[i]``:
    Q4_1 for 4 bits (``d = scale``, ``m = -scale * zero``), Q8_0 for 8 bits (``d = scale``,
    codes ``q - 128``: symmetric only).

    Args:
        codes: uint8 ``[out, in]`` in ``[0, 2^bits)``.
        scales: ``[groups, out]`` float; zeros: ``[groups, out]`` integers (offset applied).
        g_idx: ``[in]`` group of each input channel.
        what: named in errors (file and tensor).
    Returns:
        ``(weight, perm)``: the blocks, with the input columns sorted by group when ``g_idx``
        is not already sorted (``perm``: int64 ``[in]``, column ``j`` = input ``perm[j]``;
        ``None`` when no permutation is needed).
    Raises:
        ValueError: ``in`` not a multiple of 32, a ``g_idx`` value outside ``[0, groups)``, a
            group whose channels do not fill whole 32-column blocks, or (8 bits) a zero point
            other than 128.
    """
    n, k = codes.shape
    groups = scales.shape[0]
    if k % BLOCK_ELEMS:
        raise ValueError(
            f"{what}: in_features={k} is not a multiple of {BLOCK_ELEMS} (needed for 32-weight blocks)"
        )
    g = g_idx.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ValueError(
            f"{what}: g_idx values must lie in [0, {groups}), got [{int(g.min())}, {int(g.max())}]"
        )
    perm: torch.Tensor | None = None
    if bool((g[1:] < g[:-1]).any()):
        perm = torch.sort(g, stable=True).indices
        g = g[perm]
        codes = codes[:, perm]
    block_groups = g.view(-1, BLOCK_ELEMS)
    if not bool((block_groups == block_groups[:, :1]).all()):
        raise ValueError(
            f"{what}: every quantization group must hold whole blocks of {BLOCK_ELEMS} input channels "
            "(group_size a multiple of 32)"
        )
    bg = block_groups[:, 0]
    d = scales.float()[bg].t()  # [out, blocks]
    if bits == 8:
        if bool((zeros != 128).any()):
            raise ValueError(
                f"{what}: 8-bit zero points must all be 128 (symmetric); asymmetric 8-bit is not supported"
            )
        return quant_pack.pack_q8_0(codes.to(torch.int16) - 128, d), perm
    m = -d * zeros.float()[bg].t()
    return quant_pack.pack_q4_1(codes, d, m), perm


# --------------------------------------------------------------------------------- loading
class _Tensors:
    """Name -> (file, lazily read tensor) over the checkpoint's safetensors shards."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        from kvserve.model_executor.safetensors_shards import shard_paths

        self.files: dict[str, Path] = {}
        self._handles: dict[str, object] = {}
        for p in shard_paths(model_dir):
            try:
                f = stack.enter_context(safe_open(str(p), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"{p} cannot be read as safetensors: {e}") from None
            for name in f.keys():
                self.files[name] = p
                self._handles[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, owner: str) -> torch.Tensor:
        """The tensor ``name``; ``owner`` (a module's tensor that needs it) names the file in the
        error when it is missing."""
        self.get_missing(name, owner)
        try:
            return self._handles[name].get_tensor(name)  # type: ignore[attr-defined]
        except Exception as e:
            raise ValueError(f"{self.files[name]}: tensor {name!r} cannot be read: {e}") from None

    def shape(self, name: str, owner: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (its header only: nothing is read)."""
        self.get_missing(name, owner)
        return tuple(self._handles[name].get_slice(name).get_shape())  # type: ignore[attr-defined]

    def get_missing(self, name: str, owner: str) -> None:
        """Raises ValueError when ``name`` is absent (naming ``owner``'s file)."""
        if name not in self.files:
            where = self.files.get(owner, "the checkpoint")
            raise ValueError(f"{where}: tensor {name!r} is missing (needed with {owner!r})")

    def where(self, name: str) -> str:
        return f"{self.files.get(name, 'the checkpoint')}: tensor {name!r}"


def _expect_shape(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _expect_finite(t: torch.Tensor, what: str) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(
            f"{what} has {int(bad.sum())} non-finite value(s) (NaN or inf) of {t.numel()}: a corrupt checkpoint"
        )


def _expect_int32(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{what} has dtype {t.dtype}, expected int32 (packed 4-bit values)")


def _groups_of(gs: int, in_features: int) -> int:
    return 1 if gs == -1 else -(-in_features // gs)


def _load_gptq(ts: _Tensors, prefix: str, scheme: QuantScheme, out_f: int, in_f: int):
    qname = prefix + ".qweight"
    qweight = ts.get(qname, qname)
    _expect_int32(qweight, ts.where(qname))
    bits = scheme.bits
    per = 32 // bits
    _expect_shape(qweight, (in_f // per, out_f), ts.where(qname) + f" (GPTQ {bits}-bit: [in/{per}, out])")
    if in_f % per or out_f % per:
        raise ValueError(
            f"{ts.where(qname)}: in and out features must be multiples of {per} for packed {bits}-bit"
        )
    scales, qzeros = _scales_and_qzeros(ts, prefix, qname, scheme, out_f, in_f, per)
    if prefix + ".g_idx" in ts:
        g_idx = ts.get(prefix + ".g_idx", qname)
        _expect_shape(g_idx, (in_f,), ts.where(prefix + ".g_idx"))
        if g_idx.dtype.is_floating_point:
            raise ValueError(f"{ts.where(prefix + '.g_idx')} has dtype {g_idx.dtype}, expected an integer")
    else:
        g_idx = torch.zeros(in_f, dtype=torch.int64)
        if scheme.group_size != -1:
            g_idx = torch.arange(in_f) // scheme.group_size
    codes = unpack_int32_rows(qweight, bits).t()  # [out, in]
    zeros = unpack_int32_cols(qzeros, bits=bits).to(torch.int32) + scheme.zero_offset
    return repack_grouped(codes, scales, zeros, g_idx, ts.where(qname), bits)


def _scales_and_qzeros(ts, prefix: str, qname: str, scheme, out_f: int, in_f: int, per: int):
    """A GPTQ / AWQ layer's ``scales`` (float ``[groups, out]``) and ``qzeros`` (int32
    ``[groups, out / per]``, ``per`` codes packed in each int32), checked.

    Raises:
        ValueError: a missing tensor, a wrong shape or dtype (the message names file and tensor).
    """
    groups = _groups_of(scheme.group_size, in_f)
    scales = ts.get(prefix + ".scales", qname)
    _expect_shape(scales, (groups, out_f), ts.where(prefix + ".scales"))
    if not scales.dtype.is_floating_point:
        raise ValueError(f"{ts.where(prefix + '.scales')} has dtype {scales.dtype}, expected float")
    _expect_finite(scales, ts.where(prefix + ".scales"))
    qzeros = ts.get(prefix + ".qzeros", qname)
    _expect_int32(qzeros, ts.where(prefix + ".qzeros"))
    _expect_shape(qzeros, (groups, out_f // per), ts.where(prefix + ".qzeros"))
    return scales, qzeros


def _load_awq(ts: _Tensors, prefix: str, scheme: QuantScheme, out_f: int, in_f: int):
    qname = prefix + ".qweight"
    qweight = ts.get(qname, qname)
    _expect_int32(qweight, ts.where(qname))
    _expect_shape(qweight, (in_f, out_f // 8), ts.where(qname) + " (AWQ 4-bit: [in, out/8])")
    if out_f % 8:
        raise ValueError(f"{ts.where(qname)}: out features must be a multiple of 8 for packed 4-bit")
    scales, qzeros = _scales_and_qzeros(ts, prefix, qname, scheme, out_f, in_f, 8)
    codes = unpack_int32_cols(qweight, _AWQ_ORDER).t()  # [out, in]
    zeros = unpack_int32_cols(qzeros, _AWQ_ORDER)
    g_idx = (
        torch.zeros(in_f, dtype=torch.int64)
        if scheme.group_size == -1
        else torch.arange(in_f) // scheme.group_size
    )
    return repack_grouped(codes, scales, zeros, g_idx, ts.where(qname))


def _ct_scales(scale: torch.Tensor, out_f: int, in_f: int, per: int, what: str) -> torch.Tensor:
    """float32 ``[out, in / per]`` from a compressed-tensors ``weight_scale`` (per tensor, per
    channel ``[out, 1]`` or per group ``[out, in / group_size]``)."""
    if not scale.dtype.is_floating_point:
        raise ValueError(f"{what} has dtype {scale.dtype}, expected float")
    _expect_finite(scale, what)
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(out_f, in_f // per)
    if s.dim() == 1 and s.shape[0] == out_f:
        s = s.unsqueeze(1)
    if s.dim() != 2 or s.shape[0] != out_f or s.shape[1] == 0 or in_f % s.shape[1]:
        raise ValueError(f"{what} has shape {tuple(scale.shape)}, expected [{out_f}, 1] or [{out_f}, groups]")
    gs = in_f // s.shape[1]
    if s.shape[1] > 1 and gs % per:
        raise ValueError(f"{what}: group size {gs} is not a multiple of {per}")
    return s.repeat_interleave(gs // per if s.shape[1] > 1 else in_f // per, dim=1)


def repack_int8(w: torch.Tensor, scale: torch.Tensor, what: str, swhere: str, logged: set):
    """Q8_0 blocks of ``w = scale * q`` for int8 ``q`` ``[out, in]`` and a compressed-tensors
    ``weight_scale`` (per tensor, channel or group of a multiple of 32): ``d = float16(scale)``
    when float16 holds every scale to ``2^-10`` relative; else (scales below float16's normal
    range or above 65504, which no Q8_0 block can carry) the dequantized float32 weight,
    logged once per load in ``logged``.

    Raises:
        ValueError: ``in`` not a multiple of 32, or scales that do not fit (naming ``what`` /
            ``swhere``).
    """
    out_f, in_f = w.shape
    if in_f % BLOCK_ELEMS:
        raise ValueError(f"{what}: in_features={in_f} is not a multiple of {BLOCK_ELEMS}")
    d = _ct_scales(scale, out_f, in_f, BLOCK_ELEMS, swhere)
    d16 = d.half()
    fits = bool(torch.isfinite(d16).all()) and bool(((d16.float() - d).abs() <= d.abs() * 2.0**-10).all())
    if fits:
        return quant_pack.pack_q8_0(w, d16)
    if "int8 scales beyond float16" not in logged:
        logged.add("int8 scales beyond float16")
        logger.info("%s: scales outside float16's range: dequantized to float at load", swhere)
    return (w.float().view(out_f, -1, BLOCK_ELEMS) * d.unsqueeze(-1)).reshape(out_f, in_f)


def _load_compressed(ts: _Tensors, prefix: str, out_f: int, in_f: int, logged: set):
    wname = prefix + ".weight"
    w = ts.get(wname, prefix + ".weight_scale")
    _expect_shape(w, (out_f, in_f), ts.where(wname))
    scale = ts.get(prefix + ".weight_scale", wname)
    swhere = ts.where(prefix + ".weight_scale")
    if prefix + ".weight_zero_point" in ts:
        zp = ts.get(prefix + ".weight_zero_point", wname)
        if bool((zp != 0).any()):
            raise ValueError(
                f"{ts.where(prefix + '.weight_zero_point')}: non-zero zero points (asymmetric) are not supported"
            )
    if w.dtype == torch.int8:
        return repack_int8(w, scale, ts.where(wname), swhere, logged)
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None and w.dtype == fp8:
        if "fp8" not in logged:
            logged.add("fp8")
            logger.info(
                "%s: float8 e4m3 weights have no kernel: dequantized to float at load", ts.files[wname].name
            )
        s = _ct_scales(scale, out_f, in_f, 1, swhere)
        return w.float() * s
    raise ValueError(
        f"{ts.where(wname)} has dtype {w.dtype}, expected int8 or float8_e4m3fn (compressed-tensors)"
    )


def _is_quantized(ts: _Tensors, prefix: str, scheme: QuantScheme) -> bool:
    if scheme.method == "compressed-tensors":
        return prefix + ".weight_scale" in ts
    return prefix + ".qweight" in ts


def _load_part(ts, prefix, scheme, shape, logged):
    """``(QuantWeight, perm)`` or ``(float tensor, None)`` for linear module ``prefix``."""
    out_f, in_f = shape
    if scheme.method == "gptq":
        return _load_gptq(ts, prefix, scheme, out_f, in_f)
    if scheme.method == "awq":
        return _load_awq(ts, prefix, scheme, out_f, in_f)
    return _load_compressed(ts, prefix, out_f, in_f, logged), None


def _to_float(weight, perm: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[out, in]`` in the original input order."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    w = quant.dequantize(weight)
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def _set(module, attr: str, value) -> None:
    module._parameters.pop(attr, None)  # a plain attribute from now on
    setattr(module, attr, value)


def _linear_groups(model) -> list:
    """``(module, attr, [checkpoint module prefix, ...])`` for every linear weight."""
    groups = []
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        groups += [
            (layer.self_attn, "qkv_weight", [p + f"self_attn.{s}_proj" for s in ("q", "k", "v")]),
            (layer.self_attn, "o_weight", [p + "self_attn.o_proj"]),
            (layer.mlp, "gate_up_weight", [p + "mlp.gate_proj", p + "mlp.up_proj"]),
            (layer.mlp, "down_weight", [p + "mlp.down_proj"]),
        ]
    if not model.tie_word_embeddings:
        groups.append((model, "lm_head", ["lm_head"]))
    return groups


def load_quantized_checkpoint(model, model_dir: Path, scheme: QuantScheme) -> None:
    """Read ``model_dir``'s weights into ``model`` (a freshly built ``LlamaForCausalLM``):
    quantized linear modules as ``QuantWeight`` (``InputPermutedWeight`` for act-order GPTQ),
    everything else as float, then prepack the float linear weights.

    Raises:
        ValueError: tensor parallelism, a device other than CPU, a dtype other than float32 /
            bfloat16, or a missing / mis-shaped / wrongly typed tensor (naming file and tensor).
    """
    if getattr(model, "tp_size", 1) > 1:
        raise ValueError(
            f"quantization {scheme.method!r} (a quantized checkpoint) is not supported with "
            "tensor_parallel_size > 1"
        )
    if model.embed_tokens.device.type != "cpu":
        raise ValueError(f"quantization {scheme.method!r} runs on CPU only")
    if model.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization {scheme.method!r} needs dtype float32 or bfloat16, got {model.dtype}")
    for what in scheme.ignored:
        logger.info("%s: %s is not applied; running weight-only", model_dir, what)
    logged: set = set()
    loaded: set[str] = set()
    consumed: set[str] = set()
    with contextlib.ExitStack() as stack:
        ts = _Tensors(Path(model_dir), stack)
        groups = _linear_groups(model)
        if not any(_is_quantized(ts, p, scheme) for _, _, prefixes in groups for p in prefixes):
            main = _main_tensor("<module>", scheme).split(".", 1)[1]
            raise ValueError(
                f"{model_dir}: config.json declares quant_method={scheme.method!r} but no module has "
                f"its quantized tensors ({main}): not a {scheme.method} checkpoint"
            )
        for module, attr, prefixes in groups:
            quantized = [p for p in prefixes if _is_quantized(ts, p, scheme)]
            if not quantized:
                continue  # float modules: read below as ordinary tensors
            parts = []
            for p in prefixes:
                name = p + ".weight"
                if p in quantized:
                    shape = _declared_shape(ts, p, scheme)
                    try:
                        model.weight_target(name, shape)
                    except ValueError as e:
                        raise ValueError(f"{ts.where(_main_tensor(p, scheme))}: {e}") from None
                    parts.append(_load_part(ts, p, scheme, shape, logged))
                    consumed.update(f"{p}.{s}" for s in (*_PACKED_SUFFIXES, *_CT_SUFFIXES, "weight"))
                else:  # a float part of a fused weight whose other parts are quantized
                    t = ts.get(name, _main_tensor(quantized[0], scheme))
                    model.weight_target(name, tuple(t.shape))
                    if not t.dtype.is_floating_point:
                        raise ValueError(
                            f"{ts.where(name)} is {t.dtype} (integer), expected a float weight "
                            f"(its {_main_tensor(p, scheme).rsplit('.', 1)[1]} is missing, while "
                            f"{_main_tensor(quantized[0], scheme)!r} is there)"
                        )
                    parts.append((t.float(), None))
                    consumed.add(name)
                loaded.add(name)
            _install(module, attr, parts, prefixes, logged)
        for name, path in ts.files.items():
            if name in consumed:
                continue
            if scheme.ignored and name.endswith(_KV_SCALE_SUFFIXES + ("input_scale", "input_zero_point")):
                continue
            t = ts.get(name, name)
            if name.endswith("_proj.bias") and model._destination(name) is None:
                # GPTQ exporters save an all-zero bias for layers that have none
                if bool((t != 0).any()):
                    raise ValueError(
                        f"{ts.where(name)}: unexpected non-zero bias (the model has no bias here)"
                    )
                continue
            try:
                target = model.weight_target(name, tuple(t.shape))
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            if target is None:
                continue
            if not t.dtype.is_floating_point:
                raise ValueError(
                    f"{ts.where(name)} is {t.dtype} (integer), expected a float weight "
                    f"(not quantized by this {scheme.method} checkpoint)"
                )
            target.copy_(t)
            loaded.add(name)
    try:
        model.check_all_loaded(loaded)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    model.prepack_linear_weights()


def _main_tensor(prefix: str, scheme: QuantScheme) -> str:
    return prefix + (".weight_scale" if scheme.method == "compressed-tensors" else ".qweight")


def _declared_shape(ts: _Tensors, prefix: str, scheme: QuantScheme) -> tuple[int, int]:
    """``(out, in)`` of quantized module ``prefix`` as its tensors declare it (checked against
    the model after): GPTQ ``qweight`` ``[in/8, out]``, AWQ ``[in, out/8]``,
    compressed-tensors ``weight`` ``[out, in]``."""
    main = prefix + (".weight" if scheme.method == "compressed-tensors" else ".qweight")
    shape = ts.shape(main, _main_tensor(prefix, scheme))
    if len(shape) != 2:
        raise ValueError(f"{ts.where(main)} has shape {shape}, expected 2 dimensions")
    if scheme.method == "gptq":
        return int(shape[1]), int(shape[0]) * (32 // scheme.bits)
    if scheme.method == "awq":
        return int(shape[1]) * 8, int(shape[0])
    return int(shape[0]), int(shape[1])


def _install(module, attr: str, parts: list, prefixes: list[str], logged: set) -> None:
    """Set ``module.attr`` from its parts: one block weight (row-concatenated) when all parts are
    blocks of one type with one input permutation, else the float weight."""
    weights = [w for w, _ in parts]
    perms = [p for _, p in parts]
    same_perm = all(
        (p is None and perms[0] is None)
        or (p is not None and perms[0] is not None and torch.equal(p, perms[0]))
        for p in perms
    )
    kinds = {w.qtype if isinstance(w, quant.QuantWeight) else None for w in weights}
    if len(kinds) == 1 and None not in kinds and same_perm:
        if len(weights) == 1:
            qw = weights[0]
        else:
            data = torch.cat([w.data for w in weights])
            qw = quant.QuantWeight(data, weights[0].qtype, weights[0].in_features)
        quant.prepare(qw)
        _set(module, attr, qw if perms[0] is None else InputPermutedWeight(qw, perms[0]))
        return
    # fp8 parts (already float) need no word; mixed block types or input orders do
    if kinds != {None}:
        key = "mixed " + attr
        if key not in logged:
            logged.add(key)
            logger.info(
                "%s: parts of a fused weight differ in quantization or input order: dequantized to float",
                ", ".join(prefixes),
            )
    full = torch.cat([_to_float(w, p) for w, p in parts])
    param = getattr(module, attr)
    param.data.copy_(full)
