"""A checkpoint's config.json with values no model can honour is a ValueError naming the file
and the field, at load (before any weight is read), never a run with wrong numbers."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM
from kvserve.model_executor.config_checks import check_config_values, read_hf_config
from tests.model_executor.helpers import llama_config


def _write(path, **overrides):
    """A tiny Llama config.json (and an empty weights file) in ``path`` with ``overrides``
    applied to the JSON (a ``None`` value deletes the key)."""
    cfg = llama_config().to_dict()
    for k, v in overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"")
    return path


BAD = {
    "kv heads not dividing": (
        dict(num_key_value_heads=3),
        r"num_attention_heads=4 must be a multiple of num_key_value_heads=3",
    ),
    "negative rope base": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
        r"rope_parameters.rope_theta must be a finite number > 0, got -1.0",
    ),
    "zero linear factor": (
        dict(rope_parameters={"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}),
        r"rope_parameters.factor must be a finite number > 0, got 0.0",
    ),
    "nothing rotated": (
        dict(
            partial_rotary_factor=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0},
        ),
        r"rope_parameters.partial_rotary_factor must be a number in \(0, 1\], got 0.0",
    ),
    "negative norm epsilon": (dict(rms_norm_eps=-1e-6), r"rms_norm_eps must be a finite number >= 0"),
    "zero window": (
        dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0),
        r"sliding_window must be an integer >= 1 \(or null for no window\), got 0",
    ),
    "eos outside the vocabulary": (
        dict(eos_token_id=[2, 999]),
        r"eos_token_id 999 must be an integer in \[0, vocab_size=256\)",
    ),
    "no positions": (dict(max_position_embeddings=0), r"max_position_embeddings must be an integer >= 1"),
    # transformers' own validation errors are no ValueError: wrapped, naming the file
    "hidden not a multiple of heads": (
        dict(num_attention_heads=5, num_key_value_heads=5, head_dim=None),
        r"transformers cannot read this config: .*hidden size \(64\) is not a multiple",
    ),
    "a string size": (dict(hidden_size="64"), r"transformers cannot read this config: .*'hidden_size'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_impossible_value_is_refused_naming_file_and_field(tmp_path, case):
    overrides, message = BAD[case]
    _write(tmp_path, **overrides)
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json: {message}"):
        read_hf_config(tmp_path)


def test_engine_refuses_before_reading_weights(tmp_path):
    # the weights file is empty: reaching it would be another error
    _write(tmp_path, rms_norm_eps=-1.0)
    with pytest.raises(ValueError, match=r"config.json: rms_norm_eps must be a finite number >= 0"):
        LLM(model=str(tmp_path))


def test_unused_window_and_valid_configs_pass(tmp_path):
    from transformers import Gemma3TextConfig, Qwen2Config

    # Qwen2 carries a window it does not use unless use_sliding_window
    check_config_values(Qwen2Config(sliding_window=0, use_sliding_window=False), "config.json")
    # Gemma 3: a rope base per layer type, head_dim not hidden / heads
    check_config_values(
        Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32), "c"
    )
    _write(tmp_path)
    assert read_hf_config(tmp_path).num_key_value_heads == 2


def test_gemma3_rope_base_per_layer_type_is_checked():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 0.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
    with pytest.raises(ValueError, match=r"c.json: rope_parameters.sliding_attention.rope_theta must be"):
        check_config_values(cfg, "c.json")


def test_tokenizer_larger_than_the_vocabulary_is_named(tmp_path, default_tokenizer_dir):
    from transformers import AutoTokenizer

    from kvserve.transformers_utils.tokenizer import tokenizer_overflow

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir)
    cfg = llama_config()  # 256 rows under the tokenizer's 49,152 tokens
    assert tokenizer_overflow(tok, cfg, tmp_path) == (
        f"{tmp_path}/config.json: vocab_size=256 is smaller than the tokenizer's vocabulary (49152 "
        "tokens): prompts holding ids past 255 will be refused"
    )
    assert tokenizer_overflow(tok, llama_config(vocab_size=49152), tmp_path) is None
