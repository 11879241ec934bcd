"""BERT-family encoder (``BertModel``) for pooling: embeddings and scores.

Absolute position embeddings plus token-type embeddings, a LayerNorm after the embeddings and
after each sub-block (post-LN), GELU feed-forward, bidirectional attention over each
sequence only (no KV cache: an encoder runs a whole prompt in one step). The linear weights
run through ``layers.linear`` like the decoder's; q, k and v are one fused GEMM. Layout of
the checkpoint (transformers' ``BertModel`` names, optionally under ``bert.``):
``embeddings.{word,position,token_type}_embeddings``, ``embeddings.LayerNorm``,
``encoder.layer.N.attention.self.{query,key,value}``, ``encoder.layer.N.attention.output.{dense,
LayerNorm}``, ``encoder.layer.N.intermediate.dense``, ``encoder.layer.N.output.{dense,LayerNorm}``.
The task heads (``pooler.*``, ``cls.*``) are not read: poolers work on the hidden states.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_executor.layers.linear import LinearWeight, gemm_rows, linear, prepack_weight
from kvserve.ops import encoder_attention

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

#: Most sequences attended in one padded call (sorted by length, so the padding stays small).
ATTENTION_BUCKET_SEQS = 32

#: Checkpoint names not read (task heads, buffers).
_SKIPPED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


def _canonical(name: str) -> str:
    """A checkpoint tensor name in ``BertModel``'s spelling (``bert.`` prefix removed, the old
    ``LayerNorm.gamma`` / ``beta`` as ``weight`` / ``bias``)."""
    name = name.removeprefix("bert.")
    if name.endswith("LayerNorm.gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[: -len("beta")] + "bias"
    return name


class BertModel(nn.Module):
    """The encoder; ``forward`` gives the final hidden states of a flattened batch.

    Args:
        hf_config: a transformers ``BertConfig``.
        dtype, device: of parameters and activations.
        max_position: unused (the position table is the checkpoint's); kept for the loader's
            signature. tp: must be None (no tensor parallelism for encoders).

    Raises:
        ValueError: naming the config field and the supported values: a
            ``position_embedding_type`` other than ``absolute``, a ``hidden_act`` not in
            ``_ACTIVATIONS``, ``is_decoder`` / ``add_cross_attention`` set, a ``tp`` group.
    """

    #: Encoders run prompts only: no KV cache, no decode step, no LoRA, no quantization.
    is_encoder = True
    supports_lora = False
    supports_quantization = False
    #: Checkpoint names (after ``_canonical``) not read: a head the subclass has no use for.
    skipped_prefixes: tuple[str, ...] = _SKIPPED_PREFIXES

    def __init__(
        self, hf_config, dtype=torch.float32, device="cpu", max_position: int | None = None, tp=None
    ):
        super().__init__()
        cfg = hf_config
        where = "config.json"
        pet = getattr(cfg, "position_embedding_type", "absolute")
        if pet != "absolute":
            raise ValueError(f"{where}: position_embedding_type={pet!r}; supported: 'absolute'.")
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act={act!r}; supported: {', '.join(_ACTIVATIONS)}.")
        if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
            raise ValueError(
                f"{where}: is_decoder / add_cross_attention are set; only encoders are supported."
            )
        if tp is not None and int(getattr(tp, "world_size", 1)) > 1:
            raise ValueError("tensor_parallel_size must be 1 for an encoder model.")
        self.config = cfg
        self.dtype = dtype
        self.tp_size = 1
        self.hidden_size = H = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        if H % self.num_heads:
            raise ValueError(
                f"{where}: hidden_size={H} is not a multiple of num_attention_heads={self.num_heads}."
            )
        self.head_dim = H // self.num_heads
        self.num_layers = int(cfg.num_hidden_layers)
        self.eps = float(getattr(cfg, "layer_norm_eps", 1e-12))
        self.act = _ACTIVATIONS[act]
        self.max_position = int(cfg.max_position_embeddings)
        inter = int(cfg.intermediate_size)

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        # checkpoint name -> parameter (filled by ``weight_target``)
        self._params: dict[str, nn.Parameter] = {
            "embeddings.word_embeddings.weight": p(int(cfg.vocab_size), H),
            "embeddings.position_embeddings.weight": p(self.max_position, H),
            "embeddings.token_type_embeddings.weight": p(int(getattr(cfg, "type_vocab_size", 2)), H),
            "embeddings.LayerNorm.weight": p(H),
            "embeddings.LayerNorm.bias": p(H),
        }
        for i in range(self.num_layers):
            pre = f"encoder.layer.{i}."
            for sub, shape in (
                ("attention.self.query", (H, H)),
                ("attention.self.key", (H, H)),
                ("attention.self.value", (H, H)),
                ("attention.output.dense", (H, H)),
                ("intermediate.dense", (inter, H)),
                ("output.dense", (H, inter)),
            ):
                self._params[pre + sub + ".weight"] = p(*shape)
                self._params[pre + sub + ".bias"] = p(shape[0])
            for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
                self._params[pre + ln + ".weight"] = p(H)
                self._params[pre + ln + ".bias"] = p(H)
        self._register_params()
        # per layer: (qkv weight, qkv bias, o, o bias, ln1 w, ln1 b, up, up bias, down, down bias,
        # ln2 w, ln2 b); built by ``prepack_linear_weights`` after loading
        self._layers: list[tuple] = []

    def _register_params(self) -> None:
        """Register every tensor of ``_params`` not yet registered (``.to``, ``state_dict``)."""
        known = {id(t) for t in self.parameters()}
        for t in self._params.values():
            if id(t) not in known:
                self.register_parameter(f"p{len(known)}", t)
                known.add(id(t))

    # ------------------------------------------------------------------ loading
    def weight_target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The parameter a checkpoint tensor fills (None: not read). Raises ValueError for an
        unknown name or a shape that differs from the config's."""
        canon = _canonical(name)
        if canon.startswith(self.skipped_prefixes) or name.startswith("cls."):
            return None
        t = self._params.get(canon)
        if t is None:
            raise ValueError(f"unexpected weight {name!r} for BertModel")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(t.shape)}")
        return t.data

    def shard_weight(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t

    def check_all_loaded(self, loaded: Iterable[str]) -> None:
        """Raises ValueError naming the weights the checkpoint lacks."""
        got = {_canonical(n) for n in loaded}
        missing = [n for n in self._params if n not in got]
        if missing:
            raise ValueError(f"missing weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(name, tensor)`` pairs (transformers' ``state_dict`` names) and prepack."""
        loaded = []
        with torch.no_grad():
            for name, t in weights:
                target = self.weight_target(name, tuple(t.shape))
                if target is not None:
                    target.copy_(t)
                    loaded.append(name)
        self.check_all_loaded(loaded)
        self.prepack_linear_weights()

    def prepack_linear_weights(self) -> None:
        """Fuse q/k/v and reorder every linear weight once for ``layers.linear``."""
        P = self._params
        self._layers = []
        for i in range(self.num_layers):
            pre = f"encoder.layer.{i}."
            qkv_w = torch.cat([P[pre + f"attention.self.{n}.weight"] for n in ("query", "key", "value")])
            qkv_b = torch.cat([P[pre + f"attention.self.{n}.bias"] for n in ("query", "key", "value")])
            packed: list[LinearWeight | torch.Tensor] = [
                prepack_weight(qkv_w),
                qkv_b,
                prepack_weight(P[pre + "attention.output.dense.weight"].data),
                P[pre + "attention.output.dense.bias"].data,
                P[pre + "attention.output.LayerNorm.weight"].data,
                P[pre + "attention.output.LayerNorm.bias"].data,
                prepack_weight(P[pre + "intermediate.dense.weight"].data),
                P[pre + "intermediate.dense.bias"].data,
                prepack_weight(P[pre + "output.dense.weight"].data),
                P[pre + "output.dense.bias"].data,
                P[pre + "output.LayerNorm.weight"].data,
                P[pre + "output.LayerNorm.bias"].data,
            ]
            self._layers.append(tuple(packed))

    # ------------------------------------------------------------------ forward
    @staticmethod
    def attention_buckets(seq_lens: list[int], device, max_seqs: int = ATTENTION_BUCKET_SEQS) -> list[tuple]:
        """The step's attention batches, shared by every layer: sequences sorted by length and
        cut into groups of at most ``max_seqs``, each padded to its longest.

        Returns per group ``(b, L, rows, slots, mask)``: ``b`` sequences padded to ``L`` tokens,
        ``rows`` int64 ``[b * L]`` the token row of each padded slot (a padding slot repeats its
        sequence's last row), ``slots`` ``(positions, token rows)`` int64 of the real (not
        padding) slots and ``mask`` bool ``[b, 1, 1, L]`` the keys each query may attend (both
        None when no sequence of the group is padded).
        """
        starts = [0] * len(seq_lens)
        acc = 0
        for i, n in enumerate(seq_lens):
            starts[i] = acc
            acc += n
        order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
        groups: list[tuple] = []
        for g in range(0, len(order), max_seqs):
            members = order[g : g + max_seqs]
            lens = torch.tensor([seq_lens[i] for i in members], dtype=torch.int64)
            L = int(lens.max())
            col = torch.arange(L, dtype=torch.int64)
            first = torch.tensor([starts[i] for i in members], dtype=torch.int64)
            rows = (first[:, None] + torch.minimum(col[None, :], lens[:, None] - 1)).view(-1)
            if int(lens.min()) == L:
                groups.append((len(members), L, rows.to(device), None, None))
                continue
            keep = col[None, :] < lens[:, None]
            real = keep.view(-1).nonzero().view(-1)
            slots = (real.to(device), rows[real].to(device))
            groups.append((len(members), L, rows.to(device), slots, keep[:, None, None, :].to(device)))
        return groups

    def _attend(self, qkv: torch.Tensor, buckets: list[tuple] | torch.Tensor) -> torch.Tensor:
        """Bidirectional attention of each sequence over its own tokens: ``qkv`` ``[T, 3H]`` ->
        ``[T, H]``. ``buckets`` is the step's ``cu_seqlens`` (int64 ``[S + 1]``) where the native
        kernel runs (``ops.encoder_attention``: in place, no padding), else the groups of
        ``attention_buckets``, one padded SDPA call each."""
        if isinstance(buckets, torch.Tensor):
            return encoder_attention.encoder_attention(
                qkv, buckets, self.num_heads, self.head_dim, self.head_dim**-0.5
            )
        T = qkv.shape[0]
        nh, hd, H = self.num_heads, self.head_dim, self.hidden_size
        out = torch.zeros(T, nh, hd, dtype=qkv.dtype, device=qkv.device)  # (padding rows: 0)
        for b, L, rows, slots, mask in buckets:
            x = qkv.index_select(0, rows).view(b, L, 3, nh, hd)
            x = x.permute(2, 0, 3, 1, 4)  # [3, b, nh, L, hd]
            o = F.scaled_dot_product_attention(x[0], x[1], x[2], attn_mask=mask)  # [b, nh, L, hd]
            o = o.transpose(1, 2).reshape(-1, nh, hd)
            if slots is None:
                out.index_copy_(0, rows, o)
            else:
                out.index_copy_(0, slots[1], o.index_select(0, slots[0]))
        return out.view(T, H)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden_size]`` (model dtype) of the sequences laid one
        after another in ``input_ids`` (int64 ``[T]``, ``T = sum(seq_lens)``), each attending
        to its own tokens only; ``positions`` int64 ``[T]`` (0-based within each sequence);
        ``token_type_ids`` int64 ``[T]`` (None: all 0)."""
        P = self._params
        H = self.hidden_size
        T = input_ids.shape[0]
        if self._layers:
            # where oneDNN runs the step's GEMMs, at a row bucket (row_buckets): the stream
            # padded once here (rows past T: token 0 at position 0, attended by nothing,
            # dropped at the end) instead of each GEMM input copied into a padded buffer
            pad = gemm_rows(self._layers[0][0], T) - T
            if pad:
                input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
                if token_type_ids is not None:
                    token_type_ids = F.pad(token_type_ids, (0, pad))
        x = F.embedding(input_ids, P["embeddings.word_embeddings.weight"])
        x = x + F.embedding(positions, P["embeddings.position_embeddings.weight"])
        tt = P["embeddings.token_type_embeddings.weight"]
        x = x + (tt[0] if token_type_ids is None else F.embedding(token_type_ids, tt))
        x = F.layer_norm(x, (H,), P["embeddings.LayerNorm.weight"], P["embeddings.LayerNorm.bias"], self.eps)
        buckets: list[tuple] | torch.Tensor
        if x.is_cpu and encoder_attention.supports(x.dtype, self.head_dim):
            buckets = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int64)
        else:
            buckets = self.attention_buckets(seq_lens, x.device)
        for qkv_w, qkv_b, o_w, o_b, ln1_w, ln1_b, up_w, up_b, down_w, down_b, ln2_w, ln2_b in self._layers:
            ctx = self._attend(linear(x, qkv_w, qkv_b), buckets)
            x = F.layer_norm(linear(ctx, o_w, o_b) + x, (H,), ln1_w, ln1_b, self.eps)
            h = self.act(linear(x, up_w, up_b))
            x = F.layer_norm(linear(h, down_w, down_b) + x, (H,), ln2_w, ln2_b, self.eps)
        return x[:T]
