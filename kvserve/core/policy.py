"""Queue-ordering policies for the scheduler.

A policy ranks sequence groups: ``get_priority(now, group)`` returns a comparable key where a
*larger* key is served first, and ``sort_by_priority`` orders a queue from highest to lowest.
The scheduler keeps its ``waiting``/``running``/``swapped`` deques in policy order, admits from
the head and preempts from the tail (the lowest-ranked group).

Policies:
- ``fcfs``: first come, first served (key: time waited since arrival, in seconds).
- ``priority``: lower ``SequenceGroup.priority`` value first, ties by arrival (key:
  ``(-priority, time waited)``).
- ``fair``: the virtual token counter (VTC) of Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024: tenants (``SequenceGroup.tenant``) get turns by the weighted
  tokens they have been served (``FairPolicy``).

A policy that keeps per-request state is told what the scheduler does through the hooks
``on_add`` / ``on_served`` / ``on_finish`` (no-ops unless ``tracks_service``), and may order
admissions apart from the other queues (``admission_order``).

New policies register with ``PolicyFactory.register(name, cls)``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from kvserve.config import SchedulerConfig, check_non_negative
from kvserve.sequence import SequenceGroup

PriorityKey = float | tuple[float, ...]


class Policy:
    """Base class. Subclasses implement ``get_priority``."""

    #: True when the policy ranks by something other than arrival order; the scheduler then
    #: lets a waiting group that strictly outranks running ones preempt them.
    preempts_by_rank: bool = False
    #: True when the policy wants the service hooks (``on_add`` / ``on_served`` /
    #: ``on_finish``); the scheduler skips the calls otherwise.
    tracks_service: bool = False

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Policy:
        """The policy with ``config``'s settings (none for most policies).

        Raises:
            ValueError: a ``fair``-only setting (``tenant_weights``, ``fair_input_weight``,
                ``fair_output_weight``, ``fair_burst_tokens``) differs from its default: this policy would ignore it.
        """
        unread = [
            name
            for name, value, default in (
                ("tenant_weights", config.tenant_weights, {}),
                ("fair_input_weight", config.fair_input_weight, SchedulerConfig.fair_input_weight),
                ("fair_output_weight", config.fair_output_weight, SchedulerConfig.fair_output_weight),
                ("fair_burst_tokens", config.fair_burst_tokens, SchedulerConfig.fair_burst_tokens),
            )
            if value != default
        ]
        if unread:
            raise ValueError(
                f"{', '.join(unread)} only {'applies' if len(unread) == 1 else 'apply'} to the 'fair' "
                f"scheduling policy, not {config.policy!r}."
            )
        return cls()

    def get_priority(self, now: float, seq_group: SequenceGroup) -> PriorityKey:
        """A comparable key; larger is served first."""
        raise NotImplementedError

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        """A new deque from highest to lowest priority (stable for equal keys)."""
        return deque(sorted(seq_groups, key=lambda g: self.get_priority(now, g), reverse=True))

    def outranks(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        """True when ``a`` must be served strictly before ``b`` by rank (used for
        priority preemption; arrival-order ties never preempt)."""
        return False

    def admits_past(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        """True when waiting group ``a`` may be admitted while swapped group ``b`` waits to
        come back (rank policies; others admit nothing while anything is swapped). Default:
        ``outranks``."""
        return self.outranks(now, a, b)

    def begin_step(self, running: Iterable[SequenceGroup]) -> None:
        """Called at the start of every step with the groups in ``running`` (a policy that
        ranks by who holds the batch reads them here); a no-op by default."""

    def on_running_change(self, seq_group: SequenceGroup, num_seqs: int) -> None:
        """A rank preemption moved ``num_seqs`` sequences of ``seq_group`` into (> 0) or out
        of (< 0) the batch within the step; a no-op by default."""

    def admission_order(self, now: float, waiting: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        """The order in which the scheduler tries to admit ``waiting`` groups in one step
        (``sort_by_priority`` unless a policy accounts for what each admission costs)."""
        return self.sort_by_priority(now, waiting)

    def on_add(self, seq_group: SequenceGroup) -> None:
        """A group joined the scheduler (it is unfinished until ``on_finish``)."""

    def on_served(self, seq_group: SequenceGroup, input_tokens: int, output_tokens: int) -> None:
        """A step computed ``input_tokens`` prompt (prefill) tokens and ``output_tokens``
        decode tokens of the group, summed over its live sequences."""

    def on_finish(self, seq_group: SequenceGroup) -> None:
        """A group left the scheduler (finished, aborted or ignored). Unknown groups are a
        no-op."""


class FCFS(Policy):
    """First come, first served: the longest-waiting group first."""

    def get_priority(self, now: float, seq_group: SequenceGroup) -> float:
        return now - seq_group.metrics.arrival_time

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        # Same order as sorting by ``now - arrival`` descending, without the lambda per item.
        return deque(sorted(seq_groups, key=_arrival))


def _arrival(g: SequenceGroup) -> float:
    return g.metrics.arrival_time


def _prio_arrival(g: SequenceGroup) -> tuple[int, float]:
    return (g.priority, g.metrics.arrival_time)


class PriorityPolicy(Policy):
    """Lower ``priority`` value first; equal priorities in arrival order."""

    preempts_by_rank = True

    def get_priority(self, now: float, seq_group: SequenceGroup) -> tuple[float, float]:
        return (-seq_group.priority, now - seq_group.metrics.arrival_time)

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        return deque(sorted(seq_groups, key=_prio_arrival))

    def outranks(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        return a.priority < b.priority


#: Idle tenants whose counters are kept beyond the exact pruning rule (``FairPolicy``).
MAX_IDLE_TENANTS = 4096
#: Aging under ``fair``: a waiting group that this many later groups have arrived after is
#: admitted ahead of the counter order (oldest first), so no stream of newcomers starves it.
FAIR_AGING_ARRIVALS = 256


class FairPolicy(Policy):
    """Virtual token counter (VTC; Sheng et al., "Fairness in Serving Large Language Models",
    OSDI 2024, Algorithm 2), per tenant (``SequenceGroup.tenant``; None is one shared tenant).

    Counters: each tenant ``t`` has a counter (weighted tokens, float) that grows by
    ``(input_tokens * input_weight + output_tokens * output_weight) / weight(t)`` for every
    token computed for it (``on_served``: prefill tokens are input, decode tokens output);
    ``weight(t)`` is ``tenant_weights.get(t, 1.0)``.

    Backlog: a tenant is backlogged while it has an unfinished group in the scheduler
    (waiting, running or swapped). A tenant that becomes backlogged is lifted to
    ``max(its counter, floor - credit)``. ``floor`` is the least counter among backlogged
    tenants, ratcheted (it never decreases; with none backlogged it is the last value).
    ``credit`` is ``burst_tokens`` (counter units, the same for every weight: a tenant of weight
    ``w`` may so be served ``w * burst_tokens`` weighted tokens ahead, in proportion to its
    share, and a heavier tenant never joins behind a lighter one) when another tenant was
    backlogged at the start of the last step and still is (it joins a busy engine), else 0 (tenants that arrive together
    start level, and so does one arriving at an engine that went idle).
    With ``burst_tokens = 0`` this is VTC's lift exactly: idle time earns nothing, and a tenant
    returning to a flood only levels with it, then shares every step's budget with it, so its
    first burst of requests takes about twice as long as alone. The credit lets that first
    burst (up to ``burst_tokens`` weighted tokens per unit of weight) run ahead of the flood, and no further:
    idling longer earns no more, and the ratchet keeps one newcomer's credit from lowering the
    mark the next one is lifted against (Linux's CFS scheduler places a waking task at its
    ``min_vruntime`` less a bounded credit the same way). An idle tenant whose counter is at or
    below ``floor - burst_tokens`` would be lifted to at least that: its entry is
    dropped, exactly (the floor only grows). Idle tenants above keep theirs; past
    ``MAX_IDLE_TENANTS`` of them the lowest are dropped (those closest to the floor: the only
    approximation, bounding memory).

    Orders:
    - ``admission_order`` (waiting): repeatedly the head of the backlogged tenant with the
      least *projected* counter: its counter plus the input cost of the groups already
      ordered ahead of it (uncomputed tokens x ``input_weight`` / weight), so the admissions
      of one step interleave tenants. Ties go to the tenant holding fewer running sequences
      per unit of weight, then to the earlier head arrival. Within a tenant:
      lower ``priority`` first, then arrival.
      Aging (ours): groups after which ``FAIR_AGING_ARRIVALS`` or more groups have arrived go
      first, oldest first, in every order (``sort_by_priority`` and ``admits_past`` too, so an
      aged group swapped out comes back first), and no rank preemption takes one. Counters alone starve a tenant under churn: each new tenant (a new
      ``user`` a request) is lifted to the least counter, below a tenant already served, and
      while the stream lasts it is always ahead. With aging, at most the groups that arrived
      before a group plus ``FAIR_AGING_ARRIVALS`` later ones are admitted ahead of it (besides
      what backfill admits past it while it waits for blocks, and swapped groups resuming).
    - ``sort_by_priority`` (running, swapped): by tenant counter ascending, so the most-served
      tenant's groups are last (the scheduler preempts from the tail); within a tenant as above.

    Preemption by share (ours; VTC itself only orders admissions): a tenant that returns from
    idle is lifted to the least counter, level with a flooding tenant, so without preemption
    its first request still waits for the flood's running requests to finish. So ``outranks``
    lets a waiting group of tenant ``a`` preempt a running group of tenant ``b`` when ``a``
    still holds no more than its share of the running sequences with the group admitted
    (share: ``weight(a) / sum of backlogged tenants' weights`` of the sequences running at the
    start of the step, ``begin_step``), ``b`` still holds at least its own without the victim,
    and ``a``'s counter is not above ``b``'s. Counts follow the step's rank preemptions
    (``on_running_change``), so one step moves at most a tenant's share, and since neither
    side crosses its share, two tenants never preempt each other back and forth. Within a
    tenant, a lower ``priority`` value outranks (as under ``priority``). A victim the scheduler
    swapped out holds back only the waiting groups ranked after it (``admits_past``).

    Args:
        input_weight: cost of one prefill token (> 0).
        output_weight: cost of one decode token (> 0); the paper's default ratio is 1:2.
        tenant_weights: tenant -> share weight (> 0); a tenant of weight 2 gets about twice the
            weighted tokens of a tenant of weight 1 while both are backlogged.
        burst_tokens: weighted tokens per unit of weight (>= 0) a tenant joining a busy engine
            may be served ahead of the least-served backlogged tenant (0: VTC's lift exactly).

    Raises:
        ValueError: a weight that is not a finite number > 0 or ``burst_tokens`` that is not
            a finite number >= 0, naming it.
    """

    tracks_service = True
    preempts_by_rank = True

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict[str, float] | None = None,
        burst_tokens: float = 0.0,
    ) -> None:
        _check_weight("fair_input_weight", input_weight)
        _check_weight("fair_output_weight", output_weight)
        for name, w in (tenant_weights or {}).items():
            _check_weight(f"tenant_weights[{name!r}]", w)
        check_non_negative("fair_burst_tokens", burst_tokens)
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.tenant_weights = dict(tenant_weights or {})
        self.burst_tokens = float(burst_tokens)
        self.counters: dict[str | None, float] = {}  # backlogged tenants + idle ones above their lift
        self._backlog: dict[str | None, int] = {}  # tenant -> unfinished groups
        self._members: dict[str, str | None] = {}  # request_id -> tenant
        self._arrival_no: dict[str, int] = {}  # request_id -> arrivals before it (aging)
        self._arrivals = 0
        self._floor = 0.0  # the ratchet: the most the least backlogged counter has been
        self._busy_at_step: frozenset[str | None] = frozenset()  # backlogged when the last step began
        self._sweep_at = 64  # idle entries that trigger a sweep
        # the step's snapshot (``begin_step``): running sequences per tenant, and in all
        self._running: dict[str | None, int] = {}
        self._num_running = 0
        self._weight_sum = 1.0  # of the backlogged tenants

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> FairPolicy:
        return cls(
            config.fair_input_weight,
            config.fair_output_weight,
            config.tenant_weights,
            config.fair_burst_tokens,
        )

    # ---------------------------------------------------------------- counters
    def floor(self) -> float:
        """The least counter among backlogged tenants, ratcheted: the most it has been (it only
        dips when a tenant joins with burst credit, and the ratchet ignores that dip)."""
        if self._backlog:
            self._floor = max(self._floor, min(self.counters[t] for t in self._backlog))
        return self._floor

    def _lift(self, tenant: str | None, floor: float) -> float:
        """The least counter ``tenant`` joins the backlog at now: ``floor`` less its burst
        credit when another tenant was backlogged at the start of the last step and still is.
        (An engine that went idle runs no step, so the last step's set alone would hand the
        next tenant to arrive a credit against tenants long gone.)"""
        if any(t != tenant and t in self._backlog for t in self._busy_at_step):
            return self._least_lift(tenant, floor)
        return floor

    def _least_lift(self, tenant: str | None, floor: float) -> float:
        """The least counter ``tenant`` could join at from now on (the floor only grows)."""
        return floor - self.burst_tokens

    def counter(self, tenant: str | None) -> float:
        """The tenant's counter (as it would be if it became backlogged now, when it is not)."""
        return self._key(tenant, self.floor())

    def _key(self, tenant: str | None, floor: float) -> float:
        """``counter(tenant)`` with ``floor`` computed once by the caller."""
        c = self.counters.get(tenant)
        if tenant in self._backlog:
            return c  # type: ignore[return-value]
        lift = self._lift(tenant, floor)
        return lift if c is None else max(c, lift)

    def _weight(self, tenant: str | None) -> float:
        return self.tenant_weights.get(tenant, 1.0) if tenant is not None else 1.0

    def on_add(self, seq_group: SequenceGroup) -> None:
        rid = seq_group.request_id
        if rid in self._members:
            return
        t = seq_group.tenant
        if t not in self._backlog:
            self.counters[t] = self.counter(t)  # the lift: VTC's, less the burst credit
            self._backlog[t] = 0
        self._backlog[t] += 1
        self._members[rid] = t
        self._arrival_no[rid] = self._arrivals
        self._arrivals += 1

    def on_served(self, seq_group: SequenceGroup, input_tokens: int, output_tokens: int) -> None:
        t = self._members.get(seq_group.request_id, seq_group.tenant)
        if t not in self._backlog:
            return  # not added through on_add: nothing to account to
        cost = input_tokens * self.input_weight + output_tokens * self.output_weight
        self.counters[t] += cost / self._weight(t)

    def on_finish(self, seq_group: SequenceGroup) -> None:
        rid = seq_group.request_id
        if rid not in self._members:
            return
        t = self._members.pop(rid)
        del self._arrival_no[rid]
        self._backlog[t] -= 1
        if self._backlog[t]:
            return
        del self._backlog[t]
        if not self._backlog:
            self._floor = max(self._floor, self.counters[t])
        floor = self.floor()
        if self.counters[t] <= self._least_lift(t, floor):
            del self.counters[t]  # lifted to at least that when it returns: the floor only grows
        if len(self.counters) - len(self._backlog) > self._sweep_at:
            self._sweep(floor)

    def _sweep(self, floor: float) -> None:
        """Drop idle entries at or below their lift (exact), then the lowest beyond the cap."""
        idle = [
            (c, t)
            for t, c in self.counters.items()
            if t not in self._backlog and c > self._least_lift(t, floor)
        ]
        for t in [t for t in self.counters if t not in self._backlog]:
            del self.counters[t]
        if len(idle) > MAX_IDLE_TENANTS:
            idle = heapq.nlargest(MAX_IDLE_TENANTS, idle, key=lambda ct: ct[0])
        for c, t in idle:
            self.counters[t] = c
        self._sweep_at = max(64, 2 * len(idle))

    # ---------------------------------------------------------------- preemption
    def begin_step(self, running: Iterable[SequenceGroup]) -> None:
        counts: dict[str | None, int] = {}
        for g in running:
            counts[g.tenant] = counts.get(g.tenant, 0) + g.num_unfinished_seqs()
        self._running = counts
        self._num_running = sum(counts.values())
        self._busy_at_step = frozenset(self._backlog)
        self._weight_sum = sum(self._weight(t) for t in self._backlog) or 1.0

    def _held(self, tenant: str | None) -> float:
        """Running sequences per unit of weight at the start of the step (ties of counters
        go to the tenant holding less of the batch: a tenant lifted level with a flood)."""
        return self._running.get(tenant, 0) / self._weight(tenant)

    def on_running_change(self, seq_group: SequenceGroup, num_seqs: int) -> None:
        t = seq_group.tenant
        self._running[t] = self._running.get(t, 0) + num_seqs

    def outranks(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        if self._aged_no(b) is not None:
            return False  # an aged group is preempted by rank for nobody (aging's bound)
        ta, tb = a.tenant, b.tenant
        if ta == tb:
            return a.priority < b.priority
        unit = self._num_running / self._weight_sum  # running sequences per unit of weight
        # both sides of the move stay on their side of their share: no back and forth
        return (
            self._running.get(ta, 0) + a.get_max_num_running_seqs() <= unit * self._weight(ta)
            and self._running.get(tb, 0) - b.get_max_num_running_seqs() >= unit * self._weight(tb)
            and self._counter_at_most(ta, tb)
        )

    def admits_past(self, now: float, a: SequenceGroup, b: SequenceGroup) -> bool:
        """A swapped group holds back only the waiting groups ranked after it: ``a``'s tenant
        is ahead of ``b``'s in the running order (counter, then running sequences per unit of
        weight), or, within one tenant, ``a`` has a lower ``priority`` value. (A victim swapped
        out for a tenant's share must not then hold back that tenant's next requests, as a
        recomputed one, queued by counter, would not.) Aged groups come first: an aged ``b``
        holds back every waiting group but older aged ones, an aged ``a`` passes any other."""
        na, nb = self._aged_no(a), self._aged_no(b)
        if nb is not None:
            return na is not None and na < nb
        if na is not None:
            return True
        ta, tb = a.tenant, b.tenant
        if ta == tb:
            return a.priority < b.priority
        floor = self.floor()
        return (self._key(ta, floor), self._held(ta)) < (self._key(tb, floor), self._held(tb))

    def _counter_at_most(self, ta: str | None, tb: str | None) -> bool:
        """``counter(ta) <= counter(tb)`` with the floor (a min over backlogged tenants)
        computed once: ``outranks`` runs per waiting x victim pair in a preemption walk."""
        floor = self.floor()
        return self._key(ta, floor) <= self._key(tb, floor)

    # ---------------------------------------------------------------- orders
    def _by_tenant(self, groups: Iterable[SequenceGroup]) -> dict[str | None, list[SequenceGroup]]:
        out: dict[str | None, list[SequenceGroup]] = {}
        for g in groups:
            out.setdefault(g.tenant, []).append(g)
        for q in out.values():
            q.sort(key=_prio_arrival)
        return out

    def get_priority(self, now: float, seq_group: SequenceGroup) -> tuple[float, float, float]:
        return (
            -self.counter(seq_group.tenant),
            -seq_group.priority,
            now - seq_group.metrics.arrival_time,
        )

    def _aged_no(self, g: SequenceGroup) -> int | None:
        """``g``'s arrival number when ``FAIR_AGING_ARRIVALS`` or more groups arrived after it
        (it goes before the counter order), else None."""
        no = self._arrival_no.get(g.request_id)
        return no if no is not None and no < self._arrivals - FAIR_AGING_ARRIVALS else None

    def _split_aged(self, groups: Iterable[SequenceGroup]) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """(aged groups, oldest first; the others in their order)."""
        aged: list[tuple[int, SequenceGroup]] = []
        rest: list[SequenceGroup] = []
        for g in groups:
            no = self._aged_no(g)
            if no is None:
                rest.append(g)
            else:
                aged.append((no, g))
        aged.sort(key=lambda ng: ng[0])
        return [g for _, g in aged], rest

    def sort_by_priority(self, now: float, seq_groups: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        aged, rest = self._split_aged(seq_groups)
        by_tenant = self._by_tenant(rest)
        floor = self.floor()
        order = sorted(
            by_tenant,
            key=lambda t: (
                self._key(t, floor),
                self._held(t),
                by_tenant[t][0].metrics.arrival_time,
            ),
        )
        return deque([*aged, *(g for t in order for g in by_tenant[t])])

    def admission_order(self, now: float, waiting: Iterable[SequenceGroup]) -> deque[SequenceGroup]:
        aged, rest = self._split_aged(waiting)
        out = deque(aged)
        out.extend(self._counter_order(rest))
        return out

    def _counter_order(self, waiting: list[SequenceGroup]) -> deque[SequenceGroup]:
        """VTC's admission order: the head of the tenant with the least projected counter."""
        by_tenant = self._by_tenant(waiting)
        floor = self.floor()
        heap = []
        for i, (t, q) in enumerate(by_tenant.items()):
            c = self._key(t, floor)
            heap.append((c, self._held(t), q[0].metrics.arrival_time, i, t, 0))
        heapq.heapify(heap)
        out: deque[SequenceGroup] = deque()
        while heap:
            c, held, _, i, t, k = heapq.heappop(heap)
            q = by_tenant[t]
            g = q[k]
            out.append(g)
            if k + 1 < len(q):
                cost = max(1, g.get_num_uncomputed_tokens()) * self.input_weight / self._weight(t)
                heapq.heappush(heap, (c + cost, held, q[k + 1].metrics.arrival_time, i, t, k + 1))
        return out


def _check_weight(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


class PolicyFactory:
    """Registry of policies by name."""

    _POLICY_REGISTRY: dict[str, type[Policy]] = {
        "fcfs": FCFS,
        "priority": PriorityPolicy,
        "fair": FairPolicy,
    }

    @classmethod
    def names(cls) -> list[str]:
        """The registered policy names, sorted."""
        return sorted(cls._POLICY_REGISTRY)

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Policy:
        """The policy ``config.policy`` names, with ``config``'s settings. Raises ValueError
        naming the known policies."""
        return cls._lookup(config.policy).from_config(config)

    @classmethod
    def _lookup(cls, policy_name: str) -> type[Policy]:
        try:
            return cls._POLICY_REGISTRY[policy_name]
        except KeyError:
            raise ValueError(
                f"policy must be one of {sorted(cls._POLICY_REGISTRY)}, got {policy_name!r}."
            ) from None

    @classmethod
    def get_policy(cls, policy_name: str, **kwargs) -> Policy:
        """Instantiate a policy. Raises ValueError naming the known policies."""
        return cls._lookup(policy_name)(**kwargs)

    @classmethod
    def register(cls, name: str, policy_cls: type[Policy]) -> None:
        cls._POLICY_REGISTRY[name] = policy_cls
