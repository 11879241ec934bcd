"""The step-time floor: the least time a forward step (or a run of steps) can take on a host
that does ``peak_flops`` floating-point operations and streams ``bandwidth`` bytes per second.

Pure arithmetic on a model's shape (``ModelShape``) and a step's token counts (``StepWork``),
used by ``kvserve bench roof`` and the benchmarks that report their figure as a fraction of it;
the simulator can price its steps with it too (``work_of_shape``). Nothing here measures or
imports a model.

The counts, in the usual transformer inference arithmetic:

* **Linear layers.** A weight matrix of ``n x k`` applied to one token row costs ``n k``
  multiply-adds, 2 ``n k`` FLOPs: a forward pass costs about 2 FLOPs per weight per token
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1). The LM head
  (``vocab x hidden``) runs only on the rows that get a token sampled.
* **Attention.** Per layer, each (query, key) pair costs one dot product of ``heads *
  head_dim`` for the score and one multiply-add per element for the weighted sum of values:
  ``4 * heads * head_dim`` FLOPs (softmax and norms are left out: a few FLOPs per pair or per
  element, small beside these). A causal chunk of ``q`` tokens after ``c`` cached ones attends
  ``q c + q (q + 1) / 2`` pairs (``causal_pairs``), a decode of a sequence ``L`` long ``L``; an
  encoder's sequence of ``L`` tokens ``L^2``.
* **Bytes.** Every weight of the model is read once per step (a step reads its layers
  whatever its batch), the embedding rows of its tokens, and the KV cache: the positions each
  decode and each chunk's cached prefix attend over are read, and the new tokens' K and V
  written. Activations are left out (a floor assumes they stay in cache).
* **MoE.** A token runs ``experts_per_token`` of ``num_experts`` experts; a step of ``T``
  tokens reads, under uniform routing, ``E (1 - (1 - k / E)^T)`` distinct experts (the
  expected count, not a bound).

The floor of a step is ``max(flops / peak_flops, bytes / bandwidth)``: whichever of compute
and memory traffic takes longer, the other assumed hidden under it (the roofline model,
Williams, Waterman and Patterson 2009). The floor of a run is the same ``max`` over the run's
summed FLOPs and bytes (``Cost.floor``): its steps may overlap one's compute with another's
traffic (a decode riding in a prompt's step), so the sum of per-step floors would overstate it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Bytes per element of each weight or KV storage type the floor knows (``q8_0``: 32 int8
#: codes and a float16 scale per 34 bytes; ``q4_0``: 32 nibbles and a float16 scale; ``q4_1``:
#: 32 nibbles, a float16 scale and min).
DTYPE_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the floor needs, from a transformers config (``from_hf_config``).

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
            vocab_size: as the config names them (``head_dim`` defaults to
            ``hidden_size / num_heads``).
        weight_bytes: bytes per stored weight element (``DTYPE_BYTES``).
        kv_bytes: bytes per cached K or V element.
        gated_mlp: True for gate/up/down MLPs (SwiGLU, GeGLU: 3 matrices), False for up/down
            (BERT's GELU MLP: 2).
        causal: True for a decoder with a KV cache; False for an encoder (no cache, every
            token of a sequence attends every other).
        lm_head: whether sampled rows run an LM head (``vocab x hidden``).
        num_experts, experts_per_token, expert_intermediate_size: routed MoE experts (0:
            dense); every layer is taken as sparse.
        shared_expert_intermediate_size: a shared expert every token runs (0: none).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes: float = 4.0
    kv_bytes: float = 4.0
    gated_mlp: bool = True
    causal: bool = True
    lm_head: bool = True
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, cfg: Mapping, dtype: str = "float32", kv_dtype: str | None = None) -> ModelShape:
        """The shape of a transformers ``config.json`` (as a dict).

        Args:
            cfg: the config; BERT-like ``model_type`` s (``bert``, ``roberta``, ...) and
                ``BertModel`` architectures read as encoders.
            dtype: the weights' storage type, a key of ``DTYPE_BYTES``.
            kv_dtype: the KV cache's (default: ``dtype``, ``float32`` for a quantized one).

        Raises:
            ValueError: an unknown dtype, or a config without the sizes.
        """
        if dtype not in DTYPE_BYTES or (kv_dtype is not None and kv_dtype not in DTYPE_BYTES):
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r} / {kv_dtype!r}")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg.get("intermediate_size") or 4 * hidden)
            vocab = int(cfg["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"config lacks the sizes the floor needs: {e}") from None
        archs = cfg.get("architectures") or []
        encoder = cfg.get("model_type") in ("bert", "roberta", "xlm-roberta", "electra") or any(
            a.endswith(("BertModel", "RobertaModel")) for a in archs
        )
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if kv_dtype is None:
            kv_dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=inter,
            vocab_size=vocab,
            weight_bytes=DTYPE_BYTES[dtype],
            kv_bytes=DTYPE_BYTES[kv_dtype],
            gated_mlp=not encoder,
            causal=not encoder,
            lm_head=not encoder,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate_size=int(cfg.get("moe_intermediate_size") or inter) if experts else 0,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )

    # -- parameter counts (weights of the linear layers; norms and biases left out) --

    def attention_params(self) -> int:
        """Weights of one layer's q, k, v and o projections."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    def _mlp(self, inter: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * inter

    def mlp_params(self) -> int:
        """Weights of one layer's MLP a token runs (routed experts: ``experts_per_token`` of
        them, the router and the shared expert)."""
        if not self.num_experts:
            return self._mlp(self.intermediate_size)
        return (
            self.experts_per_token * self._mlp(self.expert_intermediate_size)
            + self.hidden_size * self.num_experts
            + self._mlp(self.shared_expert_intermediate_size)
        )

    def expert_params(self) -> int:
        """Weights of one routed expert (0 for a dense model)."""
        return self._mlp(self.expert_intermediate_size) if self.num_experts else 0

    def layer_params(self) -> int:
        """Weights of one layer a token runs through (attention and the MLP it runs)."""
        return self.attention_params() + self.mlp_params()

    def head_params(self) -> int:
        """Weights of the LM head (0 without one)."""
        return self.vocab_size * self.hidden_size if self.lm_head else 0

    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V one token holds in the cache, over all layers (0 for an encoder)."""
        if not self.causal:
            return 0.0
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    def flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: score and weighted value sum."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def step_weight_bytes(self, tokens: int) -> float:
        """Bytes of weights a step of ``tokens`` rows reads: every layer's attention and dense
        MLP, the experts its tokens route to (expected distinct count, uniform routing) and
        the LM head."""
        if tokens <= 0:
            return 0.0
        per_layer = float(self.attention_params())
        if self.num_experts:
            e, k = self.num_experts, self.experts_per_token
            distinct = e * (1.0 - (1.0 - k / e) ** tokens)
            per_layer += distinct * self.expert_params()
            per_layer += self.hidden_size * e + self._mlp(self.shared_expert_intermediate_size)
        else:
            per_layer += self.mlp_params()
        return (self.num_layers * per_layer + self.head_params()) * self.weight_bytes


def causal_pairs(chunk: int, computed: int = 0) -> float:
    """(query, key) pairs a causal chunk of ``chunk`` tokens after ``computed`` cached ones
    attends: each of its tokens sees the prefix and itself, ``chunk * computed + chunk *
    (chunk + 1) / 2``."""
    return chunk * computed + chunk * (chunk + 1) / 2


@dataclass(frozen=True)
class StepWork:
    """Token counts of one forward step (all >= 0).

    Attributes:
        prefill_tokens: query tokens of prompt chunks (an encoder's: every token).
        prefill_pairs: (query, key) pairs those chunks attend (``causal_pairs``; an encoder's
            sequence of ``L`` tokens: ``L * L``).
        prefill_context_tokens: cached positions the chunks attend before their own tokens.
        decode_seqs: decoding sequences (one query token each).
        context_tokens: positions the decodes attend (sum of their lengths, the new token's
            included).
        sampled_rows: rows that run the LM head.
    """

    prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    prefill_context_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    sampled_rows: int = 0

    @property
    def rows(self) -> int:
        """Token rows through the linear layers."""
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True)
class Floor:
    """A floor: ``seconds = max(compute_s, memory_s)`` and which of the two ``bound`` it."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: the larger of the two times."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one step or a run (``+`` sums them), and its step count."""

    flops: float = 0.0
    bytes: float = 0.0
    steps: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.steps + other.steps)

    def floor(self, peak_flops: float, bandwidth: float) -> Floor:
        """The floor on a host of ``peak_flops`` FLOP/s and ``bandwidth`` bytes/s.

        Raises:
            ValueError: a peak that is not positive.
        """
        if not (peak_flops > 0 and bandwidth > 0):
            raise ValueError(f"peaks must be positive, got {peak_flops} FLOP/s and {bandwidth} B/s")
        return Floor(self.flops, self.bytes, self.flops / peak_flops, self.bytes / bandwidth)


def work_of_shape(shape) -> StepWork:
    """The ``StepWork`` of a simulator ``StepShape`` (``kvserve.sim.step_shape``), so a simulated
    or profiled step can be priced at its floor: drafts under verification count as prompt rows
    (their pairs are not in the shape: left out), and the chunks' cached prefix, which the shape
    folds into its pairs, is not read (a floor a little low on chunked prefills)."""
    return StepWork(
        prefill_tokens=shape.prefill_tokens + shape.verify_tokens,
        prefill_pairs=1000.0 * shape.prefill_attn_pairs,
        decode_seqs=shape.decode_seqs,
        context_tokens=shape.context_tokens,
        sampled_rows=shape.sampled_rows,
    )


def step_flops(model: ModelShape, work: StepWork) -> float:
    """FLOPs of one step: linear layers on every row, attention on every pair, the LM head on
    the sampled rows."""
    linear = 2.0 * model.num_layers * model.layer_params() * work.rows
    head = 2.0 * model.head_params() * work.sampled_rows
    attention = model.flops_per_pair() * (work.prefill_pairs + work.context_tokens)
    return linear + head + attention


def step_bytes(model: ModelShape, work: StepWork) -> float:
    """Bytes one step moves: the weights once, its tokens' embedding rows, the KV positions it
    attends (read) and its new tokens' K and V (written)."""
    kv = model.kv_bytes_per_token()
    read = kv * (work.context_tokens + work.prefill_context_tokens)
    written = kv * work.rows
    embed = work.rows * model.hidden_size * model.weight_bytes
    return model.step_weight_bytes(work.rows) + embed + read + written


def step_cost(model: ModelShape, work: StepWork) -> Cost:
    """``Cost`` of one step (an empty step: zero, no step)."""
    if work.rows == 0:
        return Cost()
    return Cost(step_flops(model, work), step_bytes(model, work), 1)


def offline_steps(requests: Iterable[tuple[int, int]]) -> list[StepWork]:
    """The steps of an offline run of ``(prompt_len, output_len)`` requests with every request
    in every batch: one step prefills all prompts (sampling each one's first token), then decode
    step ``j`` (``1 .. max output_len - 1``) runs every request with ``output_len > j``, its
    ``j``-th generated token attending ``prompt_len + j`` positions. The fewest steps any
    schedule needs (a request's tokens come one per step), so the fewest weight reads.

    Raises:
        ValueError: a prompt or output length below 1.
    """
    reqs = list(requests)
    if any(p < 1 or o < 1 for p, o in reqs):
        raise ValueError("every request needs prompt_len >= 1 and output_len >= 1")
    if not reqs:
        return []
    steps = [
        StepWork(
            prefill_tokens=sum(p for p, _ in reqs),
            prefill_pairs=sum(causal_pairs(p) for p, _ in reqs),
            sampled_rows=len(reqs),
        )
    ]
    for j in range(1, max(o for _, o in reqs)):
        alive = [(p, o) for p, o in reqs if o > j]
        steps.append(
            StepWork(
                decode_seqs=len(alive),
                context_tokens=sum(p + j for p, _ in alive),
                sampled_rows=len(alive),
            )
        )
    return steps


def encode_step(lengths: Sequence[int]) -> StepWork:
    """One encoder step over sequences of ``lengths`` tokens (bidirectional: ``L^2`` pairs
    each; no rows sampled)."""
    return StepWork(prefill_tokens=sum(lengths), prefill_pairs=float(sum(n * n for n in lengths)))


def run_cost(model: ModelShape, steps: Iterable[StepWork]) -> Cost:
    """The summed ``Cost`` of ``steps``."""
    total = Cost()
    for s in steps:
        total = total + step_cost(model, s)
    return total


def tokens_per_s(tokens: float, floor: Floor) -> float:
    """``tokens / floor.seconds`` (inf for a zero floor)."""
    return tokens / floor.seconds if floor.seconds > 0 else math.inf
