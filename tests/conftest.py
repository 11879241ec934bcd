"""Shared fixtures: the default model directory and a tiny random-weight Llama."""

import os

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Every property test runs without a per-example deadline and without the too-slow health
# check: both are wall-clock limits, which a loaded CI machine (steps 10x slower) trips on
# examples that are fast when quiet; a deadline exceeded once and met on the replay is
# reported as a Flaky failure. Explicit ``@settings`` inherit this profile.
settings.register_profile(
    "kvserve", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("kvserve")


@pytest.fixture(scope="session")
def default_model_dir():
    """SmolLM2-135M-Instruct as a plain HF directory (converted from the GGUF once, cached)."""
    from kvserve.model_executor.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def default_hf_model(default_model_dir):
    """The default model in transformers (float32, eval mode): the reference the default-model
    tests compare against, loaded once per session. Shared: a test must not modify it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_tokenizer_dir(request):
    """The default model's tokenizer files: ``$KVSERVE_TEST_TOKENIZER_DIR`` when set (a machine
    without the default model's package, e.g. a GPU check), else the converted default model."""
    env = os.environ.get("KVSERVE_TEST_TOKENIZER_DIR")
    if env:
        return env
    return request.getfixturevalue("default_model_dir")


def _save_tiny(tmp_path_factory, tokenizer_dir, name, config):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # Random weights give flat logits; scaling the output layer makes greedy choices decisive
    # (fewer near-ties) without changing what is tested.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer_dir):
    """A 2-layer random-weight Llama (GQA 4:2, vocab of the default tokenizer) with the
    default model's tokenizer, saved as safetensors."""
    return _save_tiny(tmp_path_factory, default_tokenizer_dir, "tiny-llama", tiny_llama_config())


def tiny_llama_config(**overrides):
    """The ``LlamaConfig`` of ``tiny_llama_dir`` (2 layers, hidden 64, GQA 4:2, the default
    tokenizer's vocabulary of 49,152, untied), with ``overrides`` applied."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaConfig(**{**fields, **overrides})


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.golden import TEST_DEVICE

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
