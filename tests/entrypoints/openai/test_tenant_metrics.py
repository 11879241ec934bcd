"""Per-tenant /metrics (label ``tenant``): served tokens, requests, queue time and TTFT of
finished requests, with bounded cardinality (``TENANT_SERIES`` named tenants + ``other``)."""

from types import SimpleNamespace

import pytest

from kvserve.engine.metrics import DEFAULT_TENANT, OTHER_TENANT, TENANT_SERIES, TenantStats
from kvserve.entrypoints.openai.metrics import ServerMetrics
from tests.entrypoints.openai.test_metrics_unit import _fake_engine, _samples


def _finish(stats, tenant, prompt_len, out_len, queue=0.5, ttft=1.0):
    group = SimpleNamespace(
        tenant=tenant,
        metrics=SimpleNamespace(ttft=ttft, queue_time=queue, e2e_latency=2.0, tpot=lambda n: 0.1),
    )
    out = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=[7] * out_len, finish_reason="length")],
        prompt_token_ids=[1] * prompt_len,
    )
    stats.on_request_finished(group, out)


def test_tenant_series_in_metrics():
    engine = _fake_engine()
    metrics = ServerMetrics(engine, "m")
    _finish(engine.stats, "alice", 10, 5, queue=0.25, ttft=0.5)
    _finish(engine.stats, "alice", 4, 1, queue=0.75, ttft=1.5)
    _finish(engine.stats, None, 3, 2)
    s = _samples(metrics.render().decode())
    alice, default = (("tenant", "alice"),), (("tenant", DEFAULT_TENANT),)
    assert s[("kvserve:tenant_served_tokens_total", alice)] == 20
    assert s[("kvserve:tenant_requests_total", alice)] == 2
    assert s[("kvserve:tenant_request_queue_time_seconds_sum", alice)] == 1.0
    assert s[("kvserve:tenant_request_queue_time_seconds_count", alice)] == 2
    assert s[("kvserve:tenant_time_to_first_token_seconds_sum", alice)] == 2.0
    assert s[("kvserve:tenant_served_tokens_total", default)] == 5
    assert not any(k[1] == (("tenant", OTHER_TENANT),) for k in s)  # nothing beyond the named yet
    assert not any(k[0].startswith("vllm:tenant") for k in s)  # no vLLM twin


def test_cardinality_is_bounded_and_named_series_only_grow():
    ts = TenantStats(series=3, max_tracked=5)
    for i, tokens in enumerate([50, 10, 40, 30]):
        ts.on_finished(f"t{i}", tokens, 0.1, 0.2)
    snap = ts.snapshot()
    # the three most served are named, t1 goes to other
    assert list(snap) == ["t0", "t2", "t3", OTHER_TENANT]
    assert snap[OTHER_TENANT].served_tokens == 10
    # a tenant that later outgrows the named ones still stays under other: named series are sticky
    ts.on_finished("t1", 1000, None, None)
    snap = ts.snapshot()
    assert list(snap) == ["t0", "t2", "t3", OTHER_TENANT]
    assert snap[OTHER_TENANT].served_tokens == 1010 and snap[OTHER_TENANT].queue_count == 1
    # memory stays bounded: past max_tracked the least-served unnamed tenant is folded into other
    for i in range(100):
        ts.on_finished(f"u{i}", 1, 0.0, 0.0)
    assert len(ts.totals) <= 5
    snap = ts.snapshot()
    assert len(snap) == 4
    assert sum(t.served_tokens for t in snap.values()) == 50 + 10 + 40 + 30 + 1000 + 100
    assert sum(t.requests for t in snap.values()) == 105


def test_default_series_count_is_documented():
    assert TENANT_SERIES == 16
    with pytest.raises(ValueError, match="series < max_tracked"):
        TenantStats(series=4, max_tracked=4)
