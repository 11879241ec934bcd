"""``/metrics`` of a data-parallel server: every replica's families, each sample labelled with
its ``replica`` index, plus the driver's HTTP response counter and ``kvserve:dp_*`` families of
the router (requests routed per replica, retries, restarts, replicas up).

The replicas' families are fetched by ``refresh()`` (awaited by the route before it renders),
so a scrape never blocks the event loop on a replica; a replica that is down or does not
answer in time is left out of that scrape (``kvserve:dp_replica_up`` says which).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from kvserve.engine.prometheus import AliasingCollector


def merge_replica_families(per_replica: list[tuple[int, list[Metric]]]) -> list[Metric]:
    """One family per name, holding every replica's samples with a ``replica`` label added
    (families in first-seen order). ``per_replica``: ``(replica index, families)``."""
    merged: dict[str, Metric] = {}
    for index, families in per_replica:
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = Metric(fam.name, fam.documentation, fam.type, getattr(fam, "unit", ""))
                merged[fam.name] = out
            for s in fam.samples:
                labels = dict(s.labels)
                labels["replica"] = str(index)
                out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    return list(merged.values())


class _ReplicaCollector:
    def __init__(self, owner: DataParallelMetrics):
        self.owner = owner

    def collect(self) -> Iterable[Metric]:
        yield from self.owner._families
        dp = self.owner.dp_engine
        up = GaugeMetricFamily("kvserve:dp_replica_up", "1 while the replica is up.", labels=["replica"])
        outstanding = GaugeMetricFamily(
            "kvserve:dp_replica_outstanding_requests",
            "Requests sent to the replica and not yet ended.",
            labels=["replica"],
        )
        routed = CounterMetricFamily(
            "kvserve:dp_requests_routed", "Requests the router sent to the replica.", labels=["replica"]
        )
        restarts = CounterMetricFamily(
            "kvserve:dp_replica_restarts", "Times the replica's process was replaced.", labels=["replica"]
        )
        for r in dp.replicas:
            lbl = [str(r.index)]
            up.add_metric(lbl, 1.0 if r.healthy else 0.0)
            outstanding.add_metric(lbl, r.outstanding)
            routed.add_metric(lbl, r.routed)
            restarts.add_metric(lbl, r.restarts)
        yield from (up, outstanding, routed, restarts)
        yield CounterMetricFamily(
            "kvserve:dp_requests_retried",
            "Requests re-sent to another replica after theirs died before any output.",
            value=dp.num_retried,
        )


class DataParallelMetrics:
    """``ServerMetrics``' interface (``count_response``, ``render``, ``close``) plus
    ``refresh()``, for a ``DataParallelAsyncEngine``.

    Args:
        dp_engine: the engine whose replicas are scraped.
        model_name: kept for the interface (the replicas label their own samples).
    """

    def __init__(self, dp_engine, model_name: str):
        self.dp_engine = dp_engine
        self.model_name = model_name
        self._families: list[Metric] = []
        self.source = CollectorRegistry(auto_describe=False)
        self.source.register(_ReplicaCollector(self))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AliasingCollector(self.source))
        self.http_responses = Counter(
            "kvserve:http_responses",
            "HTTP responses by endpoint and status.",
            ["endpoint", "status"],
            registry=self.source,
        )

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Fetch every live replica's families (a replica that does not answer in
        ``timeout_s`` is left out of this scrape)."""
        self._families = merge_replica_families(
            await self.dp_engine.replica_calls("metric_families", timeout_s)
        )

    def count_response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response."""
        self.http_responses.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition (of the last ``refresh``)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        """Nothing to detach (the replicas keep their own listeners)."""
