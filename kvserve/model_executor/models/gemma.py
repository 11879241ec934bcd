"""Gemma 2 and Gemma 3 (text) decoders on the paged KV cache, built from the Llama family's parts.

What differs from Llama (``models/llama.py``, whose fused q/k/v and gate/up weights, weight
loading, packing and quantization this module reuses):

* the token embedding is multiplied by ``sqrt(hidden_size)``, rounded to the model dtype;
* every RMSNorm scales by ``1 + weight`` in float32 (``OffsetRMSNorm``), and a layer has four:
  input, post-attention, pre-feedforward, post-feedforward (both sub-blocks are
  ``x + post_norm(block(pre_norm(x)))``);
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``;
* layers attend with their own sliding window (``layer_types``: ``sliding_attention`` layers
  see the last ``sliding_window`` positions, ``full_attention`` layers all of them): each layer
  takes its window's variant of the step's metadata (``AttentionMetadata.for_window``), built
  by the runner for every window in ``layer_windows``;
* Gemma 2: attention logits soft-capped (``attn_logit_softcapping``; the torch attention paths,
  see ``PagedAttention``) and final logits soft-capped (``final_logit_softcapping``):
  ``c * tanh(x / c)``;
* Gemma 3: q and k normalised per head (``q_norm`` / ``k_norm``) before the rotary embedding,
  and the sliding layers' rotary base is their own (``rope_parameters["sliding_attention"]``,
  ``rope_local_base_freq`` in older configs) while global layers use ``rope_theta`` and its
  scaling. transformers' Gemma 3 does not apply ``attn_logit_softcapping``; neither does this.

LoRA adapters run on the fused q/k/v, o, gate/up and down linears as on Llama (module path).
Tensor parallelism shards as Llama does (heads and MLP columns, the vocab-parallel LM head; the
q/k norms are per head dimension, so every rank holds them whole); the final soft-cap applies
to the gathered logits. Not supported (ValueError at build, naming the family): bidirectional
attention (``use_bidirectional_attention``), activations other than the tanh or exact GELU.

Pure-decode CPU steps run as one native call for all layers (``cpu_decode_step``, Gemma's
layer in ``csrc/decode_layers.c``), the module path's kernels in its order, where the one-call
step applies: no tensor parallelism, the tanh GELU, no attention soft-cap (Gemma 2's layers
keep the module path: the decode attention kernel does not cap), native GEMMs for the weights;
the embedding scale stays here. Otherwise the module path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.attention import AttentionMetadata, PagedAttention
from kvserve.model_executor.layers.linear import linear
from kvserve.model_executor.layers.rmsnorm import OffsetRMSNorm
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from kvserve.model_executor.models import cpu_decode_step
from kvserve.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _lora
from kvserve.ops import elementwise

#: ``hidden_activation`` -> the ``approximate`` argument of ``F.gelu``.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


def _family(cfg) -> str:
    return "Gemma 3" if getattr(cfg, "model_type", "") in ("gemma3_text", "gemma3") else "Gemma 2"


def layer_windows(cfg) -> list[int | None]:
    """Per layer, its sliding window in tokens or ``None`` (attends to every position).

    From ``layer_types``; configs without it follow the family's pattern: Gemma 2 alternates
    (even layers slide), Gemma 3 makes every ``sliding_window_pattern``-th layer (default 6)
    global.
    """
    n = int(cfg.num_hidden_layers)
    w = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not types:
        every = 2 if _family(cfg) == "Gemma 2" else int(getattr(cfg, "sliding_window_pattern", 6) or 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for num_hidden_layers={n}")
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise ValueError(
            f"config.json: layer_types {bad} are not supported (sliding_attention, full_attention)"
        )
    return [int(w) if (t == "sliding_attention" and w) else None for t in types]


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, optional per-head q/k norms (Gemma 3), an optional
    logit soft-cap (Gemma 2) and this layer's sliding ``window`` (tokens, ``None`` = global)."""

    def __init__(self, cfg, rope: RotaryEmbedding, dtype, device, window: int | None, qk_norm: bool, tp=None):
        super().__init__(cfg, rope, dtype, device, tp)
        self.window = window
        softcap = getattr(cfg, "attn_logit_softcapping", None) if _family(cfg) == "Gemma 2" else None
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale, softcap)
        self.q_norm: OffsetRMSNorm | None = (
            OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        )
        self.k_norm: OffsetRMSNorm | None = (
            OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; ``cos``/``sin`` of this layer's rotary table."""
        meta = meta.for_window(self.window)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        _lora(self, "qkv", x, qkv, meta.lora)
        if self.q_norm is not None and self.k_norm is not None:  # in place, before the rotary
            self.q_norm.normalize_heads_(qkv, 0, self.num_heads)
            self.k_norm.normalize_heads_(qkv, self.q_size, self.num_kv_heads)
        return self._attend(qkv, cos, sin, kv_cache, meta)


class GemmaMLP(LlamaMLP):
    """GeGLU MLP: ``down(gelu(gate(x)) * up(x))`` with the config's ``hidden_activation``; with
    a tensor-parallel group ``tp`` of size T this rank holds 1/T of the intermediate columns
    (as ``LlamaMLP``)."""

    def __init__(self, cfg, dtype, device, tp=None):
        nn.Module.__init__(self)
        self.tp = tp
        self.inter = cfg.intermediate_size // (1 if tp is None else int(tp.world_size))
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * self.inter, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(cfg.hidden_size, self.inter, dtype=dtype, device=device), requires_grad=False
        )
        act = (
            getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"
        )
        if act not in _GELU:
            raise ValueError(
                f"config.json: hidden_activation={act!r} is not supported for {_family(cfg)} "
                f"(supported: {', '.join(_GELU)})"
            )
        self.approximate = _GELU[act]

    def _forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gu = linear(x, self.gate_up_weight)
        _lora(self, "gate_up", x, gu, lora)
        if self.approximate == "tanh" and elementwise.supported(gu):
            g = elementwise.gelu_tanh_and_mul(gu)  # one pass; the kernel the decode step runs
        else:
            g = F.gelu(gu[:, : self.inter], approximate=self.approximate)
            g.mul_(gu[:, self.inter :])
        out = linear(g, self.down_weight)
        _lora(self, "down", g, out, lora)
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaDecoderLayer(nn.Module):
    """One Gemma layer: ``x + post_attn(attn(in(x)))``, then ``x + post_ff(mlp(pre_ff(x)))``."""

    def __init__(self, cfg, rope: RotaryEmbedding, dtype, device, window: int | None, qk_norm: bool, tp=None):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, rope, dtype, device, window, qk_norm, tp)
        self.mlp = GemmaMLP(cfg, dtype, device, tp)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)

    def forward(self, x, cos, sin, kv_cache, meta):
        """``[T, hidden]`` -> ``[T, hidden]`` (the residual stream after this layer)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = self.post_attention_layernorm(h, add=x)  # x + norm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), meta.lora)
        return self.post_feedforward_layernorm(h, add=x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``, model_type
    ``gemma3_text``) decoder + LM head; see the module doc for what differs from Llama.

    Args:
        hf_config: a transformers ``Gemma2Config`` / ``Gemma3TextConfig``.
        dtype, device, max_position, tp: as ``LlamaForCausalLM``.

    Attributes:
        layer_windows: per layer its sliding window (tokens) or ``None``; the runner builds
            the step's attention metadata for each distinct one.
        attn_softcap: the attention logit soft-cap (Gemma 2) or ``None``; with one the runner
            keeps to the torch attention paths.
        final_softcap: the final logit soft-cap or ``None``.

    Raises:
        ValueError: bidirectional attention, an unsupported activation or ``layer_types``
            entry, naming the family and the field; ``LlamaForCausalLM``'s errors.
    """

    def __init__(
        self, hf_config, dtype=torch.float32, device="cpu", max_position: int | None = None, tp=None
    ):
        family = _family(hf_config)
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"config.json: use_bidirectional_attention is not supported for {family} models")
        self.family = family
        self.layer_windows = layer_windows(hf_config)
        self._qk_norm = family == "Gemma 3"
        super().__init__(hf_config, dtype, device, max_position, tp)
        cfg = hf_config
        self.attn_softcap = self.layers[0].self_attn.attn.softcap
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or None
        max_position = max_position or cfg.max_position_embeddings
        #: The sliding layers' rotary table (Gemma 3's local base; Gemma 2 shares one).
        self.local_rope = RotaryEmbedding(
            self.head_dim, max_position, get_rope_parameters(cfg, "sliding_attention"), dtype, device
        )

    def _decoder_layer(self, cfg, index: int, dtype, device) -> nn.Module:
        return GemmaDecoderLayer(
            cfg, self.rope, dtype, device, self.layer_windows[index], self._qk_norm, self.tp
        )

    def _final_norm(self, cfg, dtype, device) -> nn.Module:
        return OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden_size]`` in the model dtype (the
        arguments as ``LlamaForCausalLM.forward``)."""
        x = self.embed(input_ids)
        # transformers rounds the scale to the model dtype before multiplying
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope_global = self.rope.lookup(positions)
        rope_local = self.local_rope.lookup(positions)
        if (
            kv_caches is not None
            and self.use_native_decode
            and cpu_decode_step.applies(self, kv_caches, meta, x.shape[0])
        ):
            cos, sin = rope_global
            return cpu_decode_step.forward_layers(self, x, cos, sin, kv_caches, meta, rope_local)
        for i, layer in enumerate(self.layers):
            cos, sin = rope_local if self.layer_windows[i] else rope_global
            x = layer(x, cos, sin, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[N, vocab_size]`` for ``[N, hidden_size]``, soft-capped by
        ``final_logit_softcapping`` when the config sets it. Under tensor parallelism as
        ``LlamaForCausalLM.compute_logits`` (every rank calls it; the driver gets the capped
        logits, the other ranks ``None``)."""
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_softcap:
            c = float(self.final_softcap)
            logits = torch.tanh(logits / c) * c
        return logits

    _GEMMA_LAYER_WEIGHTS = (
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    )

    def _destination(self, name: str):
        dst = super()._destination(name)
        if dst is not None:
            return dst
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        if int(parts[2]) >= len(self.layers):
            return None
        layer = self.layers[int(parts[2])]
        rest = ".".join(parts[3:])
        if rest in self._GEMMA_LAYER_WEIGHTS:
            owner: object = layer
            for attr in rest.split(".")[:-1]:
                owner = getattr(owner, attr, None)
            norm = getattr(owner, "weight", None)
            if norm is not None:  # (a Gemma 2 layer has no q/k norms)
                return norm, None
        return None

    def _expected_names(self) -> list[str]:
        names = super()._expected_names()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
            if layer.self_attn.q_norm is not None:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names
