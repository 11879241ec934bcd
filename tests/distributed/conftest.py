"""A local Ray runtime (2 CPUs) shared by the data-parallel tests, and their engine settings."""

import pytest

# The tiny random Llama (tests/conftest.py), small enough that two replicas load in seconds.
ENGINE_KWARGS = dict(
    block_size=8,
    num_gpu_blocks=64,
    num_cpu_blocks=16,
    max_model_len=256,
    max_num_batched_tokens=256,
    max_num_seqs=16,
    seed=0,
    enable_prefix_caching=True,
)


@pytest.fixture(scope="session")
def ray_runtime():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    ray.shutdown()


#: A vocabulary not divisible by 2 or 3 (the LM head's vocab shards need padding).
ODD_VOCAB = 49153


@pytest.fixture(scope="session")
def tiny_llama_tied_odd_vocab_dir(tmp_path_factory, default_tokenizer_dir):
    """The tiny random Llama of ``tests/conftest.py`` with tied embeddings (the default
    model's layout: the LM head is the embedding table) and a vocabulary of ``ODD_VOCAB``."""
    from tests.conftest import _save_tiny, tiny_llama_config

    config = tiny_llama_config(vocab_size=ODD_VOCAB, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory, default_tokenizer_dir, "tiny-llama-tied-odd", config)
