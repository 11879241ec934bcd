"""``/metrics`` exports every vLLM-named metric under both ``kvserve:`` and ``vllm:`` (one
definition, same values), plus V1's ``vllm:kv_cache_usage_perc``; no server or model needed."""

from collections import Counter
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.metrics import VLLM_ALIASES, ServerMetrics


def _fake_engine():
    scheduler = SimpleNamespace(running=[1, 2], waiting=[1], swapped=[], num_preemptions=3)
    stats = SimpleNamespace(
        num_prompt_tokens=40,
        num_generation_tokens=12,
        num_requests_added=5,
        num_steps=9,
        finished_by_reason=Counter({"length": 2, "stop": 1}),
        listeners=[],
    )
    kv = {
        "num_gpu_blocks": 10,
        "num_free_gpu_blocks": 6,
        "num_cpu_blocks": 4,
        "num_free_cpu_blocks": 3,
        "gpu_cache_usage": 0.4,
        "prefix_cache_hit_rate": 0.25,
        "num_preemptions": 3,
    }
    return SimpleNamespace(scheduler=scheduler, stats=stats, get_kv_cache_stats=lambda: kv)


def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_vllm_names_equal_kvserve_names():
    engine = _fake_engine()
    metrics = ServerMetrics(engine, "m")
    group = SimpleNamespace(
        metrics=SimpleNamespace(ttft=0.2, queue_time=0.01, e2e_latency=1.0, tpot=lambda n: 0.05)
    )
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2, 3])], prompt_token_ids=[1] * 7)
    metrics.on_request_finished(group, out)
    samples = _samples(metrics.render().decode())
    expected = {
        "vllm:num_requests_running": 2,
        "vllm:num_requests_waiting": 1,
        "vllm:num_requests_swapped": 0,
        "vllm:gpu_cache_usage_perc": 0.4,
        "vllm:kv_cache_usage_perc": 0.4,
        "vllm:cpu_cache_usage_perc": 0.25,
        "vllm:gpu_prefix_cache_hit_rate": 0.25,
        "vllm:num_preemptions_total": 3,
        "vllm:prompt_tokens_total": 40,
        "vllm:generation_tokens_total": 12,
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:time_to_first_token_seconds_sum": 0.2,
        "vllm:time_per_output_token_seconds_count": 1,
        "vllm:e2e_request_latency_seconds_sum": 1.0,
        "vllm:request_queue_time_seconds_count": 1,
        "vllm:request_prompt_tokens_sum": 7,
        "vllm:request_generation_tokens_sum": 3,
    }
    for name, value in expected.items():
        assert samples[(name, ())] == value, name
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 2
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    # every vllm: sample has a kvserve: twin with the same value (V1's extra name aside)
    vllm = {k: v for k, v in samples.items() if k[0].startswith("vllm:")}
    assert len(vllm) > 40  # histogram buckets included
    for (name, labels), value in vllm.items():
        twin = name.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
            "vllm:", "kvserve:"
        )
        assert samples[(twin, labels)] == value, name
    # kvserve-only metrics get no vllm: name
    assert ("kvserve:num_gpu_blocks", ()) in samples
    assert not any(
        k[0].startswith("vllm:num_gpu_blocks") or "http_responses" in k[0] and "vllm" in k[0] for k in samples
    )


def test_every_alias_names_an_exported_family():
    metrics = ServerMetrics(_fake_engine(), "m")
    families = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    for base, aliases in VLLM_ALIASES.items():
        assert "kvserve:" + base in families, base
        for alias in aliases:
            assert alias in families, alias
