"""Weight sharding without processes: every rank's part of a checkpoint tensor, put back
together, is the whole tensor; each rank's model holds 1/T of the heads, KV heads and MLP, and
ceil(vocab / T) rows of the embedding and the LM head."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_executor.models.llama import LlamaForCausalLM
from tests.model_executor.helpers import llama_config

SHARDED_ROWS = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]


def _shard_embedding_env(on: bool):
    """The embedding layout override (``vocab_parallel.SHARD_EMBEDDING_ENV``) set to ``on``."""
    from unittest import mock

    from kvserve.model_executor.layers.vocab_parallel import SHARD_EMBEDDING_ENV

    return mock.patch.dict(os.environ, {SHARD_EMBEDDING_ENV: "1" if on else "0"})


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
    shard_embedding=st.booleans(),
)
def test_shards_reassemble_to_the_checkpoint_tensor(t, kv_mult, group, head_dim, inter_mult, shard_embedding):
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
    with _shard_embedding_env(shard_embedding):
        models = [_model(t, r, heads, kv, head_dim, inter) for r in range(t)]
    for m in models:
        assert m.shard_embedding == shard_embedding
        assert m.num_kv_heads == kv // t
        assert m.layers[0].self_attn.num_heads == heads // t
        assert m.layers[0].mlp.inter == inter // t
    for name, w in full.items():
        parts = [m.shard_weight(name, w) for m in models]
        for m, p in zip(models, parts):
            assert tuple(p.shape) == m.shard_shape(name, tuple(w.shape))
            target = m.weight_target(name, tuple(w.shape))
            assert target is not None and tuple(target.shape) == tuple(p.shape)
        if "norm" in name or ("embed" in name and not shard_embedding):  # replicated
            assert all(torch.equal(p, w) for p in parts)
        elif "embed" in name:  # vocab rows, zero-padded to a multiple of T
            assert torch.equal(torch.cat(parts)[: w.shape[0]], w)
            assert not torch.cat(parts)[w.shape[0] :].any()
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


class _OneRank:
    """A tensor-parallel group stand-in for one rank of an in-process test: ``all_reduce``
    keeps the partial (the test sums the ranks), ``gather`` returns ``parts`` on rank 0."""

    def __init__(self, rank: int, world_size: int, parts=None):
        self.rank, self.world_size, self.parts = rank, world_size, parts

    def all_reduce(self, t):
        return t

    def gather(self, t):
        return None if self.rank else [t] + list(self.parts)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 70), t=st.integers(1, 5), data=st.data())
def test_vocab_shards_cover_the_vocabulary_once(vocab, t, data):
    """Every token id is in exactly one rank's range; the embedding lookups summed over the
    ranks equal the full table's; the gathered logits equal the full LM head's, padding
    dropped."""
    from kvserve.model_executor.layers import vocab_parallel as vp

    shards = [vp.VocabShard.of(vocab, t, r) for r in range(t)]
    assert all(s.rows == -(-vocab // t) for s in shards)
    assert shards[0].padded_vocab % t == 0 and shards[0].padded_vocab >= vocab
    owners = [sum(s.start <= i < s.end for s in shards) for i in range(vocab)]
    assert owners == [1] * vocab
    table = torch.randn(vocab, 8)
    parts = [s.take(table) for s in shards]
    assert all(p.shape == (s.rows, 8) for p, s in zip(parts, shards))
    assert torch.equal(torch.cat(parts)[:vocab], table)
    assert not torch.cat(parts)[vocab:].any()  # the padding rows are zeros
    ids = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)))
    summed = sum(vp.embedding(ids, p, s, _OneRank(s.rank, t)) for p, s in zip(parts, shards))
    assert torch.equal(summed, torch.nn.functional.embedding(ids, table))
    hidden = torch.randn(3, 8)
    locals_ = [hidden @ p.T for p in parts]
    assert vp.gather_logits(locals_[1 % t], shards[1 % t], _OneRank(1, t)) is None or t == 1
    full = vp.gather_logits(locals_[0], shards[0], _OneRank(0, t, locals_[1:]))
    assert full is not None and full.shape == (3, vocab) and full.is_contiguous()
    torch.testing.assert_close(full, hidden @ table.T)


def test_bad_vocab_shard_is_refused():
    from kvserve.model_executor.layers.vocab_parallel import VocabShard

    with pytest.raises(ValueError, match="rank=2"):
        VocabShard.of(10, 2, 2)
    with pytest.raises(ValueError, match="expected 10 vocabulary rows, got 9"):
        VocabShard.of(10, 2, 0).take(torch.zeros(9, 4))


@pytest.mark.parametrize("shard_embedding", [False, True], ids=["replicated_embedding", "sharded_embedding"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_rank_holds_its_vocab_rows_of_the_lm_head(tied, shard_embedding):
    """Vocab 33 over 2 ranks: 17 LM head rows each (rank 1: 16 real + 1 zero row). The
    embedding is all 33 rows (padded to 34) when replicated, the same 17 when sharded; tied,
    the LM head is this rank's rows of the embedding table (the same memory)."""
    cfg = llama_config(
        vocab_size=33, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    full = {"model.embed_tokens.weight": torch.randn(33, 16), "lm_head.weight": torch.randn(33, 16)}
    with _shard_embedding_env(shard_embedding):
        models = [LlamaForCausalLM(cfg, tp=SimpleNamespace(rank=r, world_size=2)) for r in range(2)]
    for r, m in enumerate(models):
        assert m.embed_tokens.shape == ((17, 16) if shard_embedding else (34, 16))
        assert m.lm_head.shape == (17, 16)
        if tied:  # no copy: the head's memory is the table's
            assert m.lm_head.data_ptr() == m.embed_tokens[0 if shard_embedding else 17 * r].data_ptr()
        for name, w in full.items():
            target = m.weight_target(name, (33, 16))
            if tied and name == "lm_head.weight":
                assert target is None  # the embedding rows serve as the head
                continue
            assert target is not None
            target.copy_(m.shard_weight(name, w))
        head = full["model.embed_tokens.weight" if tied else "lm_head.weight"][17 * r : 17 * r + 17]
        assert torch.equal(m.lm_head[: len(head)], head)
        assert not m.lm_head[len(head) :].any()  # rank 1's padding row
        if not shard_embedding:
            assert torch.equal(m.embed_tokens[:33], full["model.embed_tokens.weight"])
        with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(32, 16\)"):
            m.weight_target("model.embed_tokens.weight", (32, 16))


def test_a_step_without_logit_rows_skips_the_gather():
    """Only mid-prompt chunks scheduled: no rank enters the gather (each sees N = 0)."""
    from kvserve.model_executor.layers import vocab_parallel as vp

    class NoGather(_OneRank):
        def gather(self, t):
            raise AssertionError("gather called with no rows")

    s0, s1 = vp.VocabShard.of(33, 2, 0), vp.VocabShard.of(33, 2, 1)
    out = vp.gather_logits(torch.empty(0, 17), s0, NoGather(0, 2))
    assert out is not None and out.shape == (0, 33)
    assert vp.gather_logits(torch.empty(0, 17), s1, NoGather(1, 2)) is None
