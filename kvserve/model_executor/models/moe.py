"""Mixture-of-experts decoders on the Llama skeleton: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each family is the Llama decoder (``models/llama.py``: fused q/k/v, rotary, paged attention,
RMSNorm) with its MLP replaced, in the sparse layers, by a routed ``FusedMoE``
(``layers/fused_moe.py``), and with its attention extras:

| family | experts (config field) | expert size | top-k renormalised | extras |
|---|---|---|---|---|
| Mixtral | ``num_local_experts`` | ``intermediate_size`` | always | |
| Qwen2-MoE | ``num_experts`` | ``moe_intermediate_size`` | ``norm_topk_prob`` | q/k/v bias by ``qkv_bias``; a shared expert (``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``; dense layers by ``decoder_sparse_step`` / ``mlp_only_layers`` |
| Qwen3-MoE | ``num_experts`` | ``moe_intermediate_size`` | ``norm_topk_prob`` | RMSNorm of q and k per head (``head_dim``); dense layers as Qwen2-MoE |
| OLMoE | ``num_experts`` | ``intermediate_size`` | ``norm_topk_prob`` | RMSNorm of q and k over the whole projection (all heads at once); ``clip_qkv`` |

Checkpoint names: experts one by one (Mixtral ``block_sparse_moe.experts.N.w1/w3/w2`` = gate /
up / down, router ``block_sparse_moe.gate``; the others ``mlp.experts.N.gate_proj/up_proj/down_proj``,
router ``mlp.gate``), already stacked (``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]`` and
``<prefix>.experts.down_proj`` ``[E, H, I]``, transformers' in-memory layout), or stacked one
projection each (``<prefix>.experts.<gate|up|down name>.weight``: ``[E, I, H]``, ``[E, I, H]``,
``[E, H, I]``, a GGUF file's ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``).

int8 / int4 at load quantize the experts one weight each (``FusedMoE.quantize_stack``) besides
the attention and dense linears; routers stay float. Tensor parallelism splits attention and
dense layers as the Llama skeleton does and every expert (and the shared expert) by
intermediate columns, one all-reduce per ``MoeBlock``. LoRA adapters apply to the attention
linears and to dense layers' and shared experts' MLP linears (``lora_mlp``); the LoRA reader
refuses adapters on routed experts and routers. Not supported (a ValueError naming the family):
quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors); GGUF files keep their
quantized experts (``gguf_loader``). Pure-decode CPU steps run the module path (the fused native decode step
has no MoE kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.fused_moe import FusedMoE
from kvserve.model_executor.layers.rmsnorm import RMSNorm
from kvserve.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


@dataclass(frozen=True)
class MoeFamily:
    """How one family's config and checkpoint spell its MoE parts.

    Attributes:
        name: the architecture, for messages.
        experts_field: config field holding the number of experts.
        inter_field: config field holding each expert's intermediate size.
        prefix: the MLP's checkpoint name under a layer (``block_sparse_moe`` / ``mlp``).
        expert_names: checkpoint names of an expert's gate, up and down weights.
        renormalize: None: read ``norm_topk_prob``; else always this.
        float32_weights: see ``FusedMoE``.
        qk_norm: None, ``"head"`` (per head, ``[head_dim]`` weights) or ``"proj"`` (over the
            whole q / k projection).
        shared_expert: a shared expert plus its sigmoid gate in every sparse layer.
        dense_layers: ``decoder_sparse_step`` / ``mlp_only_layers`` pick dense layers.
    """

    name: str
    experts_field: str
    inter_field: str
    prefix: str
    expert_names: tuple[str, str, str]
    renormalize: bool | None
    float32_weights: bool = False
    qk_norm: str | None = None
    shared_expert: bool = False
    dense_layers: bool = False


#: ``model_type`` -> its family.
FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily(
        "MixtralForCausalLM",
        "num_local_experts",
        "intermediate_size",
        "block_sparse_moe",
        ("w1", "w3", "w2"),
        renormalize=True,
        float32_weights=True,
    ),
    "qwen2_moe": MoeFamily(
        "Qwen2MoeForCausalLM",
        "num_experts",
        "moe_intermediate_size",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        renormalize=None,
        shared_expert=True,
        dense_layers=True,
    ),
    "qwen3_moe": MoeFamily(
        "Qwen3MoeForCausalLM",
        "num_experts",
        "moe_intermediate_size",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        renormalize=None,
        qk_norm="head",
        dense_layers=True,
    ),
    "olmoe": MoeFamily(
        "OlmoeForCausalLM",
        "num_experts",
        "intermediate_size",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        renormalize=None,
        qk_norm="proj",
    ),
}


def family_of(cfg) -> MoeFamily:
    """The ``MoeFamily`` of transformers config ``cfg``.

    Raises:
        ValueError: its ``model_type`` is not an MoE family here.
    """
    fam = FAMILIES.get(getattr(cfg, "model_type", ""))
    if fam is None:
        raise ValueError(
            f"config.json model_type={getattr(cfg, 'model_type', None)!r} is not an MoE family "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return fam


def is_sparse_layer(cfg, fam: MoeFamily, index: int) -> bool:
    """Whether decoder layer ``index`` has the routed experts (else a dense MLP of
    ``intermediate_size``): every layer, unless the family has ``decoder_sparse_step`` /
    ``mlp_only_layers`` (sparse when ``index`` is not listed and ``(index + 1) % step == 0``)."""
    if not fam.dense_layers:
        return True
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only = getattr(cfg, "mlp_only_layers", None) or []
    return index not in only and int(getattr(cfg, fam.experts_field)) > 0 and (index + 1) % step == 0


class MoeAttention(LlamaAttention):
    """``LlamaAttention`` with the family's q/k norm, q/k/v bias and ``clip_qkv``."""

    def __init__(self, cfg, fam: MoeFamily, rope, dtype, device, tp=None):
        super().__init__(cfg, rope, dtype, device, tp)
        if fam.name == "Qwen2MoeForCausalLM":  # q/k/v bias by qkv_bias, o never
            self.qkv_bias = (
                nn.Parameter(
                    torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype, device=device),
                    requires_grad=False,
                )
                if getattr(cfg, "qkv_bias", True)
                else None
            )
            self.o_bias = None
        self.qk_norm = fam.qk_norm
        eps = cfg.rms_norm_eps
        self.q_norm = None
        self.k_norm = None
        if fam.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device)
        elif fam.qk_norm == "proj":
            self.q_norm = RMSNorm(self.q_size, eps, dtype, device)
            self.k_norm = RMSNorm(self.kv_size, eps, dtype, device)
        clip = getattr(cfg, "clip_qkv", None)
        self.clip_qkv = None if clip is None else float(clip)

    def transform_qkv(self, qkv: torch.Tensor) -> None:
        """Norm q and k (per head or over the projection), then clamp q, k, v to
        ``[-clip_qkv, clip_qkv]`` (OLMoE's order), in place on ``[T, q + 2 * kv]``."""
        if self.q_norm is not None and self.k_norm is not None:
            T = qkv.shape[0]
            q = qkv[:, : self.q_size]
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            if self.qk_norm == "head":
                q.copy_(self.q_norm(q.reshape(T * self.num_heads, self.head_dim)).view(T, -1))
                k.copy_(self.k_norm(k.reshape(T * self.num_kv_heads, self.head_dim)).view(T, -1))
            elif self.tp is None:
                q.copy_(self.q_norm(q.contiguous()))
                k.copy_(self.k_norm(k.contiguous()))
            else:
                self._sharded_proj_norm(q, k)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)

    def _sharded_proj_norm(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """OLMoE's whole-projection RMSNorm of q and k when this rank holds 1/T of each
        projection's columns (its heads) and of the norm weights: the per-row sums of squares
        are added over the ranks (one all-reduce for q and k together), then each rank scales
        its columns. In place on the ``[T, q]`` and ``[T, kv]`` views."""
        t = int(self.tp.world_size)
        sq = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=1)
        sq = self.tp.all_reduce(sq.contiguous())
        for part, norm, col, full in (
            (q, self.q_norm, 0, self.q_size * t),
            (k, self.k_norm, 1, self.kv_size * t),
        ):
            norm = cast(RMSNorm, norm)
            inv = torch.rsqrt(sq[:, col : col + 1] / full + norm.eps)
            part.copy_((part.float() * inv).to(part.dtype) * norm.weight)


