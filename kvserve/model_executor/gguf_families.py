"""GGUF files of Phi-3 (``phi3``) and of the mixture-of-experts architectures (``qwen2moe``,
``qwen3moe``, ``olmoe``, and ``llama`` files with ``llama.expert_count``: Mixtral): their tensor
names and the transformers configs their metadata describes.

The conventions are those of llama.cpp's ``convert_hf_to_gguf.py``:

- Phi-3: q/k/v fused in ``attn_qkv``, gate and up fused in ``ffn_up`` (gate rows first), as
  the HF checkpoint holds them; ``phi3.rope.dimension_count`` is ``partial_rotary_factor *
  head_dim``; LongRoPE (``longrope`` / ``su``) is not a metadata type but the tensors
  ``rope_factors_long`` / ``rope_factors_short`` (``rotary_dim / 2`` float32 each) beside
  ``phi3.rope.scaling.attn_factor`` and ``phi3.rope.scaling.original_context_length``;
  ``phi3.attention.sliding_window`` 0 means none.
- Experts: one 3-D tensor per projection and layer, ``ffn_gate_exps`` / ``ffn_up_exps``
  ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]`` (torch order), the router
  ``ffn_gate_inp`` ``[E, H]``; Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` and its
  gate ``ffn_gate_inp_shexp`` (``[H]``: one row). ``<arch>.expert_count``,
  ``expert_used_count`` and ``expert_feed_forward_length`` (Qwen's expert size;
  ``feed_forward_length`` is the dense layers'), ``expert_shared_feed_forward_length``.
  Renormalising the top-k weights follows ``<arch>.expert_weights_norm`` when present, else
  what llama.cpp does per architecture (Mixtral and Qwen3-MoE yes, Qwen2-MoE and OLMoE no).
  Layers without expert tensors but with ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` are dense
  (Qwen's ``mlp_only_layers``). Mixtral's q/k rows are permuted as any llama file's;
  the others' are stored as HF has them.

Stacked experts get the HF-style name ``<layer>.<prefix>.experts.<projection>.weight``
(``models/moe.py`` takes it whole); the float conversion writes one tensor per expert.
"""

from __future__ import annotations

import numpy as np

#: GGUF expert-stack tensor name -> index of the projection in ``MoeFamily.expert_names``
#: (gate, up, down).
EXPERT_STACKS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}

#: llama.cpp's renormalisation of the top-k routing weights, by architecture, when the file has
#: no ``<arch>.expert_weights_norm``.
NORM_TOPK_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}

#: The MoE architectures named by ``general.architecture`` alone -> (``model_type``, config
#: class, HF architecture). Mixtral is a ``llama`` file with experts.
MOE_ARCHITECTURES = {
    "qwen2moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM"),
}

_SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


def expert_layer_map(prefix: str, expert_names: tuple[str, str, str], shared: bool) -> dict[str, str]:
    """GGUF layer tensor suffix -> HF name under the layer, for the router, the expert stacks
    (``<prefix>.experts.<projection>.weight``) and, with ``shared``, the shared expert."""
    out = {"ffn_gate_inp.weight": f"{prefix}.gate.weight"}
    for gguf_name, i in EXPERT_STACKS.items():
        out[gguf_name] = f"{prefix}.experts.{expert_names[i]}.weight"
    if shared:
        out.update(_SHARED_EXPERT)
    return out


