"""Engine-level counters, latency samples and a queue timeline (for /metrics and plots)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


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
        for listener in self.listeners:
            listener(group, out)

    def record_queues(self, now: float, scheduler) -> None:
        usage = scheduler.get_kv_cache_stats().get("gpu_cache_usage", 0.0)
        self.timeline.append(
            (now, len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped), usage)
        )
