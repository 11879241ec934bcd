"""Prometheus metrics of an ``LLMEngine``: vLLM's metric names, under a ``kvserve:`` prefix and again
under vLLM's own ``vllm:`` prefix (same values), so existing vLLM dashboards and alerts work.

Gauges and cumulative counters are read from the engine at scrape time (a custom collector);
latency histograms are fed by an ``EngineStats`` listener as each request finishes (on the
engine thread; ``prometheus_client`` metrics are thread-safe). Each ``ServerMetrics`` has its own
``CollectorRegistry`` so that several apps can live in one process (tests).

The HTTP server exports one ``ServerMetrics`` (``kvserve.entrypoints.openai.metrics``); each
data-parallel replica runs one too and the driver merges their families
(``kvserve.distributed.dp_metrics``), which is why this lives in ``engine``, below both.

Exported:
- gauges ``kvserve:num_requests_running|waiting|swapped``, ``kvserve:gpu_cache_usage_perc``,
  ``kvserve:cpu_cache_usage_perc`` (fractions 0..1, as in vLLM), ``kvserve:gpu_prefix_cache_hit_rate``,
  ``kvserve:num_gpu_blocks``, ``kvserve:num_free_gpu_blocks``, ``kvserve:cache_config_info``
  (value 1; labels: the KV cache's block size, block counts, prefix caching, window, watermark,
  swap space);
- counters ``kvserve:prefix_cache_queries_total`` and ``kvserve:prefix_cache_hits_total``
  (prompt tokens looked up / found in the prefix cache, vLLM V1's counters);
- counters ``kvserve:prompt_tokens_total``, ``kvserve:generation_tokens_total``,
  ``kvserve:num_preemptions_total``, ``kvserve:recomputed_prompt_tokens_total`` (tokens whose KV
  a recompute preemption dropped), ``kvserve:swapped_out_blocks_total`` (blocks a swap
  preemption moved out), ``kvserve:request_success_total{finished_reason}``,
  ``kvserve:num_requests_added_total``, ``kvserve:engine_steps_total``,
  ``kvserve:http_responses_total{endpoint,status}``;
- histograms ``kvserve:time_to_first_token_seconds``, ``kvserve:time_per_output_token_seconds``,
  ``kvserve:e2e_request_latency_seconds``, ``kvserve:request_queue_time_seconds``,
  ``kvserve:request_prompt_tokens``, ``kvserve:request_generation_tokens``;
- with speculative decoding: counters ``kvserve:spec_decode_num_drafts_total`` (verified
  sequence-steps), ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
  ``..._num_emitted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}`` (how often
  draft position ``position`` (0-based) was accepted), gauges
  ``kvserve:spec_decode_draft_acceptance_rate`` (accepted / drafted) and
  ``kvserve:spec_decode_mean_accepted_length`` (tokens emitted per verification, kvserve only),
  counter ``kvserve:spec_decode_num_draft_opportunities_total`` (decode sequence-steps with
  lookahead slots) and gauge ``kvserve:spec_decode_mean_draft_length`` (drafted tokens per such
  sequence-step: the draft length the dynamic policy chose; kvserve only);
- with LoRA (``--enable-lora``): gauge ``kvserve:lora_adapters_loaded`` (adapters served by
  name, kvserve only) and vLLM's ``kvserve:lora_requests_info`` (value: the scrape time; labels
  ``running_lora_adapters``, ``waiting_lora_adapters`` (comma-separated adapter names) and
  ``max_lora``).

Every metric is defined once, under ``kvserve:``; ``VLLM_ALIASES`` names the ones vLLM also has
and the ``vllm:`` names they are exported under too (V0's names, plus V1's
``vllm:kv_cache_usage_perc`` for the device-pool usage). kvserve-only metrics (block counts,
engine steps, HTTP responses) have no alias.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

logger = logging.getLogger("kvserve.server.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PREFIX = "kvserve:"

#: kvserve metric family (without the prefix) -> the vLLM names it is also exported under.
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_swapped": ("vllm:num_requests_swapped",),
    "gpu_cache_usage_perc": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "cpu_cache_usage_perc": ("vllm:cpu_cache_usage_perc",),
    "lora_requests_info": ("vllm:lora_requests_info",),
    "gpu_prefix_cache_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "cache_config_info": ("vllm:cache_config_info",),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "spec_decode_num_emitted_tokens": ("vllm:spec_decode_num_emitted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "spec_decode_draft_acceptance_rate": ("vllm:spec_decode_draft_acceptance_rate",),
}

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_LATENCY_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    300.0,
)
#: (kind, name, help, key of ``get_kv_cache_stats``) of the kvserve-only scheduler and KV-tier
#: series
_SCHEDULER_SERIES = (
    (
        "counter",
        "kvserve:backfilled_requests",
        "Admissions past a waiting request that had to wait for KV blocks (backfill).",
        "num_backfilled",
    ),
    (
        "counter",
        "kvserve:backfill_reclaims",
        "Backfilled requests preempted so that the request they passed could start.",
        "num_backfill_reclaims",
    ),
    (
        "counter",
        "kvserve:rank_preemptions",
        "Preemptions of running requests by a waiting one the policy ranks above them (priority, fair share).",
        "num_rank_preemptions",
    ),
    (
        "counter",
        "kvserve:rank_swap_preemptions",
        "Rank preemptions whose victim was swapped out (not recomputed).",
        "num_rank_swap_preemptions",
    ),
    (
        "counter",
        "kvserve:rank_recomputed_tokens",
        "Tokens whose KV rank preemptions dropped (prefilled again).",
        "num_rank_recomputed_tokens",
    ),
    (
        "counter",
        "kvserve:wanted_block_evictions",
        "Cached KV blocks evicted although a waiting request's prompt needed them.",
        "num_wanted_evictions",
    ),
    (
        "gauge",
        "kvserve:host_tier_blocks",
        "Prefix-cache blocks held in the host tier (evicted from the device pool).",
        "host_tier_blocks",
    ),
    (
        "gauge",
        "kvserve:host_tier_capacity_blocks",
        "Most blocks the prefix cache's host tier may hold (0: no tier).",
        "host_tier_capacity_blocks",
    ),
    (
        "counter",
        "kvserve:host_tier_hits",
        "Prefix-cache blocks found in the host tier and swapped back into the device pool.",
        "host_tier_hits",
    ),
    (
        "counter",
        "kvserve:host_tier_demotions",
        "Cached blocks the device pool evicted that were copied into the host tier.",
        "host_tier_demotions",
    ),
    (
        "counter",
        "kvserve:gpu_prefix_cache_hit_blocks",
        "Prefix-cache blocks found in the device pool.",
        "gpu_prefix_cache_hit_blocks",
    ),
)

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class EngineCollector:
    """Reads queue lengths, cache usage and the engine's cumulative counters at scrape time."""

    def __init__(self, engine, model_name: str, num_lora_adapters: Callable[[], int] | None = None):
        self.engine = engine
        self.model_name = model_name
        self.num_lora_adapters = num_lora_adapters
        self._last_kv: dict = {}
        self._last_lora: dict = {}

    def _kv_stats(self) -> dict:
        try:  # the engine thread may be mid-step; a failed read keeps the previous values
            self._last_kv = dict(self.engine.get_kv_cache_stats())
        except Exception as e:  # pragma: no cover - timing dependent
            logger.debug("kv-cache stats unavailable: %r", e)
        return self._last_kv

    def collect(self) -> Iterable:
        """Prometheus collector protocol."""
        labels, values = ["model_name"], [self.model_name]
        sched = self.engine.scheduler
        stats = self.engine.stats
        kv = self._kv_stats()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge(
            "kvserve:num_requests_running", "Request groups in the running queue.", len(sched.running)
        )
        yield gauge(
            "kvserve:num_requests_waiting", "Request groups in the waiting queue.", len(sched.waiting)
        )
        yield gauge("kvserve:num_requests_swapped", "Request groups swapped out to CPU.", len(sched.swapped))
        num_gpu = kv.get("num_gpu_blocks") or 0
        free_gpu = kv.get("num_free_gpu_blocks", num_gpu) or 0
        num_cpu = kv.get("num_cpu_blocks") or 0
        free_cpu = kv.get("num_free_cpu_blocks", num_cpu) or 0
        gpu_usage = kv.get("gpu_cache_usage")
        if gpu_usage is None:
            gpu_usage = 1.0 - free_gpu / num_gpu if num_gpu else 0.0
        yield gauge("kvserve:gpu_cache_usage_perc", "KV-cache (device pool) usage, 0..1.", gpu_usage)
        yield gauge(
            "kvserve:cpu_cache_usage_perc",
            "CPU swap-pool usage, 0..1.",
            1.0 - free_cpu / num_cpu if num_cpu else 0.0,
        )
        hit_rate = kv.get("prefix_cache_hit_rate", kv.get("gpu_prefix_cache_hit_rate"))
        if hit_rate is None:
            queries = kv.get("prefix_cache_queries", 0) or 0
            hits = kv.get("prefix_cache_hits", 0) or 0
            hit_rate = hits / queries if queries else 0.0
        yield gauge("kvserve:gpu_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens), 0..1.", hit_rate)
        # vLLM V1's counters: a dashboard divides their rates over any window it likes
        yield counter(
            "kvserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            kv.get("prefix_cache_queries", 0) or 0,
        )
        yield counter(
            "kvserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            kv.get("prefix_cache_hits", 0) or 0,
        )
        yield self._cache_config_info(num_gpu, num_cpu)
        yield gauge("kvserve:num_gpu_blocks", "KV blocks in the device pool.", num_gpu)
        yield gauge(
            "kvserve:num_free_gpu_blocks", "Free (or evictable) KV blocks in the device pool.", free_gpu
        )
        preemptions = kv.get("num_preemptions", getattr(sched, "num_preemptions", 0)) or 0
        yield counter("kvserve:num_preemptions", "Preemptions (swap or recompute).", preemptions)
        yield counter(
            "kvserve:recomputed_prompt_tokens",
            "Tokens whose computed KV a recompute preemption dropped (prefilled again).",
            kv.get("num_recomputed_tokens", 0) or 0,
        )
        yield counter(
            "kvserve:swapped_out_blocks",
            "KV blocks swap preemptions moved to host memory.",
            kv.get("num_swapped_out_blocks", 0) or 0,
        )
        makers = {"counter": counter, "gauge": gauge}
        for kind, name, doc, key in _SCHEDULER_SERIES:
            yield makers[kind](name, doc, kv.get(key, 0) or 0)
        yield counter("kvserve:prompt_tokens", "Prompt tokens of accepted requests.", stats.num_prompt_tokens)
        yield counter("kvserve:generation_tokens", "Generated tokens.", stats.num_generation_tokens)
        yield counter(
            "kvserve:num_requests_added", "Requests accepted by the engine.", stats.num_requests_added
        )
        yield counter("kvserve:engine_steps", "Engine steps that ran the model.", stats.num_steps)
        if getattr(self.engine, "speculative_config", None) is not None:
            yield from self._spec_decode(stats, counter, gauge, labels, values)
        if getattr(self.engine, "lora_config", None) is not None:
            yield from self._lora(gauge)
        success = CounterMetricFamily(
            "kvserve:request_success",
            "Finished requests by finish reason.",
            labels=labels + ["finished_reason"],
        )
        for reason, count in sorted(dict(stats.finished_by_reason).items()):
            success.add_metric(values + [str(reason)], float(count))
        yield success
        tenants = getattr(stats, "tenants", None)
        if tenants is not None:
            yield from self._tenants(tenants.snapshot(), labels, values)

    @staticmethod
    def _tenants(snap: dict, labels: list[str], values: list[str]) -> Iterable:
        """Per-tenant totals of finished requests (label ``tenant``: ``TENANT_SERIES`` named
        tenants, the rest as ``other``, requests without a tenant as ``default``)."""
        lbl = labels + ["tenant"]
        served = CounterMetricFamily(
            "kvserve:tenant_served_tokens",
            "Prompt + generated tokens of finished requests, by tenant (the request's user).",
            labels=lbl,
        )
        reqs = CounterMetricFamily("kvserve:tenant_requests", "Finished requests, by tenant.", labels=lbl)
        queue = SummaryMetricFamily(
            "kvserve:tenant_request_queue_time_seconds",
            "Arrival to first scheduled, by tenant (finished requests).",
            labels=lbl,
        )
        ttft = SummaryMetricFamily(
            "kvserve:tenant_time_to_first_token_seconds",
            "Time to first token, by tenant (finished requests).",
            labels=lbl,
        )
        for name, t in snap.items():
            v = values + [name]
            served.add_metric(v, float(t.served_tokens))
            reqs.add_metric(v, float(t.requests))
            queue.add_metric(v, count_value=t.queue_count, sum_value=t.queue_s_sum)
            ttft.add_metric(v, count_value=t.ttft_count, sum_value=t.ttft_s_sum)
        yield from (served, reqs, queue, ttft)

    def _cache_config_info(self, num_gpu: int, num_cpu: int) -> GaugeMetricFamily:
        """``cache_config_info``: value 1, the KV cache's configuration as labels (vLLM's
        metric; routers such as the Gateway API inference extension read ``block_size``)."""
        cfg = getattr(self.engine, "cache_config", None)
        info = {
            "block_size": getattr(cfg, "block_size", ""),
            "num_gpu_blocks": num_gpu,
            "num_cpu_blocks": num_cpu,
            "enable_prefix_caching": getattr(cfg, "enable_prefix_caching", ""),
            "sliding_window": getattr(cfg, "sliding_window", None) or "",
            "watermark": getattr(cfg, "watermark", ""),
            "swap_space_gib": getattr(cfg, "swap_space_gib", ""),
        }
        g = GaugeMetricFamily(
            "kvserve:cache_config_info", "The KV cache's configuration (labels), value 1.", labels=list(info)
        )
        g.add_metric([str(v) for v in info.values()], 1.0)
        return g

    def _lora(self, gauge) -> Iterable:
        count = (
            self.num_lora_adapters() if self.num_lora_adapters is not None else len(self.engine.list_loras())
        )
        yield gauge("kvserve:lora_adapters_loaded", "LoRA adapters served (by name).", count)
        try:  # the engine thread may be changing the queues; a failed read keeps the last one
            self._last_lora = dict(self.engine.scheduler.get_lora_stats())
        except Exception as e:  # pragma: no cover - timing dependent
            logger.debug("LoRA stats unavailable: %r", e)
        st = self._last_lora
        info = GaugeMetricFamily(
            "kvserve:lora_requests_info",
            "Running and waiting LoRA adapters (value: the scrape time).",
            labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
        )
        info.add_metric(
            [
                ",".join(st.get("running_lora_adapters", [])),
                str(st.get("max_lora", self.engine.lora_config.max_loras)),
                ",".join(st.get("waiting_lora_adapters", [])),
            ],
            time.time(),
        )
        yield info

    @staticmethod
    def _spec_decode(stats, counter, gauge, labels, values) -> Iterable:
        yield counter(
            "kvserve:spec_decode_num_drafts", "Sequence-steps that verified drafts.", stats.spec_num_drafts
        )
        yield counter(
            "kvserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_num_draft_tokens
        )
        yield counter(
            "kvserve:spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target model.",
            stats.spec_num_accepted_tokens,
        )
        yield counter(
            "kvserve:spec_decode_num_emitted_tokens",
            "Tokens emitted by verification steps (accepted drafts plus one per step).",
            stats.spec_num_accepted_tokens + stats.spec_num_drafts,
        )
        per_pos = CounterMetricFamily(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by draft position (0-based).",
            labels=labels + ["position"],
        )
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric(values + [str(pos)], float(count))
        yield per_pos
        yield gauge(
            "kvserve:spec_decode_draft_acceptance_rate",
            "Accepted / proposed draft tokens, 0..1.",
            stats.spec_acceptance_rate,
        )
        yield gauge(
            "kvserve:spec_decode_mean_accepted_length",
            "Tokens emitted per verification step (1 + accepted drafts).",
            stats.spec_mean_accepted_length,
        )
        yield counter(
            "kvserve:spec_decode_num_draft_opportunities",
            "Decode sequence-steps that had lookahead slots (could have been given drafts).",
            stats.spec_num_draft_opportunities,
        )
        yield gauge(
            "kvserve:spec_decode_mean_draft_length",
            "Draft tokens per decode sequence-step with lookahead slots (the chosen draft length).",
            stats.spec_mean_draft_length,
        )
        skipped = CounterMetricFamily(
            "kvserve:spec_decode_num_skipped_draft_opportunities",
            "Decode sequence-steps with lookahead slots that verified no drafts, by reason (goodput: the "
            "dynamic policy expected no gain; measuring_plain_step; row_cap; max_tokens; no_proposal).",
            labels=labels + ["reason"],
        )
        for reason, count in sorted(stats.spec_skipped_by_reason.items()):
            skipped.add_metric(values + [str(reason)], float(count))
        yield skipped