def phi3_layer_map(base: dict[str, str]) -> dict[str, str]:
    """Phi-3's layer tensor names: ``base`` (Llama's) with the fused ``attn_qkv`` and ``ffn_up``
    (gate and up) in place of the separate ones."""
    out = {k: v for k, v in base.items() if not k.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate."))}
    out.update(
        {
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "attn_qkv.bias": "self_attn.qkv_proj.bias",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
        }
    )
    return out


#: Global tensors that hold no HF weight (rope settings kept as tensors).
IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor of GGUF ``shape`` (torch order): Qwen2-MoE's shared-expert gate
    is one row ``[H]`` in GGUF files, ``[1, H]`` in HF checkpoints."""
    if hf_name.endswith("shared_expert_gate.weight") and len(shape) == 1:
        return (1, *shape)
    return shape


def has_experts(reader, arch: str) -> bool:
    """Whether the file is a mixture-of-experts model: a MoE architecture, or a ``llama`` file
    (Mixtral) with a positive ``llama.expert_count``."""
    if arch in MOE_ARCHITECTURES:
        return True
    f = reader.fields.get(f"{arch}.expert_count")
    return arch == "llama" and f is not None and int(f.contents()) > 0


def _tensor_names(reader) -> set[str]:
    return {t.name for t in reader.tensors}


def moe_config(reader, arch: str, common: dict, field, required_int, where: str):
    """The transformers config (``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``,
    ``OlmoeConfig``) of a MoE file.

    Args:
        common: the Llama-shaped keyword arguments read from ``<arch>.*`` already (sizes,
            heads, rope, norms, token ids).
        field: ``field(key, default)`` reads a metadata value; ``required_int(key)`` a positive
            integer or raises.
    Raises:
        ValueError: naming ``where`` and the key: a missing or non-positive
            ``expert_count`` / ``expert_used_count`` / expert size, ``expert_used_count``
            above ``expert_count``, a config transformers refuses.
    """
    import transformers

    n_exp = required_int(f"{arch}.expert_count")
    used = required_int(f"{arch}.expert_used_count")
    if used > n_exp:
        raise ValueError(
            f"{where}: metadata key '{arch}.expert_used_count' ({used}) must be at most "
            f"'{arch}.expert_count' ({n_exp})"
        )
    norm = bool(field(f"{arch}.expert_weights_norm", NORM_TOPK_DEFAULT[arch]))
    names = _tensor_names(reader)
    blocks = int(common["num_hidden_layers"])
    dense = [i for i in range(blocks) if f"blk.{i}.ffn_gate_exps.weight" not in names]
    dense = [i for i in dense if f"blk.{i}.ffn_gate.weight" in names]  # (else: missing experts)
    kw = dict(common)
    kw.pop("attention_bias", None)
    if arch == "llama":
        config_class, hf_arch = "MixtralConfig", "MixtralForCausalLM"
        expert_ffn = field(f"{arch}.expert_feed_forward_length")
        if expert_ffn is not None:
            kw["intermediate_size"] = required_int(f"{arch}.expert_feed_forward_length")
        kw.update(num_local_experts=n_exp, num_experts_per_tok=used)
    else:
        _, config_class, hf_arch = MOE_ARCHITECTURES[arch]
        kw.update(num_experts=n_exp, num_experts_per_tok=used, norm_topk_prob=norm)
        if arch == "olmoe":
            if field(f"{arch}.expert_feed_forward_length") is not None:
                kw["intermediate_size"] = required_int(f"{arch}.expert_feed_forward_length")
            kw["clip_qkv"] = field(f"{arch}.attention.clamp_kqv")
        else:
            kw.update(
                moe_intermediate_size=required_int(f"{arch}.expert_feed_forward_length"),
                decoder_sparse_step=1,
                mlp_only_layers=dense,
            )
        if arch == "qwen2moe":
            kw["shared_expert_intermediate_size"] = required_int(f"{arch}.expert_shared_feed_forward_length")
            kw["qkv_bias"] = "blk.0.attn_q.bias" in names
    try:
        cfg = getattr(transformers, config_class)(**kw)
    except Exception as e:  # transformers' own config validation
        raise ValueError(
            f"{where}: its metadata describes no valid {arch} mixture-of-experts model: {e}"
        ) from None
    cfg.architectures = [hf_arch]
    return cfg


def _factors(reader, name: str, n: int, where: str) -> list[float] | None:
    """The float values of 1-D tensor ``name`` (``n`` of them), or None when absent."""
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
    if arr.size != n:
        raise ValueError(
            f"{where}: tensor {name!r} has {arr.size} values, expected {n} (rope.dimension_count / 2)"
        )
    return [float(v) for v in arr]


def phi3_config(reader, common: dict, field, where: str):
    """The ``Phi3Config`` of a ``phi3`` file: the Llama-shaped ``common`` keyword arguments plus
    partial rotary (``phi3.rope.dimension_count`` against ``hidden / heads``), LongRoPE from the
    ``rope_factors_long`` / ``rope_factors_short`` tensors, ``original_max_position_embeddings``
    and the sliding window (see the module doc).

    Raises:
        ValueError: naming ``where`` and the tensor or key: one rope factor tensor without the
            other, factors of the wrong length, a rope dimension count that is not an even
            number up to the head size, a config transformers refuses.
    """
    from transformers import Phi3Config

    kw = dict(common)
    kw.pop("attention_bias", None)
    kw.pop("head_dim", None)  # Phi-3's is hidden / heads (rope.dimension_count may be partial)
    head_dim = int(kw["hidden_size"]) // int(kw["num_attention_heads"])
    rope_dims = field("phi3.rope.dimension_count", head_dim)
    if (
        isinstance(rope_dims, bool)
        or not isinstance(rope_dims, (int, np.integer))
        or not (0 < rope_dims <= head_dim and rope_dims % 2 == 0)
    ):
        raise ValueError(
            f"{where}: metadata key 'phi3.rope.dimension_count' must be an even number in "
            f"[2, {head_dim}] (the head size), got {rope_dims!r}"
        )
    rope = dict(kw.pop("rope_parameters"))
    long = _factors(reader, "rope_factors_long.weight", int(rope_dims) // 2, where)
    short = _factors(reader, "rope_factors_short.weight", int(rope_dims) // 2, where)
    if (long is None) != (short is None):
        missing = "rope_factors_short.weight" if short is None else "rope_factors_long.weight"
        raise ValueError(f"{where}: tensor {missing!r} is missing (LongRoPE needs both factor tensors)")
    if long is not None:
        rope = {
            "rope_type": "longrope",
            "rope_theta": rope["rope_theta"],
            "short_factor": short,
            "long_factor": long,
        }
        attn = field("phi3.rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
    if rope_dims != head_dim:
        rope["partial_rotary_factor"] = int(rope_dims) / head_dim
    window = field("phi3.attention.sliding_window")
    try:
        cfg = Phi3Config(
            **kw,
            rope_parameters=rope,
            original_max_position_embeddings=int(
                field("phi3.rope.scaling.original_context_length", kw["max_position_embeddings"])
            ),
            sliding_window=int(window) if window else None,
        )
    except Exception as e:  # transformers' own config validation
        raise ValueError(f"{where}: its metadata describes no valid phi3 model: {e}") from None
    cfg.architectures = ["Phi3ForCausalLM"]
    return cfg