class MoeBlock(nn.Module):
    """The sparse MLP of one layer: routed experts (``experts``: ``FusedMoE``) plus, for
    Qwen2-MoE, ``sigmoid(x @ shared_expert_gate.T) * shared_expert(x)``.

    With a tensor-parallel group ``tp`` of size T each rank holds 1/T of every expert's and of
    the shared expert's intermediate columns (router and shared-expert gate whole): both give
    partial sums of the output, added over the ranks by one all-reduce per block."""

    #: Rows per call: bounds the gathered ``[rows * top_k, H]`` and ``[rows * top_k, 2I]``
    #: activations of long prefills.
    CHUNK_ROWS = 2048

    def __init__(self, cfg, fam: MoeFamily, dtype, device, tp=None):
        super().__init__()
        self.tp = tp
        t = 1 if tp is None else int(tp.world_size)
        renorm = fam.renormalize
        if renorm is None:
            renorm = bool(getattr(cfg, "norm_topk_prob", False))
        self.experts = FusedMoE(
            int(getattr(cfg, fam.experts_field)),
            int(cfg.num_experts_per_tok),
            cfg.hidden_size,
            int(getattr(cfg, fam.inter_field)) // t,
            renormalize=renorm,
            float32_weights=fam.float32_weights,
            dtype=dtype,
            device=device,
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if fam.shared_expert:
            # this rank's share, summed by the block's all-reduce (not the MLP's own)
            self.shared_expert = LlamaMLP(
                cfg, dtype, device, intermediate_size=int(cfg.shared_expert_intermediate_size) // t
            )
            self.shared_expert_gate = nn.Parameter(
                torch.empty(1, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def _forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        out = self.experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, lora)
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        return out

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; ``lora``: the step's ``LoRAMapping`` or None,
        applied to the shared expert's linears (the routed experts take none)."""
        T = x.shape[0]
        if T <= self.CHUNK_ROWS:
            out = self._forward(x, lora)
        else:
            out = torch.empty_like(x)
            for i in range(0, T, self.CHUNK_ROWS):
                part = None if lora is None else lora.slice(i, min(i + self.CHUNK_ROWS, T))
                out[i : i + self.CHUNK_ROWS] = self._forward(x[i : i + self.CHUNK_ROWS], part)
        return out if self.tp is None else self.tp.all_reduce(out)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose MLP is a ``MoeBlock`` (sparse layers) or a dense ``LlamaMLP``."""

    def __init__(self, cfg, fam: MoeFamily, index: int, rope, dtype, device, tp=None):
        nn.Module.__init__(self)
        self.self_attn = MoeAttention(cfg, fam, rope, dtype, device, tp)
        mlp: nn.Module = (
            MoeBlock(cfg, fam, dtype, device, tp)
            if is_sparse_layer(cfg, fam, index)
            else LlamaMLP(cfg, dtype, device, tp)
        )
        self.mlp = mlp  # type: ignore[assignment]  # the base class types it LlamaMLP
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE decoder + LM head (see the module doc).

    Args: as ``LlamaForCausalLM``. Under tensor parallelism attention and dense layers are
        sharded as there; each sparse layer's experts and shared expert by intermediate
        columns (``MoeBlock``); OLMoE's whole-projection q/k norm weights by the rank's heads.

    Raises:
        ValueError: a ``model_type`` that is not one of ``FAMILIES``, ``hidden_act`` other than
            silu, ``num_experts_per_tok`` outside ``[1, experts]``, a tensor-parallel size that
            does not divide the head counts or an intermediate size (naming the family and
            the field).
    """

    # the fused native decode step has no MoE kernel: pure-decode steps take the module path
    use_native_decode = False
    #: int8 / int4 at load quantize the experts too; a quantized checkpoint's expert tensors
    #: (GPTQ, AWQ, compressed-tensors) have no loader here
    supports_quantized_checkpoints = False
    quantization_refusal = "no loader for quantized expert tensors"

    def __init__(
        self, hf_config, dtype=torch.float32, device="cpu", max_position: int | None = None, tp=None
    ):
        self.family = fam = family_of(hf_config)
        t = 1 if tp is None else int(tp.world_size)
        fields = [fam.inter_field] + (["shared_expert_intermediate_size"] if fam.shared_expert else [])
        for field in fields:
            n = int(getattr(hf_config, field))
            if n % t:
                raise ValueError(
                    f"{fam.name}: tensor_parallel_size={t} must divide {field}={n} (each rank holds "
                    "1/T of every expert's intermediate columns)"
                )
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={act!r} is not supported (only silu).")
        super().__init__(hf_config, dtype=dtype, device=device, max_position=max_position, tp=tp)

    def _decoder_layer(self, cfg, index: int, dtype, device) -> nn.Module:
        return MoeDecoderLayer(self.config, self.family, index, self.rope, dtype, device, self.tp)

    def lora_mlp(self, index: int) -> nn.Module | None:
        """Layer ``index``'s dense MLP, its shared expert, or None (routed experts only: LoRA
        adapters on experts are refused when read, ``kvserve.lora.peft``)."""
        mlp = self.layers[index].mlp
        return mlp.shared_expert if isinstance(mlp, MoeBlock) else mlp

    def _layer_linears(self) -> list[tuple[nn.Module, str]]:
        names: list[tuple[nn.Module, str]] = []
        for layer in self.layers:
            names += [(layer.self_attn, "qkv_weight"), (layer.self_attn, "o_weight")]
            mlp = layer.mlp
            dense = mlp.shared_expert if isinstance(mlp, MoeBlock) else mlp
            if dense is not None:
                names += [(dense, "gate_up_weight"), (dense, "down_weight")]
        return names

    def _quantized_linears(self) -> list[tuple[nn.Module, str, str]]:
        """As ``LlamaForCausalLM``'s, with each sparse layer's stacked experts
        (``FusedMoE.w13`` / ``w2``, quantized expert by expert) and shared expert in place of
        the dense MLP; the routers and the shared expert's gate stay float."""
        out: list[tuple[nn.Module, str, str]] = []
        prefix = self.family.prefix
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out += [
                (layer.self_attn, "qkv_weight", p + "self_attn.q_proj/k_proj/v_proj"),
                (layer.self_attn, "o_weight", p + "self_attn.o_proj"),
            ]
            mlp = layer.mlp
            dense: nn.Module | None = mlp
            where = p + "mlp."
            if isinstance(mlp, MoeBlock):
                g, u, d = self.family.expert_names
                m = f"{p}{prefix}.experts.*."
                out += [(mlp.experts, "w13", f"{m}{g}/{u}"), (mlp.experts, "w2", m + d)]
                dense, where = mlp.shared_expert, f"{p}{prefix}.shared_expert."
            if dense is not None:
                out += [
                    (dense, "gate_up_weight", where + "gate_proj/up_proj"),
                    (dense, "down_weight", where + "down_proj"),
                ]
        out.append((self, "lm_head", "lm_head"))
        return out

    def _quantize_linear(self, module: nn.Module, name: str, method: str) -> None:
        if isinstance(module, FusedMoE):
            module.quantize_stack(name, method)
        else:
            super()._quantize_linear(module, name, method)

    # ------------------------------------------------------------------ weights
    def weight_target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """As ``LlamaForCausalLM.weight_target``, plus the router, the experts (a row range
        of the stacked ``w13`` / ``w2``, or all of it for a stacked checkpoint tensor), the
        shared expert and its gate, and the q/k norms; under tensor parallelism the view holds
        ``shard_shape(name, shape)``.

        Raises:
            ValueError: unknown name or a shape mismatch.
        """
        target = self._moe_target(name)
        if target is None:
            return super().weight_target(name, shape)
        if tuple(target.shape) != self.shard_shape(name, shape):
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(target.shape)}")
        return target

    def _moe_target(self, name: str) -> torch.Tensor | None:
        """The view of a family-specific checkpoint tensor ``name``; None for the others."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return None
        try:
            layer = self.layers[int(parts[2])]
        except (ValueError, IndexError):
            return None
        rest = ".".join(parts[3:])
        attn = cast(MoeAttention, layer.self_attn)
        if rest == "self_attn.q_norm.weight" and attn.q_norm is not None:
            return cast(RMSNorm, attn.q_norm).weight.data
        if rest == "self_attn.k_norm.weight" and attn.k_norm is not None:
            return cast(RMSNorm, attn.k_norm).weight.data
        block: nn.Module = layer.mlp
        fam = self.family
        if not isinstance(block, MoeBlock) or not rest.startswith(fam.prefix + "."):
            return None
        sub = rest[len(fam.prefix) + 1 :]
        moe = block.experts
        if sub == "gate.weight":
            return moe.gate.data
        if sub in ("experts.gate_up_proj", "experts.gate_up_proj.weight"):
            return moe.w13.data
        if sub in ("experts.down_proj", "experts.down_proj.weight"):
            return moe.w2.data
        if sub == "shared_expert_gate.weight" and block.shared_expert_gate is not None:
            return block.shared_expert_gate.data
        shared = block.shared_expert
        if sub.startswith("shared_expert.") and shared is not None:
            which = sub[len("shared_expert.") :]
            if which == "gate_proj.weight":
                return shared.gate_up_weight.data[: shared.inter]
            if which == "up_proj.weight":
                return shared.gate_up_weight.data[shared.inter :]
            if which == "down_proj.weight":
                return shared.down_weight.data
            return None
        bits = sub.split(".")
        if len(bits) == 3 and bits[0] == "experts" and bits[2] == "weight":  # one projection, stacked
            gate, up, down = fam.expert_names
            if bits[1] == gate:
                return moe.w13.data[:, : moe.inter]
            if bits[1] == up:
                return moe.w13.data[:, moe.inter :]
            if bits[1] == down:
                return moe.w2.data
            return None
        if len(bits) == 4 and bits[0] == "experts" and bits[3] == "weight":
            try:
                e = int(bits[1])
            except ValueError:
                return None
            if not 0 <= e < moe.num_experts:
                return None
            gate, up, down = fam.expert_names
            if bits[2] == gate:
                return moe.w13.data[e, : moe.inter]
            if bits[2] == up:
                return moe.w13.data[e, moe.inter :]
            if bits[2] == down:
                return moe.w2.data[e]
        return None

    def _moe_shard(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of family-specific checkpoint tensor ``t`` (full shape) named
        ``name``, or None for a name the base class shards (attention, dense MLPs, vocabulary).
        Experts and the shared expert: the rank's 1/T of the intermediate columns (gate and
        up rows, down input columns; a stacked ``[E, 2I, H]`` tensor's gate and up halves
        each); OLMoE's whole-projection q/k norm weights: the rank's heads' entries; routers,
        the shared expert's gate and per-head norms whole."""
        parts = name.split(".")
        if self.tp_size == 1 or len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return None
        rest = ".".join(parts[3:])
        r, n = self.tp_rank, self.tp_size

        def cut(x: torch.Tensor, dim: int) -> torch.Tensor:
            k = x.shape[dim] // n
            return x.narrow(dim, r * k, k)

        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            return cut(t, 0) if self.family.qk_norm == "proj" else t
        prefix = self.family.prefix + "."
        if not rest.startswith(prefix) or not isinstance(self.layers[int(parts[2])].mlp, MoeBlock):
            return None
        sub = rest[len(prefix) :]
        if sub in ("gate.weight", "shared_expert_gate.weight"):
            return t
        if sub in ("experts.gate_up_proj", "experts.gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=1)
            return torch.cat([cut(gate, 1), cut(up, 1)], dim=1)
        if sub in ("experts.down_proj", "experts.down_proj.weight"):
            return cut(t, 2)
        bits = sub.split(".")
        g, u, d = self.family.expert_names
        if len(bits) == 3 and bits[0] == "experts":  # one projection stacked: [E, I, H] / [E, H, I]
            return cut(t, 1) if bits[1] in (g, u) else cut(t, 2) if bits[1] == d else t
        which = bits[-2] if len(bits) >= 2 else ""
        if bits[0] == "shared_expert":
            which = {"gate_proj": g, "up_proj": u, "down_proj": d}.get(which, "")
        if which in (g, u):
            return cut(t, 0)
        if which == d:
            return cut(t, 1)
        return t

    def shard_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """As ``LlamaForCausalLM.shard_shape``, for the family's expert, shared-expert and
        norm tensors too (``_moe_shard``)."""
        part = self._moe_shard(name, torch.empty(shape, device="meta"))
        return super().shard_shape(name, shape) if part is None else tuple(part.shape)

    def shard_weight(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """As ``LlamaForCausalLM.shard_weight``, for the family's expert, shared-expert and
        norm tensors too (``_moe_shard``)."""
        part = self._moe_shard(name, t)
        return super().shard_weight(name, t) if part is None else part

    def check_all_loaded(self, loaded) -> None:
        """Raises ValueError naming the expected weights absent from ``loaded``; a stacked
        expert tensor (both projections or one) stands for its experts' one-by-one names."""
        loaded = set(loaded)
        fam = self.family
        gate, up, down = fam.expert_names
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.mlp, MoeBlock):
                continue
            p = f"model.layers.{i}.{fam.prefix}.experts."
            n = layer.mlp.experts.num_experts
            if {p + "gate_up_proj", p + "gate_up_proj.weight"} & loaded:
                loaded.update(f"{p}{e}.{w}.weight" for e in range(n) for w in (gate, up))
            if {p + "down_proj", p + "down_proj.weight"} & loaded:
                loaded.update(f"{p}{e}.{down}.weight" for e in range(n))
            for w in (gate, up, down):
                if f"{p}{w}.weight" in loaded:
                    loaded.update(f"{p}{e}.{w}.weight" for e in range(n))
        super().check_all_loaded(loaded)

    def _expected_names(self) -> list[str]:
        fam = self.family
        names = []
        for name in super()._expected_names():
            parts = name.split(".")
            is_mlp = len(parts) > 4 and parts[3] == "mlp"
            if is_mlp and isinstance(self.layers[int(parts[2])].mlp, MoeBlock):
                continue  # a sparse layer: its names are added below
            names.append(name)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            if cast(MoeAttention, layer.self_attn).q_norm is not None:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            block = layer.mlp
            if not isinstance(block, MoeBlock):
                continue
            m = p + fam.prefix + "."
            names.append(m + "gate.weight")
            names += [
                f"{m}experts.{e}.{w}.weight"
                for e in range(block.experts.num_experts)
                for w in fam.expert_names
            ]
            if block.shared_expert is not None:
                names += [m + f"shared_expert.{s}_proj.weight" for s in ("gate", "up", "down")]
                names.append(m + "shared_expert_gate.weight")
        return names
