"""Build the model of a GGUF file (the family its ``general.architecture`` names: Llama, Qwen2,
Qwen3, Phi-3, Gemma 2 / 3, the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) straight
from it, keeping its quantized weights quantized (``quantization="gguf"``).

Linear weights (q/k/v, o, gate/up, down, the LM head) and the token embedding of a type in
``quant.BLOCK_BYTES`` (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) stay in their GGUF blocks (``QuantWeight``) and
run on the kernels of ``csrc/quant_gemm.c``. Q5_0 tensors are repacked at load into Q8_0
blocks holding the same weights exactly (``quant_pack.q8_0_from_q5_0``) and run as Q8_0, so a
fused weight of Q5_0 and Q8_0 parts (Gemma 3's q/k and v) stays quantized. Everything else (float tensors, norms, and
quantized types without a kernel) is dequantized once at load into the model dtype, with one
log line per type. A fused weight (q/k/v, gate/up) stays quantized only when all its parts
share one supported type; Phi-3's q/k/v and gate/up are fused in the file already.

Experts (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, 3-D) are cut into one
``QuantWeight`` per expert and projection (gate and up rows of an expert together, when the two
stacks share a type), run by ``fused_moe.looped_experts`` (one quantized GEMM pair per active
expert on its rows, as for int8 / int4 at load); a stack of a type without a kernel is
dequantized to the model dtype (its log line as above) and its experts run as float weights in
the same loop, or grouped when neither stack is quantized. Routers and Qwen2-MoE's shared-expert
gate stay float; the shared expert's linears are quantized as a dense MLP's.

llama.cpp's q/k row permutation of ``llama`` files (``gguf_convert.unpermute_qk``) is undone on
the quantized rows: a whole row of blocks moves with its output feature, so it is a row gather
of bytes.

No weight is materialised in float unless it is dequantized as above: the model's float
parameters of quantized weights are allocated but never written, then dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model_executor.gguf_convert import (
    build_config,
    check_architecture,
    check_expert_tensors,
    hf_float,
    hf_shape,
    hf_tensor_name,
    open_gguf,
    permutes_qk,
    unpermute_qk,
)
from kvserve.ops import quant
from kvserve.ops.quant_pack import q8_0_from_q5_0

logger = logging.getLogger("kvserve.gguf")

#: GGUF types without a kernel that load as another kernel's blocks, exactly: type -> (the type
#: they run as, the repacking of ``[out, row_bytes]`` uint8 rows).
REPACKED = {"q5_0": ("q8_0", q8_0_from_q5_0)}


def _qtype(t) -> str | None:
    """The kernel type ``t`` runs as (its own, or the one it is repacked into), or None."""
    name = t.tensor_type.name.lower()
    if name in REPACKED:
        return REPACKED[name][0]
    return name if name in quant.BLOCK_BYTES else None


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(list(t.shape)))  # ggml lists dims innermost first


def _float_array(path: Path, t, logged: set) -> np.ndarray:
    """The tensor dequantized to float32 in torch order."""
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind not in ("F32", "F16", "BF16") and kind not in logged:
        logged.add(kind)
        logger.info("%s: %s tensors have no quantized kernel; dequantized to float at load", path.name, kind)
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF file {str(path)!r}: tensor {t.name!r} has type {kind}, which cannot be read"
        ) from None
    return np.asarray(arr, dtype=np.float32).reshape(_shape(t))


def _rows(path: Path, t, perm_heads: int | None, logged: set) -> np.ndarray:
    """The quantized bytes of ``t`` as ``[out, row_bytes]`` of its kernel type (``_qtype``),
    q/k rows in HF order; a type in ``REPACKED`` is repacked (one log line per type). A 3-D
    expert stack ``[E, out, in]`` gives ``[E * out, row_bytes]``."""
    *lead, inp = _shape(t)
    out = int(np.prod(lead))
    qtype = _qtype(t)
    assert qtype is not None
    rows = np.asarray(t.data).reshape(out, -1)
    kind = t.tensor_type.name.lower()
    if kind in REPACKED:
        if kind not in logged:
            logged.add(kind)
            logger.info(
                "%s: %s tensors repacked to %s at load (exact)", path.name, kind.upper(), qtype.upper()
            )
        rows = REPACKED[kind][1](rows)
    assert rows.shape[1] == quant.row_bytes(qtype, inp)
    if perm_heads is not None:
        rows = rows[unpermute_qk(np.arange(out), perm_heads)]
    return rows


def _set(module, attr: str, value) -> None:
    module._parameters.pop(attr, None)  # a plain attribute from now on
    setattr(module, attr, value)


def _load_experts(path: Path, model, moe, stacks: list[tuple[str, Any]], logged: set) -> None:
    """Load one layer's expert stacks (``(HF name, GGUF tensor)`` of gate, up, down) into
    ``FusedMoE`` ``moe``: per-expert ``QuantWeight``s where the stacks' types have a kernel
    (``w13_q`` / ``w2_q``), else the float stacks ``w13`` / ``w2`` (see the module doc).

    Raises:
        ValueError: naming the file and tensor: a stack of the wrong shape.
    """
    targets = []
    for name, t in stacks:
        try:
            targets.append(model.weight_target(name, _shape(t)))
        except ValueError as e:
            raise ValueError(f"GGUF file {str(path)!r}: tensor {t.name!r}: {e}") from None
    (_, gate), (_, up), (_, down) = stacks
    n, hidden, inter = moe.num_experts, _shape(gate)[2], _shape(down)[2]
    w13_q: list | None = None
    w2_q: list | None = None
    qtype = _qtype(gate)
    if qtype is not None and _qtype(up) == qtype:
        g = _rows(path, gate, None, logged).reshape(n, inter, -1)
        u = _rows(path, up, None, logged).reshape(n, inter, -1)
        w13_q = [
            quant.QuantWeight(torch.from_numpy(np.concatenate([g[e], u[e]])), qtype, hidden) for e in range(n)
        ]
    else:
        for (_, t), target in zip(stacks[:2], targets[:2]):
            target.copy_(torch.from_numpy(_float_array(path, t, logged)))
    if _qtype(down) is not None:
        d = _rows(path, down, None, logged).reshape(n, hidden, -1)
        w2_q = [quant.QuantWeight(torch.from_numpy(d[e].copy()), str(_qtype(down)), inter) for e in range(n)]
    else:
        targets[2].copy_(torch.from_numpy(_float_array(path, down, logged)))
    if w13_q is None and w2_q is None:
        return  # both float: the grouped expert GEMMs
    # a quantized stack: both run in the per-expert loop (a float one as per-expert float weights)
    moe.w13_q = w13_q if w13_q is not None else list(moe.w13.data.unbind(0))
    moe.w2_q = w2_q if w2_q is not None else list(moe.w2.data.unbind(0))
    del moe.w13, moe.w2
    for w in moe.w13_q + moe.w2_q:
        if isinstance(w, quant.QuantWeight):
            quant.prepare(w, gemm_only=True)


def load_gguf_model(
    gguf_path: Path, dtype: torch.dtype, device: str, hf_config=None, max_position: int | None = None
):
    """The model of ``gguf_path`` (``models.registry``'s class for its config) with its weights,
    quantized ones kept quantized.

    Args:
        gguf_path: a GGUF file of an architecture ``gguf_convert.ARCHITECTURES`` names.
        dtype: activation (and float weight) dtype: float32 or bfloat16.
        device: must be ``"cpu"`` (the kernels are CPU kernels).
        hf_config: the model's config (default: built from the GGUF metadata).
    Raises:
        ValueError: another device or dtype; a file that cannot be read; a tensor with an
            unexpected name, shape or type; a missing tensor (each naming the file and tensor);
            ``KVSERVE_QUANT_ACT`` neither ``float`` nor ``int8``.
    """
    from kvserve.model_executor.models import registry
    from kvserve.model_executor.models.moe import MoeBlock

    if device != "cpu":
        raise ValueError(f"quantization='gguf' runs on CPU only, got device={device!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization='gguf' needs dtype float32 or bfloat16, got {dtype}")
    quant.activation_mode()  # a bad KVSERVE_QUANT_ACT fails at load, not in a request
    path = Path(gguf_path)
    reader = open_gguf(path)
    where = f"GGUF file {str(path)!r}"
    arch = check_architecture(reader, where)
    try:
        tensors = {}
        for t in reader.tensors:
            name = hf_tensor_name(t.name, arch)
            if name is not None:
                tensors[name] = t
    except ValueError as e:
        raise ValueError(f"GGUF file {str(path)!r}: {e}") from None
    cfg = hf_config if hf_config is not None else build_config(reader, "lm_head.weight" in tensors, where)
    check_expert_tensors(reader, cfg, where)
    logged: set = set()
    with torch.no_grad():
        model = registry.model_class(cfg, where)(cfg, dtype=dtype, device="cpu", max_position=max_position)
        qk = permutes_qk(arch)  # llama.cpp interleaved llama's q/k rows only
        loaded: set[str] = set()
        groups = []
        experts = []  # (FusedMoE, [(HF name, GGUF tensor)] of gate, up, down)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            qkv = [
                (p + "self_attn.q_proj.weight", a.num_heads if qk else None),
                (p + "self_attn.k_proj.weight", a.num_kv_heads if qk else None),
                (p + "self_attn.v_proj.weight", None),
            ]
            if p + "self_attn.qkv_proj.weight" in tensors:  # Phi-3: fused in the file
                qkv = [(p + "self_attn.qkv_proj.weight", None)]
            groups += [(a, "qkv_weight", qkv), (a, "o_weight", [(p + "self_attn.o_proj.weight", None)])]
            mlp, m = layer.mlp, p + "mlp."
            if isinstance(mlp, MoeBlock):
                prefix = f"{p}{model.family.prefix}.experts."
                experts.append(
                    (mlp.experts, [(prefix + w + ".weight", None) for w in model.family.expert_names])
                )
                if mlp.shared_expert is None:
                    continue
                mlp, m = mlp.shared_expert, p + "mlp.shared_expert."
            gate_up = [(m + "gate_proj.weight", None), (m + "up_proj.weight", None)]
            if m + "gate_up_proj.weight" in tensors:  # Phi-3: fused in the file
                gate_up = [(m + "gate_up_proj.weight", None)]
            groups += [
                (mlp, "gate_up_weight", gate_up),
                (mlp, "down_weight", [(m + "down_proj.weight", None)]),
            ]
        groups.append((model, "embed_tokens", [("model.embed_tokens.weight", None)]))
        if not model.tie_word_embeddings:
            groups.append((model, "lm_head", [("lm_head.weight", None)]))
        grouped = {name for _, _, parts in groups for name, _ in parts}
        grouped |= {name for _, parts in experts for name, _ in parts}
        for moe, parts in experts:
            stacks = [(n, tensors[n]) for n, _ in parts if n in tensors]
            if len(stacks) == len(parts):  # (else check_all_loaded names what is missing)
                _load_experts(path, model, moe, stacks, logged)
                loaded.update(n for n, _ in stacks)
        for module, attr, parts in groups:
            present = [(tensors[n], n, h) for n, h in parts if n in tensors]
            if len(present) != len(parts):
                continue  # check_all_loaded names what is missing
            targets = []
            for t, n, _ in present:
                try:
                    targets.append(model.weight_target(n, _shape(t)))
                except ValueError as e:
                    raise ValueError(f"GGUF file {str(path)!r}: tensor {t.name!r}: {e}") from None
            types = {_qtype(t) for t, _, _ in present}
            qtype = types.pop() if len(types) == 1 else None  # the parts' one supported type
            if qtype is not None:
                rows = np.concatenate(
                    [_rows(path, t, h, logged) for t, _, h in present]
                )  # a copy: owns its memory
                qw = quant.QuantWeight(torch.from_numpy(rows), qtype, _shape(present[0][0])[1])
                _set(module, attr, qw)
                if attr == "embed_tokens" and model.tie_word_embeddings:
                    _set(model, "lm_head", qw)
                if attr != "embed_tokens" or model.tie_word_embeddings:  # (a GEMM weight)
                    quant.prepare(qw, gemm_only=attr != "embed_tokens")  # (a lookup reads data)
            else:
                for (t, _, h), target in zip(present, targets):
                    assert target is not None  # only ignored tensors have none; none is grouped
                    arr = _float_array(path, t, logged)
                    if h is not None:
                        arr = unpermute_qk(arr, h)
                    target.copy_(torch.from_numpy(np.array(arr, dtype=np.float32, order="C")))
            loaded.update(n for _, n, _ in present)
        for name, t in tensors.items():
            if name in grouped:
                continue
            try:
                target = model.weight_target(name, hf_shape(name, _shape(t)))
            except ValueError as e:
                raise ValueError(f"GGUF file {str(path)!r}: tensor {t.name!r}: {e}") from None
            if target is None:
                continue
            arr = hf_float(arch, name, _float_array(path, t, logged)).reshape(tuple(target.shape))
            if not qk:
                pass
            elif name.endswith("q_proj.bias"):
                arr = unpermute_qk(arr, cfg.num_attention_heads)
            elif name.endswith("k_proj.bias"):
                arr = unpermute_qk(arr, cfg.num_key_value_heads)
            target.copy_(torch.from_numpy(np.array(arr, dtype=np.float32, order="C")))
            loaded.add(name)
        try:
            model.check_all_loaded(loaded)
        except ValueError as e:
            raise ValueError(f"GGUF file {str(path)!r}: {e}") from None
        model.prepack_linear_weights()
    model.eval()
    return model
