"""A real uvicorn server on 127.0.0.1 (free port, background thread) over the default model,
started once per session and shared by every module of this folder that asks for ``server``,
plus helpers to reach it (the official ``openai`` client, httpx)."""

import pytest

from tests.server_harness import running_server

API_KEY = "test-key"
MODEL = "smollm2-test"

# Small cache / limits so every scenario is reachable on one server:
#  - prompt_limit = min(max_model_len 1024, max_num_batched_tokens 512) = 512   (B01: 600 > 512)
#  - KV pool = 48 blocks x 8 tokens = 384 tokens                                 (B03: 400 -> 50 > 48)
ENGINE_KWARGS = dict(
    block_size=8,
    num_gpu_blocks=48,
    num_cpu_blocks=32,
    max_model_len=1024,
    max_num_batched_tokens=512,
    max_num_seqs=32,
    seed=0,
    enable_chunked_prefill=False,
)  # B01: prompt_limit = min(max_model_len, budget)
MAX_BODY_BYTES = 128 * 1024


# One session-wide server: the modules using it only read it (metrics are compared as deltas,
# every test waits for the engine to be idle), and each start loads the default model again.
@pytest.fixture(scope="session")
def server():
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(**ENGINE_KWARGS),
        MODEL,
        api_key=API_KEY,
        max_body_bytes=MAX_BODY_BYTES,
        shutdown_grace_s=5.0,
    ) as s:
        yield s
