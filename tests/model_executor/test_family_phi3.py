"""Phi-3 / Phi-4-mini (fused checkpoint tensors, LongRoPE, partial rotary) against transformers on
tiny random weights."""

import math
import types

import pytest
import torch

from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from tests.model_executor.family_checks import (
    ENGINE_SETTINGS,
    VOCAB,
    check_against_hf,
    prompts_of,
    save_family,
)

OMP = 32  # original_max_position_embeddings of the LongRoPE configs: prompts cross it


def longrope(rotary_dim: int, **kw) -> dict:
    half = rotary_dim // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.1 * i for i in range(half)],
        long_factor=[1.5 + 0.7 * i for i in range(half)],
        **kw,
    )


CONFIGS = {
    # Phi-3-mini's shape: multi-head, default rope, untied
    "mha-default": dict(num_attention_heads=4, num_key_value_heads=4),
    # Phi-3-128k-like: LongRoPE past 32 positions (max 128: attention factor from the ratio), GQA 4:2
    "gqa-longrope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        original_max_position_embeddings=OMP,
        rope_parameters=longrope(16),
    ),
    # Phi-4-mini-like: 3/4 of each head rotated, LongRoPE, GQA 4:1, tied embeddings
    "phi4-mini-like": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        original_max_position_embeddings=OMP,
        rope_parameters=longrope(12, partial_rotary_factor=0.75),
    ),
}


def phi3_config(**kw):
    from transformers import Phi3Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(kw)
    return Phi3Config(**base)


@pytest.fixture(scope="module", params=list(CONFIGS))
def phi3(request, tmp_path_factory, default_tokenizer_dir):
    path = tmp_path_factory.mktemp(f"phi3-{request.param}")
    return (
        request.param,
        path,
        save_family(path, phi3_config(**CONFIGS[request.param]), default_tokenizer_dir),
    )


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
def test_phi3_greedy_and_logprobs_match_transformers(phi3, settings):
    """Short prompts that generate past position 32 and prompts longer than 32 (LongRoPE's
    long factors from the first token), in pairs of one kind that share 8 tokens."""
    name, path, hf = phi3
    prompts = prompts_of(4, [26, 21, 40, 37])
    stats = check_against_hf(path, hf, prompts, 12, ENGINE_SETTINGS[settings])
    if settings != "default":
        assert stats["num_preemptions"] > 0
        assert stats["prefix_cache_hits"] > 0


def test_longrope_short_and_long_prompts_sharing_a_prefix_do_not_share_blocks(phi3):
    """A short and a long prompt with the same first 8 tokens: their K/V differ (short vs long
    factors), so the prefix cache must not hand one's blocks to the other."""
    name, path, hf = phi3
    if name == "mha-default":
        pytest.skip("no LongRoPE")
    prompts = prompts_of(4, [20, 44])
    stats = check_against_hf(path, hf, prompts, 6, ENGINE_SETTINGS["tiny-recompute"])
    assert stats["prefix_cache_hits"] == 0


def test_longrope_tables_follow_transformers_rule():
    """cos/sin of the short factors below the threshold, of the long ones from it (or for a long
    prompt), both scaled by sqrt(1 + ln(128/32) / ln(32)); the rotated part is 3/4 of the head."""
    cfg = phi3_config(**CONFIGS["phi4-mini-like"])
    params = get_rope_parameters(cfg)
    rope = RotaryEmbedding(16, 128, params)
    assert rope.rotary_dim == 12 and rope.longrope_after == OMP
    scale = math.sqrt(1 + math.log(128 / OMP) / math.log(OMP))
    pos = torch.tensor([5, 31, 32, 5])
    cos, _ = rope.lookup(pos, torch.tensor([False, False, False, True]))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float64) / 12))
    short = torch.tensor(params["short_factor"], dtype=torch.float64)
    long_ = torch.tensor(params["long_factor"], dtype=torch.float64)
    for row, (p, factors) in enumerate([(5, short), (31, short), (32, long_), (5, long_)]):
        want = torch.cos(p * inv / factors) * scale
        torch.testing.assert_close(cos[row, 0].double(), want, atol=1e-5, rtol=0)


def test_unknown_rope_type_is_refused():
    from kvserve.model_executor.models.phi3 import Phi3ForCausalLM

    cfg = phi3_config()
    cfg.rope_parameters = {"rope_type": "yarn-ish", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type"):
        Phi3ForCausalLM(cfg, torch.float32, "meta")


def test_fused_checkpoint_tensor_is_split_per_part_for_tensor_parallelism():
    """A rank's slice of the fused qkv / gate_up tensor is its slice of each part, in order --
    the same rows the separate q/k/v (gate/up) tensors would give it."""
    from kvserve.model_executor.models.phi3 import Phi3ForCausalLM

    cfg = phi3_config(**CONFIGS["gqa-longrope"])
    hd = 16
    q, k, v = torch.randn(4 * hd, 64), torch.randn(2 * hd, 64), torch.randn(2 * hd, 64)
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    for rank in range(2):
        tp = types.SimpleNamespace(world_size=2, rank=rank)
        model = Phi3ForCausalLM(cfg, torch.float32, "meta", tp=tp)
        p = "model.layers.1."
        fused = model.shard_weight(p + "self_attn.qkv_proj.weight", torch.cat([q, k, v]))
        parts = [model.shard_weight(p + f"self_attn.{s}_proj.weight", t) for s, t in zip("qkv", (q, k, v))]
        torch.testing.assert_close(fused, torch.cat(parts))
        assert model.weight_target(p + "self_attn.qkv_proj.weight", (128, 64)).shape == fused.shape
        gu = model.shard_weight(p + "mlp.gate_up_proj.weight", torch.cat([gate, up]))
        torch.testing.assert_close(
            gu, torch.cat([gate[rank * 48 : rank * 48 + 48], up[rank * 48 : rank * 48 + 48]])
        )
