"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Mistral) on the paged KV cache: the decoder
skeleton other families (``qwen3``, ``phi3``) run on by declaring their parts (``DecoderParts``).

Shapes: GQA (``num_key_value_heads``), optional q/k/v bias (Qwen2), RoPE with the config's
``rope_theta`` and scaling (partial rotary, LongRoPE: ``layers.rotary_embedding``), RMSNorm,
SwiGLU MLP, optional tied embeddings, optional sliding window (applied by the runner's attention
masks), optional per-head RMSNorm of q and k (Qwen3). Our own module code: transformers is only
used for the config object.

q/k/v are fused into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (two matmuls
fewer per layer); ``load_weights`` fuses the checkpoint's separate tensors, or takes a
checkpoint's already fused ``self_attn.qkv_proj`` / ``mlp.gate_up_proj`` (Phi-3) whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers import vocab_parallel
from kvserve.model_executor.layers.attention import AttentionMetadata, PagedAttention
from kvserve.model_executor.layers.linear import (
    QUANT_BLOCK,
    QUANT_METHODS,
    LinearWeight,
    check_quant_activations,
    linear,
    lm_head_logits,
    move_to_huge_pages,
    onednn_rows,
    prepack_weight,
    quantize_weight,
)
from kvserve.model_executor.layers.lora import add_lora
from kvserve.model_executor.layers.rmsnorm import RMSNorm
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from kvserve.model_executor.layers.row_buckets import buckets
from kvserve.model_executor.models import cpu_decode_step
from kvserve.ops import elementwise, quant


@dataclass(frozen=True)
class DecoderParts:
    """What a family adds to the decoder skeleton (a family class sets ``PARTS``).

    Attributes:
        qk_norm: an RMSNorm of ``head_dim`` weights (``self_attn.q_norm`` / ``k_norm``) on each
            q and k head after the projection, before rotary (Qwen3). Its weights are per head
            dimension, so every tensor-parallel rank holds all of them.
    """

    qk_norm: bool = False


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _linear_weight(out_f: int, in_f: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_f, in_f, dtype=dtype, device=device), requires_grad=False)


def _tp_size(tp) -> int:
    return 1 if tp is None else int(tp.world_size)


def _lora(module, target: str, x: torch.Tensor, out: torch.Tensor, lora) -> None:
    """Add the step's LoRA deltas of ``module``'s ``target`` linear to ``out`` in place
    (``lora``: the step's ``LoRAMapping`` or None; ``module.lora_stacks`` set by the
    ``LoRAManager``; LoRA runs without tensor parallelism only, so before any all-reduce)."""
    if lora is not None:
        a, b = module.lora_stacks[target]
        add_lora(out, x, a, b, lora, parts=None if module.lora_parts is None else module.lora_parts[target])


