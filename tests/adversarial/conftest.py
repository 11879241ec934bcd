"""A real uvicorn server over the tiny random-weight Llama with a small KV cache, for the
adversarial server tests (cheap: no default-model forward passes)."""

import pytest

from tests.server_harness import running_server

TINY_SERVER_KWARGS = dict(
    block_size=4,
    num_gpu_blocks=24,
    num_cpu_blocks=8,
    max_model_len=128,
    max_num_batched_tokens=128,
    max_num_seqs=8,
    watermark=0.0,
    seed=0,
)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS), "tiny", shutdown_grace_s=2.0
    ) as s:
        yield s