def _renamed(family: Metric, name: str) -> Metric:
    """A copy of ``family`` named ``name`` (sample names follow: ``_total``, ``_bucket``...)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        copy.samples.append(sample._replace(name=name + sample.name[len(family.name) :]))
    return copy


class AliasingCollector:
    """Every family of ``source`` (a registry of ``kvserve:`` metrics), followed by its vLLM
    aliases (``VLLM_ALIASES``): one definition, two names, values read once per scrape."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterable[Metric]:
        """Prometheus collector protocol."""
        aliases = []
        for family in self.source.collect():
            yield family
            base = family.name[len(PREFIX) :] if family.name.startswith(PREFIX) else None
            for alias in VLLM_ALIASES.get(base or "", ()):
                aliases.append(_renamed(family, alias))
        yield from aliases


class ServerMetrics:
    """The server's Prometheus registry, bound to one ``LLMEngine``.

    Args:
        engine: the ``LLMEngine`` (its ``stats.listeners`` gets a hook; call ``close()`` to
            remove it).
        model_name: the ``model_name`` label.
        num_lora_adapters: how many LoRA adapters the server serves (default: the engine's
            ``list_loras()``); read at scrape time when LoRA is enabled.
    """

    def __init__(self, engine, model_name: str, num_lora_adapters: Callable[[], int] | None = None):
        self.engine = engine
        self.model_name = model_name
        # ``source`` holds the definitions; ``registry`` (what is rendered) adds the aliases.
        self.source = CollectorRegistry(auto_describe=False)
        self.source.register(EngineCollector(engine, model_name, num_lora_adapters))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AliasingCollector(self.source))
        lbl = ["model_name"]
        r = self.source
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds",
            "Time to first token.",
            lbl,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvserve:time_per_output_token_seconds",
            "Time per output token after the first.",
            lbl,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds",
            "Arrival to finish.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "kvserve:request_queue_time_seconds",
            "Arrival to first scheduled.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "kvserve:request_prompt_tokens",
            "Prompt tokens per request.",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Histogram(
            "kvserve:request_generation_tokens",
            "Generated tokens per request (all samples).",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.http_responses = Counter(
            "kvserve:http_responses",
            "HTTP responses by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        for h in (self.ttft, self.tpot, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens):
            h.labels(model_name)  # export zero-valued series before the first request
        engine.stats.listeners.append(self.on_request_finished)

    def on_request_finished(self, group, out) -> None:
        """``EngineStats`` listener: observe the latencies of a finished request."""
        try:
            m = group.metrics
            name = self.model_name
            if m.ttft is not None:
                self.ttft.labels(name).observe(max(0.0, m.ttft))
            if m.queue_time is not None:
                self.queue.labels(name).observe(max(0.0, m.queue_time))
            if m.e2e_latency is not None:
                self.e2e.labels(name).observe(max(0.0, m.e2e_latency))
            n_out = max((len(o.token_ids) for o in out.outputs), default=0)
            tpot = m.tpot(n_out)
            if tpot is not None:
                self.tpot.labels(name).observe(max(0.0, tpot))
            self.prompt_tokens.labels(name).observe(len(out.prompt_token_ids or []))
            self.generation_tokens.labels(name).observe(sum(len(o.token_ids) for o in out.outputs))
        except Exception:  # never let metrics break the engine loop
            logger.exception("metrics listener failed")

    def count_response(self, endpoint: str, status: int) -> None:
        """Count one HTTP response."""
        self.http_responses.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

    def close(self) -> None:
        """Detach from the engine."""
        try:
            self.engine.stats.listeners.remove(self.on_request_finished)
        except ValueError:
            pass