class LlamaAttention(nn.Module):
    """Self-attention; with a tensor-parallel group ``tp`` of size T this rank holds heads
    ``[r*H/T, (r+1)*H/T)`` and KV heads ``[r*KH/T, (r+1)*KH/T)`` (column-parallel q/k/v) and the
    matching 1/T of o's input columns (row-parallel o), whose partial outputs are summed over the
    ranks (``tp.all_reduce``)."""

    #: fused target -> ``(A, B)`` device slot stacks, set by ``kvserve.lora.manager.LoRAManager``.
    lora_stacks: dict | None = None
    #: fused target -> its parts' output column bounds (``LoRAManager.part_bounds``).
    lora_parts: dict | None = None

    def __init__(self, cfg, rope: RotaryEmbedding, dtype, device, tp=None, parts: DecoderParts | None = None):
        super().__init__()
        parts = parts or DecoderParts()
        t = _tp_size(tp)
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // t
        self.num_kv_heads = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // t
        self.head_dim = _head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2"
        # linear weights: float Parameters until prepacked or quantized in place after loading
        self.qkv_weight: LinearWeight = _linear_weight(
            self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype, device
        )
        self.qkv_bias = (
            nn.Parameter(
                torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype, device=device), requires_grad=False
            )
            if bias
            else None
        )
        o_bias = bool(getattr(cfg, "attention_bias", False)) and getattr(cfg, "model_type", "") != "qwen2"
        self.o_weight: LinearWeight = _linear_weight(cfg.hidden_size, self.q_size, dtype, device)
        self.o_bias = (
            nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
            if o_bias
            else None
        )
        # per-head q/k norms (a family may put its own norm kind here)
        self.q_norm: nn.Module | None = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if parts.qk_norm else None
        )
        self.k_norm: nn.Module | None = (
            RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if parts.qk_norm else None
        )
        self.rope = rope
        #: rotary + cache write may run as one native pass (``elementwise.rope_write_kv``): it
        #: rotates whole heads, so not with partial rotary
        self.fused_rope = rope.rotary_dim == self.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def transform_qkv(self, qkv: torch.Tensor) -> None:
        """Change the projected ``[T, q + 2 * kv]`` q/k/v in place before rotary: Qwen3's per-head
        q/k RMSNorm when the family declares it (``DecoderParts.qk_norm``); a family with other
        q/k changes (whole-projection norms, clipping) overrides it."""
        if self.q_norm is not None and self.k_norm is not None:
            T = qkv.shape[0]
            q_heads = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
            k_heads = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                T, self.num_kv_heads, self.head_dim
            )
            q_heads.copy_(self._head_norm(self.q_norm, q_heads))
            k_heads.copy_(self._head_norm(self.k_norm, k_heads))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        _lora(self, "qkv", x, qkv, meta.lora)
        self.transform_qkv(qkv)
        return self._attend(qkv, cos, sin, kv_cache, meta)

    def _attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotary, cache write, attention and o for the projected ``qkv`` ``[T, q + 2 kv]``."""
        T = qkv.shape[0]
        fused = self.fused_rope and elementwise.writes_cache(qkv, cos, sin, kv_cache)
        if fused:  # rotary + cache write in one native pass
            qk = elementwise.rope_write_kv(
                qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, kv_cache, meta.slot_mapping
            )
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(
                T, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = RotaryEmbedding.apply(qk, cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(q, k, v, kv_cache, meta, kv_written=fused)
        out = linear(o, self.o_weight, self.o_bias)
        _lora(self, "o", o, out, meta.lora)
        return out if self.tp is None else self.tp.all_reduce(out)

    @staticmethod
    def _head_norm(norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """``norm`` over the last dimension of ``heads`` ``[T, H, D]`` (a strided view):
        ``[T, H, D]`` contiguous, rows of ``D`` normalised one by one."""
        T, H, D = heads.shape
        return cast(torch.Tensor, norm(heads.reshape(T * H, D))).view(T, H, D)


class LlamaMLP(nn.Module):
    """SwiGLU MLP; with a tensor-parallel group ``tp`` of size T this rank holds 1/T of the
    intermediate columns (column-parallel gate/up, row-parallel down, outputs all-reduced)."""

    #: fused target -> ``(A, B)`` device slot stacks, set by ``kvserve.lora.manager.LoRAManager``.
    lora_stacks: dict | None = None
    #: fused target -> its parts' output column bounds (``LoRAManager.part_bounds``).
    lora_parts: dict | None = None

    def __init__(self, cfg, dtype, device, tp=None, intermediate_size: int | None = None):
        super().__init__()
        self.tp = tp
        # intermediate_size: the config's unless given (an MoE family's dense or shared expert)
        self.inter = (intermediate_size or cfg.intermediate_size) // _tp_size(tp)
        # linear weights: float Parameters until prepacked or quantized in place after loading
        self.gate_up_weight: LinearWeight = _linear_weight(2 * self.inter, cfg.hidden_size, dtype, device)
        self.down_weight: LinearWeight = _linear_weight(cfg.hidden_size, self.inter, dtype, device)
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported (only silu).")

    #: Rows per MLP chunk: bounds the ``[T, 2 * intermediate]`` activation of long prefills
    #: (peak memory) without hurting GEMM efficiency.
    CHUNK_ROWS = 2048

    def _forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gu = linear(x, self.gate_up_weight)
        _lora(self, "gate_up", x, gu, lora)
        if elementwise.supported(gu):
            g = elementwise.silu_and_mul(gu)  # one pass instead of silu + mul
        else:
            g = F.silu(gu[:, : self.inter])
            g.mul_(gu[:, self.inter :])
        out = linear(g, self.down_weight)
        _lora(self, "down", g, out, lora)
        return out if self.tp is None else self.tp.all_reduce(out)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; ``lora``: the step's ``LoRAMapping`` or None."""
        T = x.shape[0]
        if T <= self.CHUNK_ROWS:
            return self._forward(x, lora)
        out = torch.empty_like(x)
        for i in range(0, T, self.CHUNK_ROWS):
            part = None if lora is None else lora.slice(i, min(i + self.CHUNK_ROWS, T))
            out[i : i + self.CHUNK_ROWS] = self._forward(x[i : i + self.CHUNK_ROWS], part)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rope: RotaryEmbedding, dtype, device, tp=None, parts: DecoderParts | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rope, dtype, device, tp, parts)
        self.mlp = LlamaMLP(cfg, dtype, device, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.lora), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head.

    Args:
        hf_config: a transformers config (LlamaConfig / Qwen2Config / MistralConfig ...).
        dtype: parameter and activation dtype; device: ``"cpu"`` / ``"cuda"``.
        max_position: length of the rotary tables (``max_position_embeddings`` by default).
        tp: this rank's ``kvserve.worker.parallel_state.TensorParallelGroup`` (None = one
            process). Megatron-style: q/k/v and gate/up column-parallel, o and down
            row-parallel with an all-reduce after each; ``num_kv_heads`` (and so the KV cache)
            is this rank's share. The LM head is vocab-parallel (``layers.vocab_parallel``):
            each rank holds ``ceil(vocab / T)`` rows of it (``vocab_shard``; zero rows pad the
            vocabulary to a multiple of T) and the logits are gathered on the driver (rank 0),
            which alone samples. The embedding table is replicated on CPU and vocab-parallel
            (looked up in range, all-reduced) on CUDA (``vocab_parallel.embedding_is_sharded``);
            a tied LM head is this rank's rows of that table, a view of it (the GEMM reads a
            packed or quantized copy of those rows).

    Raises:
        ValueError: for unsupported activations or rope scaling types, or a ``tp`` size that
            does not divide the head counts or ``intermediate_size``.
    """

    #: Run pure-decode CPU steps as straight native calls (``cpu_decode_step``): same kernels,
    #: same results, without the per-op Python. False forces the module path.
    use_native_decode = True
    #: Run those steps as one native call for all layers (``decode_layers``) where no LoRA
    #: adapter or tensor parallelism needs Python between the kernels; False keeps the
    #: per-layer calls (the same results).
    fuse_native_decode = True
    #: Whether LoRA adapters can target this family (``LoRAManager``'s fused targets).
    supports_lora = True
    #: Whether its linear weights can be quantized (int8 / int4 at load, quantized checkpoints).
    supports_quantization = True
    #: The family's parts on the decoder skeleton; a family module's subclass overrides it.
    PARTS = DecoderParts()

    def __init__(
        self, hf_config, dtype=torch.float32, device="cpu", max_position: int | None = None, tp=None
    ):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.dtype = dtype
        self.tp = tp
        self.tp_size = _tp_size(tp)
        self.tp_rank = 0 if tp is None else int(tp.rank)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % self.tp_size or kv_heads % self.tp_size or cfg.intermediate_size % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} must divide num_attention_heads={heads}, "
                f"num_key_value_heads={kv_heads} and intermediate_size={cfg.intermediate_size}."
            )
        self.num_layers = cfg.num_hidden_layers
        self.head_dim = _head_dim(cfg)
        self.num_kv_heads = kv_heads // self.tp_size
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        #: This rank's vocabulary rows of the LM head (and of a sharded embedding); all at T = 1.
        self.vocab_shard = vocab_parallel.VocabShard.of(cfg.vocab_size, self.tp_size, self.tp_rank)
        #: Whether the embedding table is vocab-parallel too (else replicated on every rank).
        self.shard_embedding = vocab_parallel.embedding_is_sharded(tp, device)
        head_rows = self.vocab_shard.rows
        max_position = max_position or cfg.max_position_embeddings
        self.rope = RotaryEmbedding(self.head_dim, max_position, get_rope_parameters(cfg), dtype, device)
        #: ``cpu_decode_step`` runs this model's pure-decode steps: its kernels rotate whole heads
        self.native_decode_parts = self.rope.rotary_dim == self.head_dim
        # a replicated table is padded to T * S rows (zeros) so that a tied head is a view of it
        embed_rows = head_rows if self.shard_embedding else self.vocab_shard.padded_vocab
        self.embed_tokens = nn.Parameter(
            torch.empty(embed_rows, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        if embed_rows > cfg.vocab_size and not self.shard_embedding:
            self.embed_tokens.data[cfg.vocab_size :].zero_()
        # an nn.ModuleList (registers the layers as submodules), typed by what it holds: torch
        # types its items as plain nn.Module
        self.layers = cast(
            Sequence[LlamaDecoderLayer],
            nn.ModuleList(self._decoder_layer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers)),
        )
        self.norm = self._final_norm(cfg, dtype, device)
        self.lm_head: LinearWeight  # prepacked or quantized in place after loading
        if not self.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(head_rows, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        elif embed_rows == head_rows:  # TP = 1, or a sharded table: the head is the table
            self.lm_head = self.embed_tokens
        else:  # this rank's rows of the replicated table, filled as the table is loaded
            self.lm_head = self.embed_tokens.data[self.vocab_shard.start : self.vocab_shard.start + head_rows]

    def _decoder_layer(self, cfg, index: int, dtype, device) -> nn.Module:
        """Decoder layer ``index`` (a family module overrides this and ``_final_norm``)."""
        return LlamaDecoderLayer(cfg, self.rope, dtype, device, self.tp, self.PARTS)

    def _final_norm(self, cfg, dtype, device) -> nn.Module:
        """The norm after the last layer."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden_size]`` in the model dtype for int64 ``input_ids``
        ``[T]``: from a quantized table, this rank's vocabulary shard, or the plain table."""
        if isinstance(self.embed_tokens, quant.QuantWeight):
            return quant.embedding(input_ids, self.embed_tokens, self.dtype)
        if self.shard_embedding:
            return vocab_parallel.embedding(input_ids, self.embed_tokens, self.vocab_shard, self.tp)
        return F.embedding(input_ids, self.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids, positions: int64 ``[T]``.
            kv_caches: one ``[2, kv_heads, num_blocks, block_size, head_dim]`` tensor per layer,
                or ``None`` (no cache: fresh prefills only).
        Returns:
            ``[T, hidden_size]`` in the model dtype.
        """
        x = self.embed(input_ids)
        cos, sin = self.rope.lookup(positions, meta.long_prompt)
        if (
            kv_caches is not None
            and self.use_native_decode
            and cpu_decode_step.applies(self, kv_caches, meta, x.shape[0])
        ):
            return cpu_decode_step.forward_layers(self, x, cos, sin, kv_caches, meta)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, None if kv_caches is None else kv_caches[i], meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[N, vocab_size]`` for hidden states ``[N, hidden_size]``.

        Under tensor parallelism every rank must call it with the same N (each computes its
        vocabulary slice, gathered on the driver): the driver gets the full logits, the other
        ranks ``None``.
        """
        local = lm_head_logits(hidden, self.lm_head)
        if self.tp is None:
            return local
        return vocab_parallel.gather_logits(local, self.vocab_shard, self.tp)

    def _layer_linears(self) -> list[tuple[nn.Module, str]]:
        """``(module, attribute)`` of every decoder-layer linear weight that ``linear`` runs
        (the prepacked ones); a family with other MLPs overrides it."""
        names: list[tuple[nn.Module, str]] = [
            (layer.self_attn, n) for layer in self.layers for n in ("qkv_weight", "o_weight")
        ]
        names += [(layer.mlp, n) for layer in self.layers for n in ("gate_up_weight", "down_weight")]
        return names

    def lora_mlp(self, index: int) -> nn.Module | None:
        """The MLP module of decoder layer ``index`` whose gate/up and down linears take LoRA
        adapters (``LoRAManager`` sets its ``lora_stacks``), or None where none does."""
        return self.layers[index].mlp

    def prepack_linear_weights(self) -> None:
        """Replace every linear weight (q/k/v, o, gate/up, down, LM head) by its
        ``prepack_weight`` form, after ``load_weights``; a no-op off CPU (and for float16).
        A tied LM head gets its own packed copy (the embedding table stays plain)."""
        names = self._layer_linears()
        # a tied lm_head is the embedding Parameter (or, replicated under TP, a view of this
        # rank's rows of it): it is replaced by a packed copy
        names.append((self, "lm_head"))
        packed_weights = []
        for module, name in names:
            packed = prepack_weight(getattr(module, name))
            if packed is not getattr(module, name):
                module._parameters.pop(name, None)  # a plain attribute from now on
                setattr(module, name, packed)
                packed_weights.append(packed)
        move_to_huge_pages(packed_weights)

    def warm_row_buckets(self, max_rows: int) -> int:
        """Run every oneDNN GEMM primitive a step of up to ``max_rows`` rows can need, once, on
        zeros: each weight shape of a layer (all layers share them) at each row bucket
        (``row_buckets.buckets``) that ``linear`` sends to oneDNN, and the LM head at the buckets
        of up to ``min(max_rows, 256)`` rows (sampled rows). Why: oneDNN builds a primitive the
        first time it meets a row count and weight shape, which makes that step slower than its
        repeats (``docs/benchmarks.md``, CPU kernels): without this a server's first minutes
        were slower than the rest, and the simulator's profile (which measures repeats)
        under-predicted them.

        Weights on our own kernels at a row count (``gemm``, ``gemm_amx``, quantized
        ones) skip it. Returns the number of GEMMs run (0 off CPU or when nothing reaches oneDNN).
        """
        if not self.layers or self.embed_tokens.device.type != "cpu":
            return 0
        pairs, seen = [], set()
        for module, name in self._layer_linears():  # one weight of each shape (layers share them)
            weight = getattr(module, name)
            bias = getattr(module, name.replace("_weight", "_bias"), None)
            shape = getattr(weight, "shape", None) or (
                getattr(weight, "out_features", None),
                getattr(weight, "in_features", None),
            )
            key = (type(weight), tuple(shape), bias is None)
            if key not in seen:
                seen.add(key)
                pairs.append((weight, bias))
        runs = 0
        for (weight, bias), limit in [(p, max_rows) for p in pairs] + [
            ((self.lm_head, None), min(max_rows, 256))
        ]:
            onednn, lo = onednn_rows(weight, limit)
            if onednn is None:
                continue
            in_features = weight.in_features if hasattr(weight, "in_features") else onednn.shape[1]
            for rows in buckets(lo, limit):
                linear(torch.zeros(rows, in_features, dtype=onednn.dtype), weight, bias)
                runs += 1
        return runs

    def quantize_linear_weights(self, method: str) -> None:
        """Replace every linear weight (q/k/v, o, gate/up, down, LM head) by its block-quantized
        form, after ``load_weights`` and instead of ``prepack_linear_weights``; the embedding
        table stays float (a tied LM head gets its own quantized copy). CPU only.

        Args:
            method: ``"int8"``: Q8_0 (``quant.quantize_q8_0``: int8 with a scale per 32
                weights); ``"int4"``: Q4_1 (``quant_pack.quantize_q4_1``: 4-bit codes with a
                scale and offset per 32 weights, searched for the lowest squared error).
        Raises:
            ValueError: an unknown ``method``, off CPU, a model dtype other than float32 /
                bfloat16, linear layers whose ``in_features`` is not a multiple of 32 (naming
                them, checked before any is quantized), or ``KVSERVE_QUANT_ACT`` neither
                ``float`` nor ``int8``.
        """
        if method not in QUANT_METHODS:
            raise ValueError(f"quantize_linear_weights: method must be int8 or int4, got {method!r}")
        if self.embed_tokens.device.type != "cpu":
            raise ValueError(f"quantization={method!r} runs on CPU only")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"quantization={method!r} needs dtype float32 or bfloat16 (its kernels' activations), "
                f"got {self.dtype}"
            )
        check_quant_activations()  # a bad KVSERVE_QUANT_ACT fails at load, not in a request
        labelled = self._quantized_linears()
        names = [(m, n) for m, n, _ in labelled]
        labels = [label for _, _, label in labelled]
        ragged = [
            f"{label} (in_features={getattr(m, n).shape[-1]})"
            for (m, n), label in zip(names, labels)
            if getattr(m, n).shape[-1] % QUANT_BLOCK
        ]
        if ragged:
            block = QUANT_METHODS[method][1]
            raise ValueError(
                f"quantization={method!r} needs every linear layer's in_features to be a multiple of "
                f"{QUANT_BLOCK} ({block} blocks of {QUANT_BLOCK} weights); not so for "
                f"{len(ragged)} layer(s): {', '.join(ragged[:4])}{f' and {len(ragged) - 4} more' if len(ragged) > 4 else ''}. "
                "Run this model without quantization."
            )
        for module, name in names:
            self._quantize_linear(module, name, method)

    def _quantized_linears(self) -> list[tuple[nn.Module, str, str]]:
        """``(module, attribute, checkpoint label)`` of every weight ``quantize_linear_weights``
        replaces (a family with other MLPs overrides it); the attribute's last dimension is
        its ``in_features``."""
        out: list[tuple[nn.Module, str, str]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out += [
                (layer.self_attn, "qkv_weight", p + "self_attn.q_proj/k_proj/v_proj"),
                (layer.self_attn, "o_weight", p + "self_attn.o_proj"),
                (layer.mlp, "gate_up_weight", p + "mlp.gate_proj/up_proj"),
                (layer.mlp, "down_weight", p + "mlp.down_proj"),
            ]
        out.append((self, "lm_head", "lm_head"))
        return out

    def _quantize_linear(self, module: nn.Module, name: str, method: str) -> None:
        """Replace ``module.<name>`` (a float ``[out, in]`` weight) by its quantized form."""
        q = quantize_weight(getattr(module, name), method)
        module._parameters.pop(name, None)  # a plain attribute from now on
        setattr(module, name, q)

    # ------------------------------------------------------------------ weights
    #: Checkpoint tensor name suffix -> the dimension a tensor-parallel rank takes 1/T of
    #: (0: output rows, column-parallel; 1: input columns, row-parallel).
    _SHARD_DIMS = {
        "self_attn.q_proj.weight": 0,
        "self_attn.k_proj.weight": 0,
        "self_attn.v_proj.weight": 0,
        "self_attn.q_proj.bias": 0,
        "self_attn.k_proj.bias": 0,
        "self_attn.v_proj.bias": 0,
        "mlp.gate_proj.weight": 0,
        "mlp.up_proj.weight": 0,
        "self_attn.qkv_proj.weight": 0,
        "self_attn.qkv_proj.bias": 0,
        "mlp.gate_up_proj.weight": 0,
        "self_attn.o_proj.weight": 1,
        "mlp.down_proj.weight": 1,
    }

    def _vocab_sharded(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is split by vocabulary rows (``vocab_shard``)."""
        return self.tp_size > 1 and (
            name == "lm_head.weight" or (name == "model.embed_tokens.weight" and self.shard_embedding)
        )

    def _shard_dim(self, name: str) -> int | None:
        if self.tp_size == 1:
            return None
        if self._vocab_sharded(name):
            return 0
        if not name.startswith("model.layers."):
            return None
        rest = name.split(".", 3)[-1]
        return self._SHARD_DIMS.get(rest)

    def shard_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's part of checkpoint tensor ``name`` of full ``shape`` (the
        full shape at TP=1 and for replicated tensors)."""
        dim = self._shard_dim(name)
        if dim is None or dim >= len(shape):
            return tuple(shape)
        out = list(shape)
        if self._vocab_sharded(name):
            # a tensor of the wrong vocabulary gets a shape no target has (the caller names it)
            out[0] = self.vocab_shard.rows if shape[0] == self.vocab_shard.vocab_size else -1
        else:
            out[dim] //= self.tp_size
        return tuple(out)

    #: Checkpoint tensor name suffix of an already fused tensor -> the fused parts, in order:
    #: a tensor-parallel rank takes its 1/T slice of each part.
    _FUSED_CHECKPOINT = {
        "self_attn.qkv_proj.weight": (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ),
        "self_attn.qkv_proj.bias": (
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
        ),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    }

    def _fused_part_sizes(self, rest: str) -> list[int]:
        """Full (unsharded) rows of each part of the fused checkpoint tensor ``rest``."""
        a = self.layers[0].self_attn
        if rest.startswith("self_attn."):
            t = self.tp_size
            return [a.q_size * t, a.kv_size * t, a.kv_size * t]
        return [self.layers[0].mlp.inter * self.tp_size] * 2

    def shard_weight(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor ``t`` named ``name``: a contiguous
        1/T slice along its shard dimension; for an already fused q/k/v or gate/up tensor
        (``_FUSED_CHECKPOINT``) the 1/T slice of each part, concatenated; the LM head's (and a
        sharded embedding's) ``vocab_shard`` rows (zero-padded); o's bias only on rank 0 (zeros
        elsewhere, so the all-reduce adds it once); ``t`` itself for replicated tensors and at
        TP=1.

        Raises:
            ValueError: the shard dimension does not divide by the tensor-parallel size, or a
                vocabulary tensor without ``vocab_size`` rows.
        """
        if self.tp_size > 1 and name.endswith("self_attn.o_proj.bias"):
            return t if self.tp_rank == 0 else torch.zeros_like(t)
        dim = self._shard_dim(name)
        if dim is None or dim >= t.dim():
            return t
        if self._vocab_sharded(name):
            return self.vocab_shard.take(t)
        rest = name.split(".", 3)[-1]
        if rest in self._FUSED_CHECKPOINT:
            sizes = self._fused_part_sizes(rest)
            if t.shape[0] != sum(sizes):
                raise ValueError(f"weight {name!r} has {t.shape[0]} rows, expected {sum(sizes)} ({sizes})")
            rows = [n // self.tp_size for n in sizes]  # (each part divides: the head counts do)
            return torch.cat([p.narrow(0, self.tp_rank * r, r) for p, r in zip(t.split(sizes), rows)])
        n = t.shape[dim]
        if n % self.tp_size:
            raise ValueError(
                f"weight {name!r} has {n} entries along dim {dim}, not divisible by "
                f"tensor_parallel_size={self.tp_size}"
            )
        k = n // self.tp_size
        return t.narrow(dim, self.tp_rank * k, k)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors (``model.layers.0.self_attn.q_proj.weight`` ...) in,
        casting to the model dtype and fusing q/k/v and gate/up.

        Raises:
            ValueError: naming a missing or unexpected tensor, or a shape mismatch.
        """
        loaded = set()
        for name, t in weights:
            target = self.weight_target(name, tuple(t.shape))
            if target is None:
                continue
            target.copy_(self.shard_weight(name, t))
            loaded.add(name)
        self.check_all_loaded(loaded)

    def weight_target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The parameter view that checkpoint tensor ``name`` (of its full ``shape``) is copied
        into (a contiguous row range of a fused parameter for q/k/v and gate/up), or ``None`` for
        tensors that are ignored (``rotary_emb.inv_freq``, a tied ``lm_head.weight``). Under
        tensor parallelism the view holds ``shard_shape(name, shape)``: copy
        ``shard_weight(name, tensor)`` into it.

        Raises:
            ValueError: unknown name or a shape mismatch.
        """
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        dst = self._destination(name)
        if dst is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param, row0 = dst
        # a fused part has the rows up to the next part's start (or the end): a shorter tensor
        # must not pass as a prefix of them
        target = (
            param.data[row0 : row0 + self._part_rows(name, param, row0)] if row0 is not None else param.data
        )
        if name == "model.embed_tokens.weight" and not self._vocab_sharded(name):
            target = target[: self.vocab_shard.vocab_size]  # the rest is the padding
        if tuple(target.shape) != self.shard_shape(name, tuple(shape)):
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(target.shape)}")
        return target

    def _part_rows(self, name: str, param, row0: int) -> int:
        """Rows of the fused ``param`` that checkpoint tensor ``name`` fills from ``row0``."""
        layer = self.layers[int(name.split(".")[2])]
        a = layer.self_attn
        if param is a.qkv_weight or param is a.qkv_bias:
            return a.q_size if row0 == 0 else a.kv_size
        return layer.mlp.inter  # gate / up

    def check_all_loaded(self, loaded) -> None:
        """Raises ValueError naming the expected weights absent from ``loaded`` (a set of names)."""
        loaded = set(loaded)
        for name in list(loaded):  # an already fused tensor stands for its parts
            for fused, parts in self._FUSED_CHECKPOINT.items():
                if name.endswith("." + fused):
                    loaded.update(name[: -len(fused)] + part for part in parts)
        missing = [n for n in self._expected_names() if n not in loaded]
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )

    def _expected_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for s in ("q", "k", "v", "o"):
                names.append(p + f"self_attn.{s}_proj.weight")
            if layer.self_attn.qkv_bias is not None:
                names += [p + f"self_attn.{s}_proj.bias" for s in ("q", "k", "v")]
            if layer.self_attn.o_bias is not None:
                names.append(p + "self_attn.o_proj.bias")
            if layer.self_attn.q_norm is not None:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            names += [p + f"mlp.{s}_proj.weight" for s in ("gate", "up", "down")]
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        return names

    def _destination(self, name: str):
        """``(parameter, first_row or None)`` receiving checkpoint tensor ``name``."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm.weight, None
        if name == "lm_head.weight":
            return self.lm_head, None
        parts = name.split(".")
        if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers":
            return None
        try:
            layer = self.layers[int(parts[2])]
        except (ValueError, IndexError):
            return None
        rest = ".".join(parts[3:])
        a = layer.self_attn
        qkv_rows = {"q": 0, "k": a.q_size, "v": a.q_size + a.kv_size}
        if rest in self._FUSED_CHECKPOINT:  # whole fused parameter
            if rest == "mlp.gate_up_proj.weight":
                return layer.mlp.gate_up_weight, None
            return (a.qkv_weight if rest.endswith("weight") else a.qkv_bias), None
        if rest == "self_attn.q_norm.weight" and a.q_norm is not None:
            return a.q_norm.weight, None
        if rest == "self_attn.k_norm.weight" and a.k_norm is not None:
            return a.k_norm.weight, None
        if rest.startswith("self_attn.") and rest.endswith("_proj.weight"):
            which = rest[len("self_attn.") : -len("_proj.weight")]
            if which in qkv_rows:
                return a.qkv_weight, qkv_rows[which]
            if which == "o":
                return a.o_weight, None
        if rest.startswith("self_attn.") and rest.endswith("_proj.bias"):
            which = rest[len("self_attn.") : -len("_proj.bias")]
            if which in qkv_rows and a.qkv_bias is not None:
                return a.qkv_bias, qkv_rows[which]
            if which == "o" and a.o_bias is not None:
                return a.o_bias, None
        if rest == "mlp.gate_proj.weight":
            return layer.mlp.gate_up_weight, 0
        if rest == "mlp.up_proj.weight":
            return layer.mlp.gate_up_weight, layer.mlp.inter
        if rest == "mlp.down_proj.weight":
            return layer.mlp.down_weight, None
        if rest == "input_layernorm.weight":
            return layer.input_layernorm.weight, None
        if rest == "post_attention_layernorm.weight":
            return layer.post_attention_layernorm.weight, None
        return None
