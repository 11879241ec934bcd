"""Operators' routes and cache metrics: ``POST /reset_prefix_cache`` (behind the API key) drops
the cached blocks, so the next identical prompt is computed again; ``/metrics`` has vLLM V1's
prefix-cache counters and ``cache_config_info``."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

KEY = "op-key"
PROMPT = list(range(10, 42))  # 32 tokens: 8 full blocks of 4


@pytest.fixture(scope="module")
def cached_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    kwargs = {**TINY_SERVER_KWARGS, "enable_prefix_caching": True}
    with running_server(EngineArgs(model=str(tiny_llama_dir), **kwargs), "tiny", api_key=KEY) as s:
        yield s


def _metrics(server) -> dict:
    with server.http() as h:
        text = h.get("/metrics").text
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


def _complete(server) -> None:
    with server.http() as h:
        r = h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    server.wait_idle()


def test_reset_prefix_cache_makes_the_next_prompt_miss(cached_server):
    _complete(cached_server)
    before = _metrics(cached_server)
    _complete(cached_server)  # the same prompt: its full blocks hit the cache
    hit = _metrics(cached_server)
    assert hit["vllm:prefix_cache_hits_total"].value > before["vllm:prefix_cache_hits_total"].value
    assert hit["vllm:prefix_cache_queries_total"].value - before[
        "vllm:prefix_cache_queries_total"
    ].value == len(PROMPT)
    with cached_server.http(headers={"Authorization": "Bearer wrong"}) as h:
        assert h.post("/reset_prefix_cache").status_code == 401
    with cached_server.http() as h:
        r = h.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert cached_server.engine.get_kv_cache_stats()["num_cached_gpu_blocks"] == 0
    _complete(cached_server)  # computed again: no new hit
    after = _metrics(cached_server)
    assert after["vllm:prefix_cache_hits_total"].value == hit["vllm:prefix_cache_hits_total"].value


def test_cache_config_info_labels_the_kv_cache(cached_server):
    m = _metrics(cached_server)
    for prefix in ("kvserve", "vllm"):
        info = m[f"{prefix}:cache_config_info"]
        assert info.value == 1.0
        assert info.labels["block_size"] == str(TINY_SERVER_KWARGS["block_size"])
        assert info.labels["num_gpu_blocks"] == str(TINY_SERVER_KWARGS["num_gpu_blocks"])
        assert info.labels["enable_prefix_caching"] == "True"
