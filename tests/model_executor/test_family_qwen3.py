"""Qwen3 (per-head q/k RMSNorm, its own head_dim) against transformers on tiny random weights."""

import pytest
import torch

from kvserve.model_executor.models.registry import model_class
from tests.model_executor.family_checks import (
    ENGINE_SETTINGS,
    VOCAB,
    check_against_hf,
    prompts_of,
    save_family,
)

CONFIGS = {
    # GQA 4:2, head_dim 32 != hidden 64 / 4 heads, untied
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # GQA 8:1 (one KV head), head_dim 8 != 64 / 8, tied embeddings
    "mqa-tied": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True),
    # multi-head 2:2 with head_dim == hidden / heads, q/k/v and o bias
    "mha-bias": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=32, attention_bias=True),
}


def qwen3_config(**kw):
    from transformers import Qwen3Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return Qwen3Config(**base)


@pytest.fixture(scope="module", params=list(CONFIGS))
def qwen3(request, tmp_path_factory, default_tokenizer_dir):
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    return path, save_family(path, qwen3_config(**CONFIGS[request.param]), default_tokenizer_dir)


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
def test_qwen3_greedy_and_logprobs_match_transformers(qwen3, settings):
    path, hf = qwen3
    prompts = prompts_of(4, [13, 22, 9, 17])
    stats = check_against_hf(path, hf, prompts, 12, ENGINE_SETTINGS[settings])
    if settings != "default":  # the tiny cache did chunk, share and preempt
        assert stats["num_preemptions"] > 0
        assert stats["prefix_cache_hits"] > 0


def test_qwen3_q_k_norms_are_loaded_and_used(qwen3):
    """The norms are real parts: a model built with the loaded weights holds them, and the
    native decode step takes the model (it runs the q/k norms)."""
    from kvserve.model_executor.model_loader import load_hf_config, load_model

    path, hf = qwen3
    model = load_model(path, torch.float32, "cpu")
    assert type(model) is model_class(load_hf_config(path), str(path))
    attn = model.layers[1].self_attn
    torch.testing.assert_close(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight)
    assert attn.q_norm.weight.shape == (hf.config.head_dim,)
    assert model.native_decode_parts
