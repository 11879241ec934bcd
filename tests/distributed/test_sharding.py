"""Weight sharding without processes: every rank's part of a checkpoint tensor, put back
together, is the whole tensor; each rank's model holds 1/T of the heads, KV heads and MLP."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_executor.models.llama import LlamaForCausalLM
from tests.executor.helpers import llama_config

SHARDED_ROWS = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]


def _model(t: int, rank: int, heads: int, kv: int, head_dim: int, inter: int) -> LlamaForCausalLM:
    cfg = llama_config(
        vocab_size=32,
        hidden_size=heads * head_dim,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )
    return LlamaForCausalLM(cfg, tp=SimpleNamespace(rank=rank, world_size=t))


@settings(max_examples=25, deadline=None)
@given(
    t=st.sampled_from([2, 3, 4]),
    kv_mult=st.integers(1, 2),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([4, 8]),
    inter_mult=st.integers(1, 3),
)
def test_shards_reassemble_to_the_checkpoint_tensor(t, kv_mult, group, head_dim, inter_mult):
    kv = t * kv_mult
    heads = kv * group
    inter = 4 * t * inter_mult
    hidden = heads * head_dim
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv * head_dim, hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim),
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, hidden),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, inter),
        "model.layers.0.input_layernorm.weight": torch.randn(hidden),
        "model.embed_tokens.weight": torch.randn(32, hidden),
    }
    models = [_model(t, r, heads, kv, head_dim, inter) for r in range(t)]
    for m in models:
        assert m.num_kv_heads == kv // t
        assert m.layers[0].self_attn.num_heads == heads // t
        assert m.layers[0].mlp.inter == inter // t
    for name, w in full.items():
        parts = [m.shard_weight(name, w) for m in models]
        for m, p in zip(models, parts):
            assert tuple(p.shape) == m.shard_shape(name, tuple(w.shape))
            target = m.weight_target(name, tuple(w.shape))
            assert target is not None and tuple(target.shape) == tuple(p.shape)
        if "norm" in name or "embed" in name:  # replicated
            assert all(torch.equal(p, w) for p in parts)
        else:
            dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
            assert torch.equal(torch.cat(parts, dim=dim), w)


def test_o_bias_is_added_once_over_the_ranks():
    models = [_model(2, r, 4, 2, 4, 8) for r in range(2)]
    b = torch.randn(16)
    parts = [m.shard_weight("model.layers.0.self_attn.o_proj.bias", b) for m in models]
    assert torch.equal(parts[0] + parts[1], b)


def test_tp_size_not_dividing_intermediate_is_refused():
    with pytest.raises(ValueError, match="intermediate_size=10"):
        _model(4, 0, 4, 4, 4, 10)


def test_driver_keeps_the_lm_head_peers_drop_it():
    a, b = _model(2, 0, 4, 2, 4, 8), _model(2, 1, 4, 2, 4, 8)
    a.prepack_linear_weights()
    b.prepack_linear_weights()
    assert a.lm_head is not None and b.lm_head is None
