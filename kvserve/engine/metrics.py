"""Engine-level counters, latency samples and a queue timeline (for /metrics and plots)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

#: Tenants exported by name in /metrics (label ``tenant``); the others are summed under
#: ``OTHER_TENANT``. The named ones are the ``TENANT_SERIES`` with the most served tokens when
#: the set fills (at a scrape), and stay named from then on, so every series only grows.
TENANT_SERIES = 16
#: Tenants with their own totals in memory; past it the least-served unnamed one is folded into
#: ``OTHER_TENANT``.
MAX_TRACKED_TENANTS = 1024
#: The ``tenant`` label of everything not exported by name.
OTHER_TENANT = "other"
#: The ``tenant`` label of requests without one (``SequenceGroup.tenant`` None).
DEFAULT_TENANT = "default"


@dataclass
class TenantTotals:
    """One tenant's finished requests: ``served_tokens`` (prompt + generated tokens), request
    count, and the sums of queue time and time to first token (seconds) with their counts."""

    requests: int = 0
    served_tokens: int = 0
    queue_s_sum: float = 0.0
    queue_count: int = 0
    ttft_s_sum: float = 0.0
    ttft_count: int = 0

    def add(self, other: TenantTotals) -> None:
        self.requests += other.requests
        self.served_tokens += other.served_tokens
        self.queue_s_sum += other.queue_s_sum
        self.queue_count += other.queue_count
        self.ttft_s_sum += other.ttft_s_sum
        self.ttft_count += other.ttft_count


class TenantStats:
    """Per-tenant totals with bounded cardinality (``TENANT_SERIES`` named + ``other``), for
    /metrics. Memory: at most ``MAX_TRACKED_TENANTS`` entries."""

    def __init__(self, series: int = TENANT_SERIES, max_tracked: int = MAX_TRACKED_TENANTS) -> None:
        if series < 1 or max_tracked <= series:
            raise ValueError(
                f"need 1 <= series < max_tracked, got series={series}, max_tracked={max_tracked}."
            )
        self.series = series
        self.max_tracked = max_tracked
        self.totals: dict[str, TenantTotals] = {}
        self.named: set[str] = set()  # exported by name (sticky)
        self.folded = TenantTotals()  # tenants dropped from ``totals``: always ``other``

    def on_finished(
        self, tenant: str | None, served_tokens: int, queue_s: float | None, ttft_s: float | None
    ) -> None:
        """Add one finished request of ``tenant`` (None: ``DEFAULT_TENANT``)."""
        name = DEFAULT_TENANT if tenant is None else tenant
        t = self.totals.get(name)
        if t is None:
            if len(self.totals) >= self.max_tracked:
                self._fold_one()
            t = self.totals[name] = TenantTotals()
        t.requests += 1
        t.served_tokens += served_tokens
        if queue_s is not None:
            t.queue_s_sum += max(0.0, queue_s)
            t.queue_count += 1
        if ttft_s is not None:
            t.ttft_s_sum += max(0.0, ttft_s)
            t.ttft_count += 1

    def _fold_one(self) -> None:
        unnamed = [n for n in self.totals if n not in self.named]
        victim = min(unnamed, key=lambda n: self.totals[n].served_tokens)
        self.folded.add(self.totals.pop(victim))

    def snapshot(self) -> dict[str, TenantTotals]:
        """label -> totals: the named tenants (filled up to ``series`` with the most-served
        unnamed ones first) and ``OTHER_TENANT`` (present once anything is not named)."""
        totals = list(self.totals.items())  # one read: the engine thread may add meanwhile
        room = self.series - len(self.named)
        if room > 0:
            unnamed = sorted(
                (kv for kv in totals if kv[0] not in self.named), key=lambda kv: (-kv[1].served_tokens, kv[0])
            )
            self.named.update(n for n, _ in unnamed[:room])
        out = {n: t for n, t in sorted(totals) if n in self.named}
        other = TenantTotals()
        other.add(self.folded)
        for n, t in totals:
            if n not in self.named:
                other.add(t)
        if other.requests:
            out[OTHER_TENANT] = other
        return out


@dataclass
class EngineStats:
    """Cumulative counters plus bounded recent samples.

    Latencies are in seconds of the engine's clock. ``timeline`` holds
    ``(time, running, waiting, swapped, gpu_cache_usage)`` per step (last 100k steps).
    Listeners (the Prometheus exporter) may be attached to receive each finished request.
    """

    num_requests_added: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    #: Tokens fed through the model (prefill chunks and decodes; what the scheduler batched).
    num_batched_tokens: int = 0
    model_time_s: float = 0.0
    finished_by_reason: Counter = field(default_factory=Counter)
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    tpot_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    queue_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    timeline: deque[tuple[float, int, int, int, float]] = field(default_factory=lambda: deque(maxlen=100_000))
    listeners: list = field(default_factory=list)
    # Speculative decoding: verified sequence-steps ("drafts"), drafted and accepted tokens,
    # and per draft position how often it was accepted (position i counts when drafts 0..i
    # all were).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # Decode sequence-steps that had lookahead slots (could have been given drafts): with the
    # dynamic draft-length policy, drafted tokens / this is its mean chosen draft length.
    spec_num_draft_opportunities: int = 0
    # Of those, the ones that verified no drafts, by reason (SpecDecodeWorker._skip_reason).
    spec_skipped_by_reason: Counter = field(default_factory=Counter)
    #: Per-tenant totals of finished requests (/metrics, label ``tenant``).
    tenants: TenantStats = field(default_factory=TenantStats)

    def on_request_added(self, prompt_len: int) -> None:
        self.num_requests_added += 1
        self.num_prompt_tokens += prompt_len

    def on_step(self, model_seconds: float) -> None:
        self.num_steps += 1
        self.model_time_s += model_seconds

    def on_tokens(self, n: int) -> None:
        self.num_generation_tokens += n

    def on_speculation(self, num_draft: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_draft`` drafts, the first ``num_accepted`` kept."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft
        self.spec_num_accepted_tokens += num_accepted
        if len(self.spec_accepted_per_pos) < num_draft:
            self.spec_accepted_per_pos.extend([0] * (num_draft - len(self.spec_accepted_per_pos)))
        for i in range(num_accepted):
            self.spec_accepted_per_pos[i] += 1

    def on_draft_opportunities(self, n: int) -> None:
        """``n`` decode sequences of a step had lookahead slots."""
        self.spec_num_draft_opportunities += n

    def on_draft_skips(self, by_reason: dict[str, int]) -> None:
        """Decode sequences of a step that had lookahead slots but verified no drafts: reason -> count."""
        self.spec_skipped_by_reason.update(by_reason)

    @property
    def spec_mean_draft_length(self) -> float:
        """Drafted tokens per decode sequence-step with lookahead slots (0.0 before any): the
        mean draft length the proposer / dynamic policy chose, 0..num_speculative_tokens."""
        return (
            self.spec_num_draft_tokens / self.spec_num_draft_opportunities
            if self.spec_num_draft_opportunities
            else 0.0
        )

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft)."""
        return (
            self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
        )

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted / verifications (0.0 before any)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def on_request_finished(self, group, out) -> None:
        m = group.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.finished_by_reason[reason or "unknown"] += 1
        if m.ttft is not None:
            self.ttft_s.append(m.ttft)
        if m.queue_time is not None:
            self.queue_s.append(m.queue_time)
        if m.e2e_latency is not None:
            self.e2e_s.append(m.e2e_latency)
        n_out = max((len(o.token_ids) for o in out.outputs), default=0)
        tpot = m.tpot(n_out)
        if tpot is not None:
            self.tpot_s.append(tpot)
        served = len(out.prompt_token_ids or []) + sum(len(o.token_ids) for o in out.outputs)
        self.tenants.on_finished(getattr(group, "tenant", None), served, m.queue_time, m.ttft)
        for listener in self.listeners:
            listener(group, out)

    def record_queues(self, now: float, scheduler) -> None:
        usage = scheduler.get_kv_cache_stats().get("gpu_cache_usage", 0.0)
        self.timeline.append(
            (now, len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped), usage)
        )
