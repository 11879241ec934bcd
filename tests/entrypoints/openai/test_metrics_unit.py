"""``/metrics`` exports every vLLM-named metric under both ``kvserve:`` and ``vllm:`` (one
definition, same values), plus V1's ``vllm:kv_cache_usage_perc``; no server or model needed."""

from collections import Counter
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.metrics import EngineStats
from kvserve.entrypoints.openai.metrics import VLLM_ALIASES, ServerMetrics


def _fake_engine():
    lora_stats = {"max_lora": 2, "running_lora_adapters": ["chat", "sql"], "waiting_lora_adapters": ["fr"]}
    scheduler = SimpleNamespace(
        running=[1, 2], waiting=[1], swapped=[], num_preemptions=3, get_lora_stats=lambda: lora_stats
    )
    # the real stats class, so a property the exporter reads cannot be missing from the fake
    stats = EngineStats(
        num_prompt_tokens=40,
        num_generation_tokens=12,
        num_requests_added=5,
        num_steps=9,
        finished_by_reason=Counter({"length": 2, "stop": 1}),
        spec_num_drafts=4,
        spec_num_draft_tokens=16,
        spec_num_accepted_tokens=10,
        spec_accepted_per_pos=[4, 3, 2, 1],
        spec_num_draft_opportunities=8,
    )
    assert stats.spec_acceptance_rate == 10 / 16 and stats.spec_mean_accepted_length == 1 + 10 / 4
    kv = {
        "num_gpu_blocks": 10,
        "num_free_gpu_blocks": 6,
        "num_cpu_blocks": 4,
        "num_free_cpu_blocks": 3,
        "gpu_cache_usage": 0.4,
        "prefix_cache_hit_rate": 0.25,
        "num_preemptions": 3,
        "num_recomputed_tokens": 57,
        "num_swapped_out_blocks": 9,
        "num_backfilled": 5,
        "num_backfill_reclaims": 2,
        "num_wanted_evictions": 4,
        "host_tier_blocks": 7,
        "host_tier_capacity_blocks": 32,
        "host_tier_hits": 11,
        "host_tier_demotions": 13,
        "gpu_prefix_cache_hit_blocks": 21,
    }
    return SimpleNamespace(
        scheduler=scheduler,
        stats=stats,
        get_kv_cache_stats=lambda: kv,
        speculative_config=object(),
        lora_config=SimpleNamespace(max_loras=2),
        list_loras=lambda: {1, 2, 3},
    )


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


def test_preemption_work_counters():
    samples = _samples(ServerMetrics(_fake_engine(), "m").render().decode())
    assert samples[("kvserve:recomputed_prompt_tokens_total", ())] == 57
    assert samples[("kvserve:swapped_out_blocks_total", ())] == 9
    assert not any(k[0].startswith(("vllm:recomputed", "vllm:swapped_out")) for k in samples)


def test_backfill_and_eviction_counters():
    samples = _samples(ServerMetrics(_fake_engine(), "m").render().decode())
    assert samples[("kvserve:backfilled_requests_total", ())] == 5
    assert samples[("kvserve:backfill_reclaims_total", ())] == 2
    assert samples[("kvserve:wanted_block_evictions_total", ())] == 4


def test_prefix_cache_tier_metrics():
    samples = _samples(ServerMetrics(_fake_engine(), "m").render().decode())
    assert samples[("kvserve:host_tier_blocks", ())] == 7
    assert samples[("kvserve:host_tier_capacity_blocks", ())] == 32
    assert samples[("kvserve:host_tier_hits_total", ())] == 11
    assert samples[("kvserve:host_tier_demotions_total", ())] == 13
    assert samples[("kvserve:gpu_prefix_cache_hit_blocks_total", ())] == 21


def test_every_alias_names_an_exported_family():
    metrics = ServerMetrics(_fake_engine(), "m")
    families = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    for base, aliases in VLLM_ALIASES.items():
        assert "kvserve:" + base in families, base
        for alias in aliases:
            assert alias in families, alias


def test_spec_decode_metrics():
    """The acceptance counters, rate, mean accepted length and per-position acceptance, under
    both names; none of them without speculative decoding."""
    engine = _fake_engine()
    samples = _samples(ServerMetrics(engine, "m").render().decode())
    for prefix in ("kvserve:", "vllm:"):
        assert samples[(prefix + "spec_decode_num_drafts_total", ())] == 4
        assert samples[(prefix + "spec_decode_num_draft_tokens_total", ())] == 16
        assert samples[(prefix + "spec_decode_num_accepted_tokens_total", ())] == 10
        assert samples[(prefix + "spec_decode_num_emitted_tokens_total", ())] == 14
        assert samples[(prefix + "spec_decode_draft_acceptance_rate", ())] == 10 / 16
        for pos, count in enumerate([4, 3, 2, 1]):
            key = (prefix + "spec_decode_num_accepted_tokens_per_pos_total", (("position", str(pos)),))
            assert samples[key] == count
    assert samples[("kvserve:spec_decode_mean_accepted_length", ())] == 3.5
    assert not any(k[0].startswith("vllm:spec_decode_mean") for k in samples)
    engine.speculative_config = None
    assert not any("spec_decode" in k[0] for k in _samples(ServerMetrics(engine, "m").render().decode()))


def test_engine_stats_count_speculation():
    from kvserve.engine.metrics import EngineStats

    st = EngineStats()
    assert st.spec_acceptance_rate == 0.0 and st.spec_mean_accepted_length == 0.0
    st.on_speculation(4, 2)
    st.on_speculation(3, 3)
    st.on_speculation(2, 0)
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == (3, 9, 5)
    assert st.spec_accepted_per_pos == [2, 2, 1, 0]
    assert st.spec_acceptance_rate == 5 / 9
    assert st.spec_mean_accepted_length == 1 + 5 / 3


def test_lora_metrics_count_adapters_and_name_running_and_waiting_ones():
    engine = _fake_engine()
    samples = _samples(ServerMetrics(engine, "m", num_lora_adapters=lambda: 5).render().decode())
    assert samples[("kvserve:lora_adapters_loaded", ())] == 5
    labels = (("max_lora", "2"), ("running_lora_adapters", "chat,sql"), ("waiting_lora_adapters", "fr"))
    for name in ("vllm:lora_requests_info", "kvserve:lora_requests_info"):
        assert samples[(name, labels)] > 1.7e9  # the scrape time, as vLLM sets it
    # without the server's count: the engine's loaded adapters
    assert _samples(ServerMetrics(engine, "m").render().decode())[("kvserve:lora_adapters_loaded", ())] == 3
    engine.lora_config = None
    assert not any("lora" in k[0] for k in _samples(ServerMetrics(engine, "m").render().decode()))
