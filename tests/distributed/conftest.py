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
