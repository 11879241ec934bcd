"""The iteration-level scheduler (continuous batching), in the design of vLLM's V0 scheduler.

Every ``schedule()`` call decides one engine step: which sequence groups run, how many tokens
each feeds (a whole prompt, a prefill *chunk*, or one decode token per live sequence), and which
KV blocks move (swap out GPU->CPU, swap in CPU->GPU, copy-on-write copies). Groups live in
exactly one of three deques, each kept in the active policy's order:

- ``waiting``: new requests and recompute-preempted groups (need a prefill);
- ``running``: groups holding GPU blocks (decoding, or mid chunked prefill);
- ``swapped``: groups whose blocks were swapped out to CPU.

Two paths (``_schedule_default`` / ``_schedule_chunked_prefill``), chosen by
``SchedulerConfig.chunked_prefill_enabled``:

* default (vLLM V0 / Orca-style): if nothing is swapped, admit whole prompts from ``waiting``;
  only if no prompt was admitted, run one decode step of ``running`` (preempting the
  lowest-ranked group when a slot cannot be appended) and then swap groups back in.
* chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24): one token budget per step shared
  by, in this order, running decodes, running groups still prefilling, swapped groups, and new
  prompts; prompts are cut into chunks that fill what the budget leaves, so decodes are never
  stalled by a long prompt. While anything is swapped out no new request is admitted.

Preemption (Kwon et al., PagedAttention, SOSP'23 §4.5): RECOMPUTE frees the group's blocks and
puts it at the front of ``waiting`` (its tokens are prefilled again: prompt + outputs, outputs
stay outputs); SWAP moves its blocks to CPU. With ``preemption_mode=None`` single-sequence groups
are recomputed and multi-sequence groups swapped; a swap that does not fit in free CPU blocks
falls back to recompute (each live sequence re-prefilled from its own tokens; finished siblings
are left alone).

Cost-aware preemption (ours, ``preemption_mode=AUTO``): each victim is preempted the cheaper
way as priced by the injected ``preemption_cost`` (``kvserve.core.preemption``; the simulator
injects its calibrated cost model): recompute costs ``recompute_s(tokens, live seqs)``, where
``tokens`` are the live sequences' computed tokens less, with prefix caching, the blocks other
groups also hold (those stay cached: a cheap lower bound of what the cache serves back); swap
costs ``swap_s(distinct device blocks)`` (out and back in) and is out when free CPU blocks are
short. Ties recompute. Victim choice: a decode that needs a block looks at the last
``AUTO_VICTIM_WINDOW`` preemptable running groups from the tail, stopping at the first that
outranks the tail group (so: equal rank under a rank policy; any under fcfs), and preempts the
one whose cheaper way costs least per device block it frees -- but a group other than the tail
only when that is at most ``1 / AUTO_VICTIM_MARGIN`` of the tail's (the price is an estimate;
a small difference keeps the policy's order); the decoding group itself is taken only when no
other is left. Priority preemption and slot turnover keep their own victims (the mode of a
priority preemption's is priced the same way). Under RECOMPUTE / SWAP / unset the victim is
always the tail (V0).

Anti-thrash rule (ours): a group that has already been preempted ``THRASH_PREEMPTIONS`` times is
re-admitted (from ``waiting``) only when, after its allocation and the watermark, at least
``margin = live_seqs * min(num_preemptions, MAX_MARGIN_FACTOR)`` blocks stay free -- room for it
to grow that many blocks per sequence before it could be preempted again. The margin is capped
so that an otherwise idle cache can always meet it, and it is not applied when nothing else is
running (nobody could free blocks anyway). Groups preempted in a step are never re-admitted in
that same step.

Priority preemption (policies that ``preempts_by_rank``: ``priority``, and ``fair`` by its
tenants' shares, see ``FairPolicy``; the walk below with ``outranks``): before admitting, a waiting group whose
``priority`` value is strictly lower than that of running groups preempts the lowest-ranked of
them when the cache or the sequence budget is full -- but only when preempting those outranked
groups actually makes it fit. Its mode is the configured one; unset, it is priced as under
``AUTO`` (``_rank_preemption_mode``): such a preemption is a choice, and a swapped victim comes
back with a copy where a recomputed one is prefilled again. A group that strictly outranks every
swapped group may be admitted even while others are swapped out, and a group that preempted by
rank in a step passes the groups it swapped out (it outranked them when it did).
The blocks such a preemption frees are the preempting group's for the rest of the step: running
groups it outranks may not grow into them (a decode that would needs to preempt in turn), and
when it is passed over (the partial-prefill limit), no lower-ranked waiting group is admitted
with them -- it would only be preempted again once the higher-ranked group gets its turn.

Multi-LoRA (``lora_config``, vLLM V0's rule): a step holds at most ``max_loras`` distinct
adapters. The adapters of ``running`` count first (``_Step.curr_loras``); a waiting or swapped
group whose adapter is not among them while ``max_loras`` are already taken is *deferred*: left
where it is (the head of its queue keeps its order) while the groups behind it are still
considered, and admitted in a later step once a running adapter's last group has left. Groups
without an adapter (``lora_int_id == 0``) never count. Under a rank policy a waiting group is
never the reason for a priority preemption while its adapter would be deferred.
Starvation guard (ours): vLLM's rule alone lets a steady stream of one running adapter's
requests keep its slot forever. Once a waiting group has been deferred in
``LORA_MAX_DEFERRALS`` admission passes, the groups ranked behind it that run with an adapter
and were queued after its first deferral are deferred too (groups without one still pass), so
the running adapters drain and it gets the first free slot. Groups queued before that moment
still join an adapter the step holds: they are finitely many, so the wait stays bounded, and
holding them back would leave the slots of a burst (e.g. 16 adapters' requests arriving at
once for 4 slots) running one request each instead of all of their adapter's.
Slot turnover (ours, opt-in: ``LoRAConfig.max_slot_preemptions`` > 0): when every slot is held
and the first adapter deferred in ``waiting`` has ``need`` >= 2 groups there, the held adapter
with the fewest running groups (at most ``need // 2``, all decoding, none turned over
``max_slot_preemptions`` times yet) is preempted by recompute, so its slot serves the waiting
adapter in the same step; its groups go to the front of ``waiting`` and resume in order when a
slot frees. It moves slot time to where more groups share it (lower TTFT when adapters
stream in) but cannot shorten a burst: an adapter holds a slot for at least its longest
request's decode steps whoever runs when, so a burst takes at least the sum of those over
``max_loras`` steps, which FCFS already comes close to (``kvserve/benchmarks/lora_occupancy``).

Policies: ``waiting`` is admitted in ``policy.admission_order`` (a policy may account for each
admission before ranking the next); a policy that ``tracks_service`` (``fair``) is told when a
group joins (``add_seq_group``), what each step served (``mark_computed``: prefill tokens as
input, decode tokens as output) and when it ends (finished, aborted or ignored).

Backfill (``SchedulerConfig.backfill_enabled``; on by default only for the ``fair`` policy):
when the first group in rank order must wait for KV blocks (``AllocStatus.LATER``, or the
anti-thrash margin), the groups behind it that fit are admitted anyway, each one counted as a
*bypass* of every group it passed; a group passed ``BACKFILL_MAX_BYPASSES`` times stops the
scan again (vLLM V0's ``break``), so no group is passed more often than that. The head's
admission is protected by *reclaim*: at the start of each step, if the head would fit once the
groups admitted past it (backfilled and still running) gave their blocks and sequence slots
back, the fewest lowest-ranked of them are preempted by recompute so that it is admitted in
that step -- the same step it would have been without backfill, since the groups ranked above
the backfilled ones never lose a block to them (they are the first victims of a decode that
needs one). Without chunked prefill a step that admits prompts runs no decode, so each step that
backfills delays the running groups' completion, and with it the head, by one step: at most
``BACKFILL_MAX_BYPASSES`` steps in all. Without chunked prefill, a head that fits the cache but
not what is left of the step's token budget is passed too, with its blocks and sequence slots
kept free (it is admitted with the next step's budget). A group that must wait for sequence
slots, an adapter slot, or swapped groups still stops the scan.

Invariants (asserted by the tests after every step): a live group is in exactly one queue;
``num_batched_tokens <= max_num_batched_tokens``; scheduled sequences ``<= max_num_seqs``;
every scheduled prefill feeds >= 1 token; no token is scheduled at a position
``>= max_model_len``; KV blocks are conserved on both pools.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.config import CacheConfig, LoRAConfig, PreemptionMode, SchedulerConfig
from kvserve.core.block_manager import AllocStatus, BlockSpaceManager
from kvserve.core.policy import Policy, PolicyFactory
from kvserve.core.preemption import LinearPreemptionCost, PreemptionCost
from kvserve.core.prefill_cap import PrefillCap
from kvserve.lora_request import LoRARequest
from kvserve.sequence import (
    PreemptionRecord,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
)

logger = logging.getLogger("kvserve.scheduler")

#: Preemptions after which a group must find a free-block margin before re-admission.
THRASH_PREEMPTIONS = 2
#: Cap on the margin multiplier (blocks per live sequence).
MAX_MARGIN_FACTOR = 4
#: Admission passes a waiting group may be deferred for its adapter before the groups behind it
#: that run with an adapter are held back too (so a slot drains for it).
LORA_MAX_DEFERRALS = 16
#: ``preemption_mode=AUTO``: how many tail groups a decode's victim is chosen among.
AUTO_VICTIM_WINDOW = 4
#: ``preemption_mode=AUTO``: a group above the tail is its victim instead only when it costs at
#: most 1/this as much per freed block (the price is an estimate: small differences keep the
#: policy's order).
AUTO_VICTIM_MARGIN = 2.0
#: Backfill: how many groups may be admitted past a waiting group that must wait before the
#: scan stops at it again (its starvation bound; see the module docstring).
BACKFILL_MAX_BYPASSES = 16


def _class_heads(groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
    """The earliest-arrived group of each (tenant, priority): the rank policies' ``admits_past``
    depends on those and on age alone (``fair``'s aging: an older group passes at least what a
    younger one of its class does), so these stand for all the groups."""
    heads: dict[tuple[str | None, int], SequenceGroup] = {}
    for g in groups:
        key = (g.tenant, g.priority)
        h = heads.get(key)
        if h is None or g.metrics.arrival_time < h.metrics.arrival_time:
            heads[key] = g
    return list(heads.values())


# ====================================================================== budget
@dataclass
class SchedulingBudget:
    """Token and sequence slots left in one step.

    ``add_*`` / ``subtract_*`` are de-duplicated by request id: a group counted once (e.g. its
    sequences reserved at the start of the step) is not counted again when it is scheduled.

    Attributes:
        token_budget: max tokens fed in the step (``max_num_batched_tokens``).
        max_num_seqs: max sequences in the step.
    """

    token_budget: int
    max_num_seqs: int
    _request_ids_num_batched_tokens: set[str] = field(default_factory=set)
    _request_ids_num_curr_seqs: set[str] = field(default_factory=set)
    _num_batched_tokens: int = 0
    _num_curr_seqs: int = 0

    def can_schedule(self, *, num_new_tokens: int, num_new_seqs: int) -> bool:
        """Whether ``num_new_tokens`` more tokens and ``num_new_seqs`` more sequences fit.

        Raises:
            ValueError: either count is 0 (nothing to schedule is a caller bug).
        """
        if num_new_tokens == 0 or num_new_seqs == 0:
            raise ValueError(
                f"can_schedule needs non-zero counts, got tokens={num_new_tokens}, seqs={num_new_seqs}"
            )
        return (
            self.num_batched_tokens + num_new_tokens <= self.token_budget
            and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs
        )

    def remaining_token_budget(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def add_num_batched_tokens(self, req_id: str, num_batched_tokens: int) -> None:
        if req_id in self._request_ids_num_batched_tokens:
            return
        self._request_ids_num_batched_tokens.add(req_id)
        self._num_batched_tokens += num_batched_tokens

    def subtract_num_batched_tokens(self, req_id: str, num_batched_tokens: int) -> None:
        if req_id in self._request_ids_num_batched_tokens:
            self._request_ids_num_batched_tokens.remove(req_id)
            self._num_batched_tokens -= num_batched_tokens

    def add_num_seqs(self, req_id: str, num_curr_seqs: int) -> None:
        if req_id in self._request_ids_num_curr_seqs:
            return
        self._request_ids_num_curr_seqs.add(req_id)
        self._num_curr_seqs += num_curr_seqs

    def subtract_num_seqs(self, req_id: str, num_curr_seqs: int) -> None:
        if req_id in self._request_ids_num_curr_seqs:
            self._request_ids_num_curr_seqs.remove(req_id)
            self._num_curr_seqs -= num_curr_seqs

    @property
    def num_batched_tokens(self) -> int:
        return self._num_batched_tokens

    @property
    def num_curr_seqs(self) -> int:
        return self._num_curr_seqs


# ====================================================================== outputs
@dataclass
class ScheduledSequenceGroup:
    """A group scheduled this step; ``token_chunk_size`` tokens per live sequence (1 for a
    decode, the chunk length for a prefill); ``num_lookahead_slots``: slots reserved past the
    decode's token for speculative decoding (0 for prefills and plain decodes)."""

    seq_group: SequenceGroup
    token_chunk_size: int
    num_lookahead_slots: int = 0


@dataclass
class SchedulerOutputs:
    """The scheduling decision of one step.

    Attributes:
        scheduled_seq_groups: prefills first, then decodes; same order as the metadata list.
        num_prefill_groups: how many of them are prefills (whole or chunk).
        num_batched_tokens: tokens fed this step (<= max_num_batched_tokens), each decode's
            lookahead slots included (the positions a speculative decode verifies).
        blocks_to_swap_in: CPU block -> GPU block.
        blocks_to_swap_out: GPU block -> CPU block.
        blocks_to_copy: source GPU block -> destination GPU blocks (copy-on-write).
        ignored_seq_groups: groups rejected this step (FINISHED_IGNORED, with ``ignored_reason``).
        num_lookahead_slots: the most lookahead slots any decode got this step (0 = no decode
            speculates); each group's own count is ``ScheduledSequenceGroup.num_lookahead_slots``.
        running_queue_size: len(running) after this step's decisions.
        preempted: groups preempted (recompute or swap) this step.
        lora_requests: the distinct adapters of the scheduled groups (at most
            ``LoRAConfig.max_loras``; empty without LoRA).
    """

    scheduled_seq_groups: list[ScheduledSequenceGroup]
    num_prefill_groups: int
    num_batched_tokens: int
    blocks_to_swap_in: dict[int, int]
    blocks_to_swap_out: dict[int, int]
    blocks_to_copy: dict[int, list[int]]
    ignored_seq_groups: list[SequenceGroup]
    num_lookahead_slots: int
    running_queue_size: int
    preempted: int = 0
    lora_requests: set[LoRARequest] = field(default_factory=set)

    @property
    def num_loras(self) -> int:
        """Distinct adapters in the step."""
        return len(self.lora_requests)

    def is_empty(self) -> bool:
        """Nothing to run and no block to move (ignored groups do not count)."""
        return (
            not self.scheduled_seq_groups
            and not self.blocks_to_swap_in
            and not self.blocks_to_swap_out
            and not self.blocks_to_copy
        )


@dataclass
class SchedulerRunningOutputs:
    """What was decided for the ``running`` queue this step."""

    decode_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    prefill_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0


@dataclass
class SchedulerSwappedInOutputs:
    """What was decided for the ``swapped`` queue this step."""

    decode_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    prefill_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0
    infeasible_seq_groups: list[SequenceGroup] = field(default_factory=list)


@dataclass
class SchedulerPrefillOutputs:
    """What was decided for the ``waiting`` queue this step."""

    seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    num_lookahead_slots: int = 0


class _Step:
    """Mutable per-step accumulator shared by the helpers of one ``_schedule`` call."""

    __slots__ = (
        "now",
        "swapped_at_start",
        "blocks_to_swap_out",
        "blocks_to_copy",
        "preempted",
        "swapped_out",
        "preempted_ids",
        "ignored",
        "num_partial",
        "capped",
        "reserved",
        "reserved_over",
        "rank_swapped",
        "passed_delay",
        "speculate",
        "curr_loras",
        "yielding",
        "yielded",
    )

    def __init__(self, now: float, swapped_at_start: tuple[SequenceGroup, ...] = ()) -> None:
        self.now = now
        self.swapped_at_start = swapped_at_start
        self.blocks_to_swap_out: dict[int, int] = {}
        self.blocks_to_copy: dict[int, list[int]] = {}
        self.preempted: list[SequenceGroup] = []  # recomputed -> front of waiting
        self.swapped_out: list[SequenceGroup] = []
        self.preempted_ids: set[str] = set()
        self.ignored: list[SequenceGroup] = []
        self.num_partial = 0  # groups left mid-prefill after this step
        self.capped: list[ScheduledSequenceGroup] = []  # chunks cut by the long-prefill cap
        # Waiting groups that preempted others this step -> (group, blocks they need): the
        # freed blocks are theirs, not for the growth of running groups they outrank.
        self.reserved: dict[str, tuple[SequenceGroup, int]] = {}
        # ... and the waiting groups each of them outranked when it preempted
        self.reserved_over: dict[str, set[str]] = {}
        # groups those preemptions swapped out: they do not hold back the groups they made room for
        self.rank_swapped: set[str] = set()
        self.passed_delay = True  # delay_factor: new prompts may be admitted this step
        self.speculate = False  # decodes may reserve lookahead slots this step
        # Adapter ids (> 0) held by the step so far; None when LoRA is off.
        self.curr_loras: set[int] | None = None
        # Running prefills with a waiting group ranked ahead of them (rank policies, chunked
        # prefill): their chunks wait for the step's admissions and take what budget remains.
        self.yielding: set[str] = set()
        self.yielded: list[SequenceGroup] = []

    def add_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.blocks_to_copy.setdefault(src, []).append(dst)


# ====================================================================== scheduler
class Scheduler:
    """Decides each step's batch over ``waiting`` / ``running`` / ``swapped``.

    Args:
        scheduler_config: batching limits, mode, policy.
        cache_config: block size and pool sizes; ``num_gpu_blocks`` / ``num_cpu_blocks`` must
            already be ints (``num_cpu_blocks`` None is taken as 0).
        lora_config: multi-LoRA limits (``max_loras`` distinct adapters per step), or None:
            adapters are not counted.
        clock: seconds (``time.time``, or the simulator's virtual clock).
        preemption_cost: prices recompute against swap under ``preemption_mode=AUTO``
            (``kvserve.core.preemption``); None: ``LinearPreemptionCost.default(block_size)``.

    Raises:
        ValueError: ``num_gpu_blocks`` unset, unknown policy.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        lora_config: LoRAConfig | None = None,
        clock: Callable[[], float] = time.time,
        preemption_cost: PreemptionCost | None = None,
    ) -> None:
        if not isinstance(cache_config.num_gpu_blocks, int) or cache_config.num_gpu_blocks < 1:
            raise ValueError(
                f"cache_config.num_gpu_blocks must be an int >= 1 before building the "
                f"Scheduler, got {cache_config.num_gpu_blocks!r}."
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.lora_config = lora_config
        self.clock = clock
        if scheduler_config.chunked_prefill_enabled:
            self.prompt_limit = scheduler_config.max_model_len
        else:
            self.prompt_limit = min(scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens)
        self.block_manager = BlockSpaceManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_host_blocks(),
            watermark=cache_config.watermark,
            sliding_window=cache_config.sliding_window,
            enable_caching=cache_config.enable_prefix_caching,
            waiting_aware_eviction=cache_config.waiting_aware_eviction,
            host_tier_blocks=cache_config.num_kv_offload_blocks or 0,
            tier_cost=preemption_cost,
            stable_tier_keys=cache_config.kv_offload_dir is not None,
        )
        self.policy: Policy = PolicyFactory.from_config(scheduler_config)
        self._tracks = self.policy.tracks_service  # call the policy's service hooks
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        # New groups rejected at add time, reported by the next schedule().
        self._rejected: list[SequenceGroup] = []
        self.num_preemptions = 0  # cumulative, all groups
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0
        # cumulative: tokens whose KV a recompute dropped; blocks a swap-out moved
        self.num_recomputed_tokens = 0
        self.num_swapped_out_blocks = 0
        self.preemption_cost: PreemptionCost = preemption_cost or LinearPreemptionCost.default(
            cache_config.block_size
        )
        self.num_lookahead_slots = scheduler_config.num_lookahead_slots
        threshold = scheduler_config.long_prefill_token_threshold
        if threshold is None:
            # Like vLLM: only meaningful when several prompts may be mid-prefill at once.
            if scheduler_config.max_num_partial_prefills > 1:
                threshold = max(cache_config.block_size, int(0.04 * scheduler_config.max_model_len))
            else:
                threshold = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold: int = threshold
        slowdown = scheduler_config.max_decode_slowdown
        self.prefill_cap: PrefillCap | None = PrefillCap(slowdown) if slowdown is not None else None
        # delay_factor bookkeeping (vLLM V0): when the previous step began, whether it admitted
        # prompts, and how long the last step that did took (seconds on ``clock``).
        self.prev_time = 0.0
        self.prev_prompt = False
        self.last_prompt_latency = 0.0
        # request_id -> (admission passes the waiting group was deferred for its adapter,
        # ``_num_added`` at its first deferral: the starvation guard's cutoff).
        self._lora_deferrals: dict[str, tuple[int, int]] = {}
        # LoRA on: request_id -> its place in the order groups were added (pruned lazily).
        self._lora_order: dict[str, int] = {}
        self._num_added = 0
        # request_id -> times the group was preempted to turn its adapter's slot over
        # (``LoRAConfig.max_slot_preemptions``); dropped when the group ends.
        self._slot_preemptions: dict[str, int] = {}
        self.num_slot_preemptions = 0  # cumulative
        # Backfill: waiting request_id -> groups admitted past it while it waited; the request
        # ids admitted past a blocked group (reclaimable while they run; pruned lazily).
        self.backfill = scheduler_config.backfill_enabled
        self._bypasses: dict[str, int] = {}
        self._backfilled: set[str] = set()
        self.num_backfilled = 0  # cumulative admissions past a blocked group
        self.num_backfill_reclaims = 0  # cumulative groups preempted to admit the head
        # cumulative: preemptions by rank (``_schedule_priority_preemption``: priority, and
        # ``fair``'s preemption by share), those of them by swap, and the tokens they dropped
        self.num_rank_preemptions = 0
        self.num_rank_swap_preemptions = 0
        self.num_rank_recomputed_tokens = 0

    # ------------------------------------------------------------------ queue API
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """A new request joins ``waiting``, unless it can never be scheduled (prompt over
        ``prompt_limit``, more KV blocks than the pool minus the watermark, more sequences
        than ``max_num_seqs``): then it is marked FINISHED_IGNORED with its reason and
        reported in the next ``schedule()``'s ``ignored_seq_groups`` (it never blocks the
        queue and never gets a block)."""
        reason = self._never_schedulable(seq_group)
        if reason is not None:
            self._ignore(seq_group, reason)
            self._rejected.append(seq_group)
            return
        if self.lora_config is not None:
            if len(self._lora_order) > 2 * self.get_num_unfinished_seq_groups() + 64:
                # drop ended groups' entries (amortised: at most every other add)
                queued = {g.request_id for q in (self.waiting, self.running, self.swapped) for g in q}
                self._lora_order = {k: v for k, v in self._lora_order.items() if k in queued}
            self._lora_order[seq_group.request_id] = self._num_added
            self._num_added += 1
        if self._tracks:
            self.policy.on_add(seq_group)
        self.block_manager.add_waiting(seq_group)
        self.waiting.append(seq_group)

    def _never_schedulable(self, g: SequenceGroup) -> str | None:
        """Why a *new* group can never be scheduled, or None (cheap; exact checks for
        preempted groups happen at admission)."""
        seqs = g.get_unfinished_seqs()
        if not seqs or seqs[0].get_output_len() or len(seqs) != 1:
            return None
        cfg = self.scheduler_config
        length = seqs[0].get_len()
        if length > self.prompt_limit:
            if self.prompt_limit == cfg.max_model_len:
                why = f"max_model_len {cfg.max_model_len}"
            else:
                why = (
                    f"min of max_model_len {cfg.max_model_len} and max_num_batched_tokens "
                    f"{cfg.max_num_batched_tokens}"
                )
            return f"prompt has {length} tokens > prompt_limit {self.prompt_limit} ({why})"
        if g.get_max_num_running_seqs() > cfg.max_num_seqs:
            return f"needs {g.get_max_num_running_seqs()} sequences > max_num_seqs {cfg.max_num_seqs}"
        bm = self.block_manager
        need = -(-length // bm.block_size)
        usable = bm.num_total_gpu_blocks - bm.watermark_blocks
        if need > usable:
            return (
                f"needs {need} KV blocks > {usable} in the cache (block_size {bm.block_size}, "
                f"{bm.num_total_gpu_blocks} blocks, watermark {bm.watermark_blocks})"
            )
        return None

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Remove the groups with these request ids from whichever queue holds them, free
        their GPU and CPU blocks and mark unfinished sequences FINISHED_ABORTED. Unknown ids
        are ignored. Returns the aborted groups."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        aborted: list[SequenceGroup] = []
        if not ids:
            return aborted
        if self._rejected:
            aborted.extend(g for g in self._rejected if g.request_id in ids)
            self._rejected = [g for g in self._rejected if g.request_id not in ids]
        for queue in (self.waiting, self.running, self.swapped):
            if not any(g.request_id in ids for g in queue):
                continue
            keep: deque[SequenceGroup] = deque()
            for g in queue:
                if g.request_id in ids:
                    aborted.append(g)
                else:
                    keep.append(g)
            queue.clear()
            queue.extend(keep)
        for g in aborted:
            if self._tracks:
                self.policy.on_finish(g)
            self.block_manager.remove_waiting(g)
            self._lora_deferrals.pop(g.request_id, None)
            self._slot_preemptions.pop(g.request_id, None)
            for seq in g.get_seqs():
                if not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.block_manager.free(seq)
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._rejected)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self._rejected)

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares the parent's blocks (copy-on-write)."""
        self.block_manager.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        """Release a (finished) sequence's blocks."""
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        """Drop finished groups from ``running`` and free whatever blocks they still hold."""
        if not any(g.is_finished() for g in self.running):
            return
        keep: deque[SequenceGroup] = deque()
        for g in self.running:
            if g.is_finished():
                if self._tracks:
                    self.policy.on_finish(g)
                self._slot_preemptions.pop(g.request_id, None)
                for seq in g.get_seqs():
                    self.block_manager.free(seq)
            else:
                keep.append(g)
        self.running = keep

    def get_kv_cache_stats(self) -> dict:
        """Block counts (free includes cached refcount-0 blocks), ``gpu_cache_usage`` in
        [0, 1], prefix-cache queries/hits (tokens) and hit rate, wanted-block evictions, and
        the cumulative preemption and backfill counts."""
        stats = self.block_manager.get_stats()
        stats["num_preemptions"] = self.num_preemptions
        stats["num_recompute_preemptions"] = self.num_recompute_preemptions
        stats["num_swap_preemptions"] = self.num_swap_preemptions
        stats["num_recomputed_tokens"] = self.num_recomputed_tokens
        stats["num_swapped_out_blocks"] = self.num_swapped_out_blocks
        stats["num_backfilled"] = self.num_backfilled
        stats["num_backfill_reclaims"] = self.num_backfill_reclaims
        stats["num_rank_preemptions"] = self.num_rank_preemptions
        stats["num_rank_swap_preemptions"] = self.num_rank_swap_preemptions
        stats["num_rank_recomputed_tokens"] = self.num_rank_recomputed_tokens
        return stats

    def get_lora_stats(self) -> dict:
        """vLLM's ``lora_requests_info`` fields: ``max_lora`` (``max_loras``; 0 when LoRA is
        off), ``running_lora_adapters`` and ``waiting_lora_adapters`` (sorted adapter names of
        the groups in ``running``, and in ``waiting`` or ``swapped``)."""

        def names(*queues: Iterable[SequenceGroup]) -> list[str]:
            return sorted({g.lora_request.lora_name for q in queues for g in q if g.lora_request is not None})

        return {
            "max_lora": self.lora_config.max_loras if self.lora_config is not None else 0,
            "running_lora_adapters": names(self.running),
            "waiting_lora_adapters": names(self.waiting, self.swapped),
        }

    def reset_prefix_cache(self) -> bool:
        """Drop unreferenced cached blocks. True if no cached block remains."""
        return self.block_manager.reset_prefix_cache()

    def mark_computed(self, scheduler_outputs: SchedulerOutputs) -> None:
        """Call once the step's forward has run, *before* appending sampled tokens: advances
        every scheduled group's computed-token count by its chunk and enters completed full
        blocks in the prefix cache. A policy that ``tracks_service`` is told the tokens served
        (prefill tokens as input, decode tokens as output, over live sequences)."""
        bm = self.block_manager
        for ssg in scheduler_outputs.scheduled_seq_groups:
            g = ssg.seq_group
            if self._tracks:
                n = ssg.token_chunk_size * g.num_unfinished_seqs()
                if g.is_prefill():
                    self.policy.on_served(g, n, 0)
                else:
                    self.policy.on_served(g, 0, n)
            g.update_num_computed_tokens(ssg.token_chunk_size)
            bm.mark_blocks_as_computed(g)
        bm.release_pins()

    def on_accepted_drafts(self, seq_group: SequenceGroup, num_tokens: int) -> None:
        """A verify step emitted ``num_tokens`` accepted draft tokens of ``seq_group`` beyond
        the one token per sequence ``mark_computed`` counted: a policy that
        ``tracks_service`` is told them as output tokens (what the tenant was served)."""
        if self._tracks and num_tokens > 0:
            self.policy.on_served(seq_group, 0, num_tokens)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        """Decide the next step. Returns one metadata entry per scheduled group (in the order
        of ``scheduled_seq_groups``) and the ``SchedulerOutputs``."""
        self.block_manager.release_pins()  # the previous step (and its copies) has run
        out = self._schedule()
        now = self.clock()
        bm = self.block_manager
        caching = bm.enable_caching
        metas: list[SequenceGroupMetadata] = []
        for ssg in out.scheduled_seq_groups:
            g = ssg.seq_group
            g.maybe_set_first_scheduled_time(now)
            seq_data = {}
            block_tables = {}
            first = None
            for seq in g.seqs_dict.values():
                if seq.status == SequenceStatus.RUNNING:
                    seq_data[seq.seq_id] = seq.data
                    block_tables[seq.seq_id] = bm.get_block_table(seq)
                    if first is None:
                        first = seq
            assert first is not None, f"{g.request_id} scheduled without a running sequence"
            is_prompt = first.is_prefill()
            do_sample = True
            computed = None
            if is_prompt:
                do_sample = first.data.get_num_computed_tokens() + ssg.token_chunk_size >= first.get_len()
                if caching:
                    computed = bm.get_computed_block_nums(first)
            metas.append(
                SequenceGroupMetadata(
                    request_id=g.request_id,
                    is_prompt=is_prompt,
                    seq_data=seq_data,
                    sampling_params=g.sampling_params,
                    block_tables=block_tables,
                    token_chunk_size=ssg.token_chunk_size,
                    do_sample=do_sample,
                    num_samples=g.sampling_params.n if not g.forked else 1,
                    generator=g.generator,
                    computed_block_nums=computed,
                    prompt_logprobs_from=g.prompt_logits_needed_from() if is_prompt else None,
                    num_speculative_tokens=0 if is_prompt else ssg.num_lookahead_slots,
                    lora_request=g.lora_request,
                    pooling_params=g.pooling_params,
                )
            )
        return metas, out

    def _schedule(self) -> SchedulerOutputs:
        if self.scheduler_config.chunked_prefill_enabled:
            return self._schedule_chunked_prefill()
        return self._schedule_default()

    def _new_step(self) -> _Step:
        st = _Step(self.clock(), tuple(self.swapped))
        st.passed_delay = self._passed_delay(st.now)
        self.policy.begin_step(self.running)
        if self.num_lookahead_slots:
            limit = self.scheduler_config.spec_decode_disable_by_batch_size
            # vLLM's disable_by_batch_size: a busy step is weight-read bound no more, so
            # verifying drafts would cost more than the tokens it saves.
            st.speculate = limit is None or sum(g.num_unfinished_seqs() for g in self.running) <= limit
        return st

    @property
    def lora_enabled(self) -> bool:
        return self.lora_config is not None

    def _running_loras(self) -> set[int] | None:
        """Adapter ids of the groups in ``running`` (None when LoRA is off)."""
        if self.lora_config is None:
            return None
        return {g.lora_int_id for g in self.running if g.lora_int_id > 0}

    def _lora_fits(self, g: SequenceGroup, loras: set[int] | None) -> bool:
        """Whether ``g`` may join a step already holding ``loras``: no adapter, one the step
        holds, or a free slot under ``max_loras``."""
        if loras is None or self.lora_config is None:
            return True
        lora = g.lora_int_id
        return lora == 0 or lora in loras or len(loras) < self.lora_config.max_loras

    @staticmethod
    def _lora_add(g: SequenceGroup, loras: set[int] | None) -> None:
        if loras is not None and g.lora_int_id > 0:
            loras.add(g.lora_int_id)

    def _turn_over_lora_slot(self, budget: SchedulingBudget, st: _Step) -> None:
        """Slot turnover (``LoRAConfig.max_slot_preemptions`` > 0): when every slot is held
        and the first adapter deferred in ``waiting`` (rank order) has ``need`` groups
        waiting, preempt by recompute the running groups of the held adapter with the fewest
        (at most ``need // 2``), so that adapter's slot goes to the waiting one in this step.
        Only adapters whose groups all decode and were each turned over fewer than
        ``max_slot_preemptions`` times qualify (under a rank policy only if the waiting
        adapter's first group strictly outranks them); ties go to the adapter whose earliest
        group ranks lowest. At most one slot per step, none while anything is swapped (new groups
        would not be admitted) or new prompts are held back (``delay_factor``). Recompute,
        not swap: a swapped group would block admissions and the slot would not turn.
        The preempted groups go to the front of ``waiting`` and take a slot again in order."""
        lc = self.lora_config
        if lc is None or lc.max_slot_preemptions <= 0 or not self.waiting or not self.running:
            return
        if self.swapped or st.swapped_at_start or not st.passed_delay:
            return
        held: dict[int, list[SequenceGroup]] = {}
        for g in self.running:
            if g.lora_int_id > 0:
                held.setdefault(g.lora_int_id, []).append(g)
        if len(held) < lc.max_loras:
            return  # a slot is free already
        first = 0
        need = 0
        head: SequenceGroup | None = None
        for g in self.policy.sort_by_priority(st.now, self.waiting):
            if g.request_id in st.preempted_ids or g.lora_int_id == 0 or g.lora_int_id in held:
                continue
            if first == 0:
                first, head = g.lora_int_id, g
            if g.lora_int_id == first:
                need += 1
        if need < 2:
            return
        ranked = {g.request_id: i for i, g in enumerate(self.policy.sort_by_priority(st.now, self.running))}
        best: tuple[int, int] | None = None
        victim: list[SequenceGroup] = []
        for groups in held.values():
            if 2 * len(groups) > need:
                continue
            if any(
                g.is_prefill()
                or self._slot_preemptions.get(g.request_id, 0) >= lc.max_slot_preemptions
                # under a rank policy only for a group that outranks them (no priority inversion)
                or (
                    self.policy.preempts_by_rank
                    and head is not None
                    and not self.policy.outranks(st.now, head, g)
                )
                for g in groups
            ):
                continue
            key = (len(groups), -min(ranked[g.request_id] for g in groups))
            if best is None or key < best:
                best, victim = key, groups
        # lowest-ranked first: ``_finish_step`` puts them at the front of waiting in reverse
        for g in sorted(victim, key=lambda g: ranked[g.request_id], reverse=True):
            self.running.remove(g)
            budget.subtract_num_seqs(g.request_id, g.get_max_num_running_seqs())
            self._preempt(g, st, PreemptionMode.RECOMPUTE, warn=False)
            self._slot_preemptions[g.request_id] = self._slot_preemptions.get(g.request_id, 0) + 1
            self.num_slot_preemptions += 1

    def _get_num_lookahead_slots(self, g: SequenceGroup, st: _Step, live: list[Sequence]) -> int:
        """Lookahead slots for decoding group ``g`` this step: ``num_lookahead_slots``, fewer
        near ``max_model_len`` (the verified positions must exist), 0 when the step does not
        speculate or the engine switched the group off."""
        if not st.speculate or g.spec_decode_disabled or not live:
            return 0
        room = self.scheduler_config.max_model_len - live[0].get_len()
        return max(0, min(self.num_lookahead_slots, room))

    def _new_budget(self) -> SchedulingBudget:
        budget = SchedulingBudget(
            token_budget=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )
        # Reserve the sequence slots of everything already running, so admissions never
        # push the running set past max_num_seqs.
        for g in self.running:
            budget.add_num_seqs(g.request_id, g.get_max_num_running_seqs())
        return budget

    def _schedule_default(self) -> SchedulerOutputs:
        """V0 path: whole prompts first; decodes (and swap-ins) only in steps without any."""
        st = self._new_step()
        budget = self._new_budget()
        if self.policy.preempts_by_rank:
            self._schedule_priority_preemption(budget, st)
        self._turn_over_lora_slot(budget, st)
        self._reclaim_backfill(budget, st, enable_chunking=False)
        st.curr_loras = self._running_loras()
        prefills = self._schedule_prefills(budget, st, enable_chunking=False)
        running = SchedulerRunningOutputs()
        swapped_in = SchedulerSwappedInOutputs()
        if not prefills.seq_groups:
            running = self._schedule_running(budget, st, enable_chunking=False)
            if not st.preempted_ids:
                st.curr_loras = self._running_loras()  # preempted groups hold no slot
                swapped_in = self._schedule_swapped(budget, st, enable_chunking=False)
        return self._finish_step(budget, st, prefills, running, swapped_in)

    def _schedule_chunked_prefill(self) -> SchedulerOutputs:
        """Sarathi-Serve path: decodes, running prefills, swap-ins, then new prompts, all
        under one token budget; leftover budget tops up chunks cut by the long-prefill cap."""
        st = self._new_step()
        budget = self._new_budget()
        self._cap_prompt_tokens(budget)
        if self.policy.preempts_by_rank:
            self._schedule_priority_preemption(budget, st)
        self._turn_over_lora_slot(budget, st)
        self._reclaim_backfill(budget, st, enable_chunking=True)
        if self.policy.preempts_by_rank:
            st.yielding = self._yielding_prefills(st)
        running = self._schedule_running(budget, st, enable_chunking=True)
        # Running groups' adapters count first; preempted groups hold no slot.
        st.curr_loras = self._running_loras()
        swapped_in = SchedulerSwappedInOutputs()
        if not st.preempted_ids:
            swapped_in = self._schedule_swapped(budget, st, enable_chunking=True)
        prefills = self._schedule_prefills(budget, st, enable_chunking=True)
        # Running prefills that yielded the budget to those admissions take what is left; one
        # that would stay mid-prefill waits (no chunk) while the partial-prefill slots are taken
        # (by an admission that outranks it).
        st.yielding.clear()
        for g in st.yielded:
            if g.request_id in st.preempted_ids:
                continue
            chunk, capped = self._prefill_chunk(g, budget, True, st)
            partial = chunk < self._live(g)[0].data.get_num_uncomputed_tokens()
            if chunk <= 0 or (partial and st.num_partial >= self.scheduler_config.max_num_partial_prefills):
                continue
            ssg = ScheduledSequenceGroup(g, chunk)
            running.prefill_seq_groups.append(ssg)
            budget.add_num_batched_tokens(g.request_id, chunk * len(self._live(g)))
            if capped:
                st.capped.append(ssg)
            st.num_partial += partial
        # Top up capped chunks with whatever budget is left.
        for ssg in st.capped:
            g = ssg.seq_group
            n_live = len(self._live(g))
            left = g.get_unfinished_seqs()[0].data.get_num_uncomputed_tokens() - ssg.token_chunk_size
            extra = min(left, budget.remaining_token_budget() // n_live)
            if extra > 0:
                budget.subtract_num_batched_tokens(g.request_id, ssg.token_chunk_size * n_live)
                ssg.token_chunk_size += extra
                budget.add_num_batched_tokens(g.request_id, ssg.token_chunk_size * n_live)
        return self._finish_step(budget, st, prefills, running, swapped_in)

    def _cap_prompt_tokens(self, budget: SchedulingBudget) -> None:
        """``max_decode_slowdown``: while sequences decode, the step's budget is their tokens
        plus the prompt tokens ``prefill_cap`` allows (decodes are scheduled first)."""
        if self.prefill_cap is None:
            return
        decode_tokens = sum(
            g.num_unfinished_seqs() * (1 + self.num_lookahead_slots)
            for g in self.running
            if not g.is_prefill()
        )
        cap = self.prefill_cap.cap() if decode_tokens else None
        if cap is not None:
            budget.token_budget = min(budget.token_budget, decode_tokens + cap)

    def observe_step(self, outputs: SchedulerOutputs, seconds: float) -> None:
        """The wall time of the step ``outputs`` scheduled, for ``max_decode_slowdown``'s
        estimate (no-op without it)."""
        if self.prefill_cap is None:
            return
        groups = outputs.scheduled_seq_groups
        prompt_tokens = sum(s.token_chunk_size for s in groups[: outputs.num_prefill_groups])
        decode_seqs = sum(s.seq_group.num_unfinished_seqs() for s in groups[outputs.num_prefill_groups :])
        self.prefill_cap.observe(prompt_tokens, decode_seqs, seconds)

    def _finish_step(
        self,
        budget: SchedulingBudget,
        st: _Step,
        prefills: SchedulerPrefillOutputs,
        running: SchedulerRunningOutputs,
        swapped_in: SchedulerSwappedInOutputs,
    ) -> SchedulerOutputs:
        # Recompute-preempted groups go to the front of waiting, highest-ranked first.
        self.waiting.extendleft(st.preempted)
        if self._tracks:
            for g in self._rejected + prefills.ignored_seq_groups + st.ignored:
                self.policy.on_finish(g)
        prefill_groups = prefills.seq_groups + running.prefill_seq_groups + swapped_in.prefill_seq_groups
        decode_groups = running.decode_seq_groups + swapped_in.decode_seq_groups
        assert budget.num_batched_tokens <= self.scheduler_config.max_num_batched_tokens
        lora_requests: set[LoRARequest] = set()
        if self.lora_config is not None:
            for ssg in prefill_groups + decode_groups:
                if ssg.seq_group.lora_request is not None:
                    lora_requests.add(ssg.seq_group.lora_request)
            assert len({r.lora_int_id for r in lora_requests}) <= self.lora_config.max_loras, lora_requests
        # Host-tier moves: promotions of admitted groups' prefixes, demotions of evicted blocks.
        promotions, demotions = self.block_manager.take_tier_moves(st.blocks_to_swap_out)
        return SchedulerOutputs(
            scheduled_seq_groups=prefill_groups + decode_groups,
            num_prefill_groups=len(prefill_groups),
            num_batched_tokens=budget.num_batched_tokens,
            blocks_to_swap_in={**swapped_in.blocks_to_swap_in, **promotions},
            blocks_to_swap_out={**demotions, **st.blocks_to_swap_out},
            blocks_to_copy=st.blocks_to_copy,
            ignored_seq_groups=self._take_rejected() + prefills.ignored_seq_groups + st.ignored,
            num_lookahead_slots=max((s.num_lookahead_slots for s in decode_groups), default=0),
            running_queue_size=len(self.running),
            preempted=len(st.preempted) + len(st.swapped_out),
            lora_requests=lora_requests,
        )

    # ------------------------------------------------------------------ helpers
    def _take_rejected(self) -> list[SequenceGroup]:
        rejected, self._rejected = self._rejected, []
        return rejected

    @staticmethod
    def _live(g: SequenceGroup) -> list[Sequence]:
        return g.get_unfinished_seqs()

    def _ignore(self, g: SequenceGroup, reason: str) -> None:
        """End a group the scheduler can never run (further). A group that has generated
        tokens already was an admissible request that outgrew the cache: its live sequences
        finish ``length``-capped and keep their output (the cache acts as its context limit).
        Otherwise the request is rejected (FINISHED_IGNORED). Either way ``ignored_reason``
        says why."""
        started = any(seq.get_output_len() for seq in g.get_seqs())
        g.ignored_reason = reason
        self.block_manager.remove_waiting(g)
        self._lora_deferrals.pop(g.request_id, None)
        self._slot_preemptions.pop(g.request_id, None)
        status = SequenceStatus.FINISHED_LENGTH_CAPPED if started else SequenceStatus.FINISHED_IGNORED
        for seq in g.get_seqs():
            if not seq.is_finished():
                seq.status = status
            self.block_manager.free(seq)
        # the engine logs the request's end (one line a request); this says which path ended it
        logger.debug("%s request %s: %s", "length-capping" if started else "ignoring", g.request_id, reason)

    def _prefill_chunk(
        self, g: SequenceGroup, budget: SchedulingBudget, enable_chunking: bool, st: _Step
    ) -> tuple[int, bool]:
        """Tokens per live sequence for the group's next prefill step, and whether the
        long-prefill cap cut it. 0 means it does not fit this step."""
        live = self._live(g)
        n_live = len(live)
        uncomputed = live[0].data.get_num_uncomputed_tokens()
        remaining = 0 if g.request_id in st.yielding else budget.remaining_token_budget()
        if not enable_chunking and uncomputed * n_live <= self.scheduler_config.max_num_batched_tokens:
            # Whole prompt or nothing (it fits an empty step, so it only waits).
            return (uncomputed if uncomputed * n_live <= remaining else 0), False
        chunk = min(uncomputed, remaining // n_live)
        capped = False
        if enable_chunking and chunk > self.long_prefill_token_threshold:
            chunk = self.long_prefill_token_threshold
            capped = True
        return chunk, capped

    def _preempt(
        self, g: SequenceGroup, st: _Step, mode: PreemptionMode | None = None, warn: bool = True
    ) -> PreemptionMode:
        """Preempt a running group; returns the mode used. RECOMPUTE groups are queued for
        the front of ``waiting`` at the end of the step; SWAP groups join ``swapped`` now.
        ``mode`` forces one (else the configured one); ``warn=False`` skips the "cache too
        small" log line (slot turnover preempts by choice, not for want of blocks)."""
        if mode is None:
            mode = self.scheduler_config.preemption_mode
        live = self._live(g)
        if mode is None:
            mode = PreemptionMode.RECOMPUTE if len(live) == 1 else PreemptionMode.SWAP
        elif mode == PreemptionMode.AUTO:
            mode = self._price_preemption(g)[0]
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(g):
            mode = PreemptionMode.RECOMPUTE  # not enough CPU blocks: fall back, never fail
        if mode == PreemptionMode.RECOMPUTE:
            record = PreemptionRecord(st.now, "recompute", self._requeue_for_recompute(g, live, st))
            self.num_recompute_preemptions += 1
        else:
            n_blocks = self._num_device_blocks(live)
            self.block_manager.swap_out(g, st.blocks_to_swap_out)
            for seq in live:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(g)
            st.swapped_out.append(g)
            self.num_swap_preemptions += 1
            self.num_swapped_out_blocks += n_blocks
            record = PreemptionRecord(st.now, "swap", num_swapped_blocks=n_blocks)
        st.preempted_ids.add(g.request_id)
        g.metrics.add_preemption(record)
        self.num_preemptions += 1
        if warn and (self.num_preemptions == 1 or self.num_preemptions % 100 == 0):
            logger.warning(
                "preempted request %s by %s (cumulative preemptions: %d); the KV cache "
                "is too small for the load",
                g.request_id,
                mode.name,
                self.num_preemptions,
            )
        return mode

    def _num_device_blocks(self, live: list[Sequence]) -> int:
        """Distinct device blocks the live sequences hold (what a swap-out moves)."""
        bm = self.block_manager
        return len({b for s in live if bm.has_blocks(s) for b in bm.get_block_table(s)})

    def _price_preemption(self, g: SequenceGroup) -> tuple[PreemptionMode, float]:
        """The cheaper way to preempt running group ``g`` under the injected price, and its
        seconds: recompute re-prefills each live sequence's computed tokens, less (prefix
        caching) the blocks other groups hold too, which stay cached; swap moves its distinct
        device blocks out and back, and is out when free CPU blocks are short. Ties recompute."""
        bm = self.block_manager
        live = self._live(g)
        n_blocks = self._num_device_blocks(live)
        kept = 0
        if bm.caches(g):
            kept = (n_blocks - bm.get_num_freeable_blocks(g)) * bm.block_size
        tokens = sum(max(0, s.data.get_num_computed_tokens() - kept) for s in live)
        recompute = self.preemption_cost.recompute_s(tokens, len(live))
        if bm.can_swap_out(g):
            swap = self.preemption_cost.swap_s(n_blocks)
            if swap < recompute:
                return PreemptionMode.SWAP, swap
        return PreemptionMode.RECOMPUTE, recompute

    def _pop_victim(
        self, victims: list[SequenceGroup], g: SequenceGroup, done: set[str], st: _Step
    ) -> SequenceGroup | None:
        """Take the victim for decoding group ``g`` out of ``victims`` (rank order, lowest
        last): a group not yet scheduled this step (``done``), or ``g`` itself; None when none
        is left. V0: the lowest-ranked. AUTO: the cheapest per freed block among the tail's
        window (module docstring)."""
        if self.scheduler_config.preemption_mode == PreemptionMode.AUTO:
            bm = self.block_manager
            tail: SequenceGroup | None = None
            tail_price = best = float("inf")
            best_i = -1
            seen = 0
            for i in range(len(victims) - 1, -1, -1):
                v = victims[i]
                if v is g or v.request_id in done:
                    continue
                if tail is None:
                    tail = v
                elif self.policy.outranks(st.now, v, tail):
                    break
                freed = bm.get_num_freeable_blocks(v)
                if freed:
                    per_block = self._price_preemption(v)[1] / freed
                    if v is tail:
                        tail_price = best = per_block
                        best_i = i
                    elif per_block * AUTO_VICTIM_MARGIN <= tail_price and per_block < best:
                        best, best_i = per_block, i
                seen += 1
                if seen == AUTO_VICTIM_WINDOW:
                    break
            if best_i >= 0:
                return victims.pop(best_i)
        while victims:
            v = victims.pop()
            if v is g or v.request_id not in done:
                return v
        return None

    def _swapped_allows(self, g: SequenceGroup, st: _Step) -> bool:
        """Whether a new group may be admitted given the swapped queue (now and at the start
        of the step): only when nothing is swapped, or (rank policies) when the policy
        ``admits_past`` every swapped group (``priority``: it strictly outranks them)."""
        if not self.swapped and not st.swapped_at_start:
            return True
        if not self.policy.preempts_by_rank:
            return False
        # A group that preempted by rank this step passes the groups it swapped out for room
        # (it outranked them then; its own admission has since moved the policy's counts).
        made_room = g.request_id in st.reserved
        return all(
            self.policy.admits_past(st.now, g, s)
            for s in (*self.swapped, *st.swapped_at_start)
            if not (made_room and s.request_id in st.rank_swapped)
        )

    def _waiting_classes(self, st: _Step) -> list[SequenceGroup]:
        """One waiting group per (tenant, priority) that new prompts may come from this step."""
        if not st.passed_delay:
            return []
        return _class_heads(w for w in self.waiting if w.request_id not in st.preempted_ids)

    def _rank_preemption_mode(self, g: SequenceGroup) -> PreemptionMode | None:
        """The mode of preempting running group ``g`` by rank (``_schedule_priority_preemption``):
        None (the configured mode) when ``preemption_mode`` is set; unset, the cheaper way under
        the injected price (``_price_preemption``, as ``AUTO``). A rank preemption is taken by
        choice while the victim still has work, and with free host blocks a swap brings it back
        with a copy where a recompute prefills its prompt and outputs again."""
        if self.scheduler_config.preemption_mode is not None:
            return None
        return self._price_preemption(g)[0]

    # ------------------------------------------------------------------ priority
    def _schedule_priority_preemption(self, budget: SchedulingBudget, st: _Step) -> None:
        """Let waiting groups that strictly outrank running ones take their place.

        Walks ``waiting`` in rank order; for each group that does not fit (KV blocks or
        sequence slots), preempts the lowest-ranked running groups it strictly outranks, but
        only if doing so makes it fit. Stops at the first group that cannot be helped.
        """
        if not self.waiting or not self.running or not st.passed_delay:
            return  # (no preempting for prompts that this step holds back anyway)
        now = st.now
        bm = self.block_manager
        waiting = self.policy.sort_by_priority(now, self.waiting)
        victims = list(self.policy.sort_by_priority(now, self.running))  # tail = lowest
        free = bm.get_num_free_gpu_blocks()
        seqs = budget.num_curr_seqs
        # Adapters the groups counted so far would hold: a group whose adapter would be
        # deferred preempts nobody (the slot it needs is not freed by taking blocks).
        loras = self._running_loras()
        for wg in waiting:
            if not victims:
                return
            live = self._live(wg)
            if (
                not live
                or live[0].get_len() > self.prompt_limit
                and not live[0].get_output_len()
                or not self._swapped_allows(wg, st)
                or not self._lora_fits(wg, loras)
            ):
                continue
            plan = bm.plan_allocation(wg)
            if plan.status == AllocStatus.NEVER:
                continue
            need_blocks = plan.cost + bm.watermark_blocks - free
            need_seqs = seqs + wg.get_max_num_running_seqs() - budget.max_num_seqs
            if need_blocks <= 0 and need_seqs <= 0:
                free -= plan.cost
                seqs += wg.get_max_num_running_seqs()
                self._lora_add(wg, loras)
                continue
            chosen = []
            gain_blocks = gain_seqs = 0
            for v in reversed(victims):
                if not self.policy.outranks(now, wg, v):
                    break
                chosen.append(v)
                gain_blocks += bm.get_num_freeable_blocks(v)
                gain_seqs += v.get_max_num_running_seqs()
                if gain_blocks >= need_blocks and gain_seqs >= need_seqs:
                    break
            if gain_blocks < need_blocks or gain_seqs < need_seqs:
                return  # preempting what it outranks would not make it fit
            # whom it outranks as it preempts (before the counts the preemption changes)
            over = {x.request_id for x in waiting if x is not wg and self.policy.outranks(now, wg, x)}
            for v in chosen:
                victims.remove(v)
                self.running.remove(v)
                budget.subtract_num_seqs(v.request_id, v.get_max_num_running_seqs())
                dropped = self.num_recomputed_tokens
                if self._preempt(v, st, self._rank_preemption_mode(v)) == PreemptionMode.SWAP:
                    self.num_rank_swap_preemptions += 1
                    st.rank_swapped.add(v.request_id)
                self.num_rank_preemptions += 1
                self.num_rank_recomputed_tokens += self.num_recomputed_tokens - dropped
                self.policy.on_running_change(v, -v.get_max_num_running_seqs())
            st.reserved[wg.request_id] = (wg, plan.cost)
            st.reserved_over[wg.request_id] = over
            self.policy.on_running_change(wg, wg.get_max_num_running_seqs())
            self._lora_add(wg, loras)
            free = bm.get_num_free_gpu_blocks() - plan.cost
            seqs = budget.num_curr_seqs + wg.get_max_num_running_seqs()

    # ------------------------------------------------------------------ running
    def _yielding_prefills(self, st: _Step) -> set[str]:
        """Running prefills that a waiting group ranks ahead of (``Policy.admits_past``).
        Their next chunks go after the step's admissions: otherwise a prompt admitted earlier
        takes its chunks first, and a newcomer that outranks it (``fair``: a tenant returning
        to a flood; ``priority``: a more urgent request) waits for its whole prefill. The rank
        policies' keys depend on tenant and priority (and age: ``_class_heads``), so each
        distinct pair is asked once."""
        prefills = [g for g in self.running if g.is_prefill()]
        if not prefills or not self.waiting:
            return set()
        heads = _class_heads(self.waiting)
        return {g.request_id for g in prefills if any(self.policy.admits_past(st.now, w, g) for w in heads)}

    def _schedule_running(
        self, budget: SchedulingBudget, st: _Step, enable_chunking: bool
    ) -> SchedulerRunningOutputs:
        """Schedule groups in ``running``: a decode token per live sequence, or the next
        prefill chunk. Decodes that cannot get a slot preempt the lowest-ranked group not yet
        scheduled (possibly themselves). With chunking, decodes go before prefills."""
        out = SchedulerRunningOutputs(num_lookahead_slots=self.num_lookahead_slots)
        if not self.running:
            return out
        bm = self.block_manager
        max_len = self.scheduler_config.max_model_len
        ranked = self.policy.sort_by_priority(st.now, self.running)
        if enable_chunking:
            order = [g for g in ranked if not g.is_prefill()] + [g for g in ranked if g.is_prefill()]
        else:
            order = list(ranked)
        victims = list(ranked)  # lowest rank at the end
        done: set[str] = set()
        kept: list[SequenceGroup] = []  # stay in running (scheduled or not)
        for g in order:
            rid = g.request_id
            if rid in done:
                continue
            done.add(rid)
            live = [s for s in g.seqs_dict.values() if s.status == SequenceStatus.RUNNING]
            if not live:
                kept.append(g)
                continue
            if g.is_prefill():
                chunk, capped = self._prefill_chunk(g, budget, enable_chunking, st)
                if chunk <= 0:
                    kept.append(g)
                    if rid in st.yielding:
                        st.yielded.append(g)  # its partial-prefill slot is open to those ahead
                    else:
                        st.num_partial += 1
                    continue
                ssg = ScheduledSequenceGroup(g, chunk)
                out.prefill_seq_groups.append(ssg)
                budget.add_num_batched_tokens(rid, chunk * len(live))
                if capped:
                    st.capped.append(ssg)
                if chunk < live[0].data.get_num_uncomputed_tokens():
                    st.num_partial += 1
                kept.append(g)
                continue
            # Decode: one token per live sequence at position len-1.
            too_long = [s for s in live if s.data.get_len() > max_len]
            if too_long:
                # Defensive: the engine should have stopped these at max_model_len.
                for s in too_long:
                    s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    bm.free(s)
                if g.is_finished():
                    st.ignored.append(g)
                    continue
                live = [s for s in live if s.status == SequenceStatus.RUNNING]
            n_tokens = len(live)
            if n_tokens > budget.remaining_token_budget():
                kept.append(g)
                continue
            scheduled = True
            reserve = self._reserved_against(g, st) if st.reserved else 0
            lookahead = 0
            if st.speculate:
                # verified positions are fed tokens too: they count against the step's budget
                room = budget.remaining_token_budget() // n_tokens - 1
                lookahead = max(0, min(self._get_num_lookahead_slots(g, st, live), room))
            while True:
                copies = bm.try_append_slots(g, lookahead, reserve)
                if copies is not None:
                    break
                if lookahead:
                    # Speculate less before preempting anyone: the lookahead is optional.
                    lookahead = 0
                    continue
                victim = self._pop_victim(victims, g, done, st)
                if victim is None or victim is g:
                    budget.subtract_num_seqs(rid, g.get_max_num_running_seqs())
                    scheduled = False
                    if bm.can_ever_append_slots(g, lookahead):
                        self._preempt(g, st)
                    elif len(live) > 1 and bm.fits_once_recomputed(g):
                        # Its forked sequences agree on blocks they hold apart: a re-prefill
                        # shares them, and yields a token, so this always makes progress.
                        self._preempt(g, st, PreemptionMode.RECOMPUTE)
                    else:
                        # Even alone it cannot take its next token: end it, don't thrash.
                        held = bm.get_num_freeable_blocks(g)
                        self._ignore(
                            g,
                            f"cannot continue: its next token needs more than the "
                            f"{bm.num_total_gpu_blocks} KV blocks in the cache (holds "
                            f"{held}, block_size {bm.block_size}) after "
                            f"{max(s.get_output_len() for s in live)} generated tokens",
                        )
                        st.ignored.append(g)
                        st.preempted_ids.add(rid)
                    break
                done.add(victim.request_id)
                budget.subtract_num_seqs(victim.request_id, victim.get_max_num_running_seqs())
                self._preempt(victim, st)
            if not scheduled:
                continue
            if copies:
                st.add_copies(copies)
            out.decode_seq_groups.append(ScheduledSequenceGroup(g, 1, lookahead))
            budget.add_num_batched_tokens(rid, n_tokens * (1 + lookahead))
            kept.append(g)
        # Groups preempted after being passed over stay out; everything else remains running.
        self.running = deque(g for g in kept if g.request_id not in st.preempted_ids)
        return out

    # ------------------------------------------------------------------ swapped
    def _schedule_swapped(
        self, budget: SchedulingBudget, st: _Step, enable_chunking: bool
    ) -> SchedulerSwappedInOutputs:
        """Swap groups back in, in rank order, while blocks (plus watermark) and budget allow.
        A group that a waiting group goes before (``admits_past``) is passed over for the step.
        A group that can never fit is rejected (``infeasible_seq_groups`` -> ignored). A group
        whose adapter would exceed ``max_loras`` is deferred: it stays in ``swapped``, in its
        place, and the groups behind it are still considered."""
        out = SchedulerSwappedInOutputs(num_lookahead_slots=self.num_lookahead_slots)
        if not self.swapped:
            return out
        bm = self.block_manager
        ranked = self.policy.sort_by_priority(st.now, self.swapped)
        remaining: deque[SequenceGroup] = deque()
        recomputed: set[str] = set()
        ahead = self._waiting_classes(st) if self.policy.preempts_by_rank else []
        while ranked:
            g = ranked[0]
            if any(self.policy.admits_past(st.now, w, g) for w in ahead):
                # A waiting group ranked before it is admitted first (its place, as if
                # recomputed). Pass it over, not stop: a group behind it that no waiting group
                # passes (a tie of ranks) would else hold that waiting group back forever.
                ranked.popleft()
                continue
            if not self._lora_fits(g, st.curr_loras):
                ranked.popleft()  # deferred: stays in self.swapped, order unchanged
                continue
            lookahead = 0
            if st.speculate and not g.is_prefill():
                n_live = max(1, g.num_seqs(SequenceStatus.SWAPPED))
                room = budget.remaining_token_budget() // n_live - 1
                lookahead = max(
                    0, min(self._get_num_lookahead_slots(g, st, g.get_seqs(SequenceStatus.SWAPPED)), room)
                )
            status = bm.can_swap_in(g, lookahead, ignore_watermark=not self.running)
            if lookahead and status != AllocStatus.OK:
                lookahead = 0  # speculate less rather than wait
                status = bm.can_swap_in(g, 0, ignore_watermark=not self.running)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                ranked.popleft()
                if g.num_seqs(SequenceStatus.SWAPPED) > 1 and bm.fits_once_recomputed(g):
                    # As for a running group that outgrows the cache: its forked sequences
                    # hold apart blocks a re-prefill shares, so recompute it, don't cap it.
                    self._recompute_swapped(g, st)
                    recomputed.add(g.request_id)
                    continue
                n = bm.get_num_swapped_blocks(g)
                self._ignore(
                    g,
                    f"needs {n} KV blocks plus room for its next token > "
                    f"{bm.num_total_gpu_blocks} in the cache to resume",
                )
                out.infeasible_seq_groups.append(g)
                st.ignored.append(g)
                continue
            live = g.get_seqs(SequenceStatus.SWAPPED)
            is_prefill = g.is_prefill()
            if is_prefill:
                chunk, capped = self._prefill_chunk(g, budget, enable_chunking, st)
                n_tokens = chunk * len(live)
            else:
                chunk, capped = 1, False
                n_tokens = len(live) * (1 + lookahead)
            if n_tokens <= 0 or not budget.can_schedule(
                num_new_tokens=n_tokens, num_new_seqs=g.get_max_num_running_seqs()
            ):
                break
            ranked.popleft()
            bm.swap_in(g, out.blocks_to_swap_in)
            for s in live:
                s.status = SequenceStatus.RUNNING
            ssg = ScheduledSequenceGroup(g, chunk, 0 if is_prefill else lookahead)
            if is_prefill:
                out.prefill_seq_groups.append(ssg)
                if capped:
                    st.capped.append(ssg)
                if chunk < live[0].data.get_num_uncomputed_tokens():
                    st.num_partial += 1
            else:
                for s in live:
                    st.add_copies(bm.append_slots(s, lookahead))
                out.decode_seq_groups.append(ssg)
            budget.add_num_batched_tokens(g.request_id, n_tokens)
            budget.add_num_seqs(g.request_id, g.get_max_num_running_seqs())
            self._lora_add(g, st.curr_loras)
            self.running.append(g)
        remaining.extend(ranked)
        gone = recomputed | {g.request_id for g in out.infeasible_seq_groups}
        gone |= {ssg.seq_group.request_id for ssg in out.decode_seq_groups + out.prefill_seq_groups}
        self.swapped = deque(g for g in self.swapped if g.request_id not in gone)
        return out

    def _requeue_for_recompute(self, g: SequenceGroup, seqs: list[Sequence], st: _Step) -> int:
        """Free ``seqs``' blocks (GPU or CPU) and queue ``g`` to be prefilled again from its
        tokens (front of ``waiting`` at the end of the step). Returns the computed tokens
        dropped (summed over ``seqs``), also added to ``num_recomputed_tokens``."""
        dropped = 0
        for seq in seqs:
            dropped += seq.data.get_num_computed_tokens()
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.data.reset_state_for_recompute()
        self.block_manager.add_waiting(g)
        st.preempted.append(g)
        self.num_recomputed_tokens += dropped
        return dropped

    def _recompute_swapped(self, g: SequenceGroup, st: _Step) -> None:
        """Turn a swapped group into a recompute-preempted one. Counted as no new preemption
        (it was preempted when it was swapped out), but recorded: its tokens are recomputed."""
        dropped = self._requeue_for_recompute(g, g.get_seqs(SequenceStatus.SWAPPED), st)
        g.metrics.add_preemption(PreemptionRecord(st.now, "recompute", dropped), count=False)
        st.preempted_ids.add(g.request_id)

    # ------------------------------------------------------------------ waiting
    def _reserved_against(self, g: SequenceGroup, st: _Step) -> int:
        """Blocks this step's priority preemptions freed for waiting groups that strictly
        outrank ``g``: ``g`` may not grow into them."""
        return sum(cost for w, cost in st.reserved.values() if self.policy.outranks(st.now, w, g))

    def _passed_delay(self, now: float) -> bool:
        """Whether new prompts may be admitted this step (``delay_factor``; call once per
        step). Measures the last prompt step's latency when the previous step admitted
        prompts, then: True when the factor is 0, nothing waits or runs, or the oldest waiting
        group has waited more than ``delay_factor * last_prompt_latency`` seconds."""
        if self.prev_prompt:
            self.last_prompt_latency = now - self.prev_time
        self.prev_time, self.prev_prompt = now, False
        factor = self.scheduler_config.delay_factor
        if factor <= 0 or not self.waiting or not self.running:
            return True
        oldest = min(g.metrics.arrival_time for g in self.waiting)
        return now - oldest > factor * self.last_prompt_latency

    def _readmission_margin(self, g: SequenceGroup, plan) -> int:
        k = g.metrics.num_preemptions
        if k < THRASH_PREEMPTIONS or not self.running:
            return 0
        margin = len(self._live(g)) * min(k, MAX_MARGIN_FACTOR)
        return max(0, min(margin, plan.num_usable_blocks - plan.num_required_blocks))

    def _reclaim_backfill(self, budget: SchedulingBudget, st: _Step, enable_chunking: bool) -> None:
        """Backfill's guarantee: when the first waiting group (rank order) must wait for blocks
        or sequence slots but would fit once running groups admitted by backfill and ranked
        below it left, preempt the fewest of them (lowest-ranked first, by recompute) so it is
        admitted in this step. With chunking the step's decodes run before admissions, so the
        blocks they will take (a new block for each decoding sequence whose table is full) are
        counted against it. Nothing happens when even all of them would not make it fit, when
        its adapter would be deferred, or when new prompts are held back this step."""
        if not self._backfilled or not self.waiting or not st.passed_delay:
            return
        self._backfilled &= {g.request_id for g in self.running}
        if not self._backfilled:
            return
        now = st.now
        head = next(
            (
                g
                for g in self.policy.sort_by_priority(now, self.waiting)
                if g.request_id not in st.preempted_ids
            ),
            None,
        )
        if (
            head is None
            or not self._live(head)
            or not self._swapped_allows(head, st)
            or not self._lora_fits(head, self._running_loras())
            or head.get_max_num_running_seqs() > self.scheduler_config.max_num_seqs
        ):
            return
        bm = self.block_manager
        plan = bm.plan_allocation(head)
        if plan.status == AllocStatus.NEVER:
            return
        need_blocks = (
            plan.cost
            + bm.watermark_blocks
            + self._readmission_margin(head, plan)
            - bm.get_num_free_gpu_blocks()
        )
        growth: dict[str, int] = {}
        if enable_chunking:
            growth = {g.request_id: self._decode_growth(g) for g in self.running}
            need_blocks += sum(growth.values())
        need_seqs = budget.num_curr_seqs + head.get_max_num_running_seqs() - budget.max_num_seqs
        if need_blocks <= 0 and need_seqs <= 0:
            return
        candidates = [g for g in self.running if g.request_id in self._backfilled]
        ranked = list(self.policy.sort_by_priority(now, [head, *candidates]))
        chosen: list[SequenceGroup] = []
        gain_blocks = gain_seqs = 0
        for v in reversed(ranked):
            if v is head:
                break
            chosen.append(v)
            gain_blocks += bm.get_num_freeable_blocks(v) + growth.get(v.request_id, 0)
            gain_seqs += v.get_max_num_running_seqs()
            if gain_blocks >= need_blocks and gain_seqs >= need_seqs:
                break
        if gain_blocks < need_blocks or gain_seqs < need_seqs:
            return  # it waits for running groups ranked above the backfilled ones
        for v in chosen:
            self.running.remove(v)
            budget.subtract_num_seqs(v.request_id, v.get_max_num_running_seqs())
            self._backfilled.discard(v.request_id)
            self._preempt(v, st, PreemptionMode.RECOMPUTE, warn=False)
            self.num_backfill_reclaims += 1

    def _decode_growth(self, g: SequenceGroup) -> int:
        """New blocks a running group's plain decode takes this step (0 while prefilling)."""
        if g.is_prefill():
            return 0
        bm = self.block_manager
        return sum(
            max(0, -(-s.get_len() // bm.block_size) - len(bm.block_tables.get(s.seq_id, ())))
            for s in g.get_seqs(SequenceStatus.RUNNING)
        )

    def _reserved_first(self, ranked: deque[SequenceGroup], st: _Step) -> deque[SequenceGroup]:
        """``ranked`` with each group that preempted others this step moved ahead of the
        groups before it that it outranked when it did: the room it made is its own (under ``priority`` it
        leads them anyway; ``fair`` may order a flooding tenant's backlog ahead of it)."""
        out: list[SequenceGroup] = []
        for g in ranked:
            k = len(out)
            if g.request_id in st.reserved:
                over = st.reserved_over.get(g.request_id, set())
                while k and out[k - 1].request_id in over:
                    k -= 1
            out.insert(k, g)
        return deque(out)

    def _schedule_prefills(
        self, budget: SchedulingBudget, st: _Step, enable_chunking: bool
    ) -> SchedulerPrefillOutputs:
        """Admit groups from ``waiting`` in rank order.

        Rejects (``ignored_seq_groups``) prompts over ``prompt_limit`` and groups whose
        blocks can NEVER fit, without blocking the ones behind. Stops at the first group
        that must wait for blocks (LATER) or does not fit the budget. With chunking, a prompt
        that would stay mid-prefill is admitted only while fewer than
        ``max_num_partial_prefills`` are; otherwise it is skipped for prompts that complete.
        Under a rank policy a group skipped that way keeps the blocks it needs: the groups
        behind it (lower-ranked) are admitted only with what is left beyond them, so blocks
        freed by preempting for it never go to a group it outranks. A group whose adapter would
        exceed ``max_loras`` is deferred (left in place, holding nothing; vLLM V0's
        leftover-waiting rule) and the groups behind it are still considered.
        With backfill on, a group that must wait for blocks (or, without chunking, for the
        token budget) is passed instead of stopping the scan while it has been passed fewer
        than ``BACKFILL_MAX_BYPASSES`` times; a budget-blocked group's blocks and sequence
        slots are kept free for it.
        """
        out = SchedulerPrefillOutputs()
        if not self.waiting or not st.passed_delay:
            return out
        if (self.swapped or st.swapped_at_start) and not self.policy.preempts_by_rank:
            # Swapped groups resume before anything new is admitted, and not in the
            # step that swaps them back in either.
            return out
        bm = self.block_manager
        cfg = self.scheduler_config
        if budget.num_curr_seqs >= cfg.max_num_seqs or budget.remaining_token_budget() <= 0:
            return out  # nothing could be admitted (never-schedulable ones were rejected at add)
        ranked = self.policy.admission_order(st.now, self.waiting)
        if st.reserved:
            ranked = self._reserved_first(ranked, st)
        admitted: set[str] = set()
        ignored: set[str] = set()
        held = 0  # blocks kept for higher-ranked groups skipped above (rank policies only)
        # A group above was deferred too long: adapter groups queued at or after this point in
        # ``_lora_order`` (its first deferral) are held back for it; None: nobody starves.
        cutoff: int | None = None
        # Backfill: the groups passed that must wait, and the blocks and sequence slots kept
        # free for those passed only for want of token budget.
        passed: list[SequenceGroup] = []
        keep_blocks = keep_seqs = 0
        if len(self._bypasses) > len(self.waiting):
            live_ids = {g.request_id for g in self.waiting}
            self._bypasses = {k: v for k, v in self._bypasses.items() if k in live_ids}

        def pass_over(g: SequenceGroup) -> bool:
            """Whether backfill may go past ``g`` (else the scan stops at it)."""
            if not self.backfill or self._bypasses.get(g.request_id, 0) >= BACKFILL_MAX_BYPASSES:
                return False
            passed.append(g)
            return True

        if len(self._lora_deferrals) > len(self.waiting):
            live_ids = {g.request_id for g in self.waiting}
            self._lora_deferrals = {k: v for k, v in self._lora_deferrals.items() if k in live_ids}
        for g in ranked:
            rid = g.request_id
            if rid in st.preempted_ids:
                continue  # never re-admit what was preempted in this same step
            live = g.get_seqs(SequenceStatus.WAITING)
            if not live:
                # Nothing left to run (e.g. finished while waiting): drop it as ignored.
                bm.remove_waiting(g)
                ignored.add(rid)
                out.ignored_seq_groups.append(g)
                continue
            length = live[0].get_len()
            is_new = live[0].get_output_len() == 0
            if is_new and length > self.prompt_limit:
                self._ignore(
                    g,
                    f"prompt has {length} tokens > prompt_limit {self.prompt_limit}"
                    + (
                        f" (max_model_len {cfg.max_model_len})"
                        if self.prompt_limit == cfg.max_model_len
                        else f" (min of max_model_len {cfg.max_model_len} and "
                        f"max_num_batched_tokens {cfg.max_num_batched_tokens})"
                    ),
                )
                ignored.add(rid)
                out.ignored_seq_groups.append(g)
                continue
            if length > cfg.max_model_len:
                self._ignore(g, f"sequence has {length} tokens > max_model_len {cfg.max_model_len}")
                ignored.add(rid)
                out.ignored_seq_groups.append(g)
                continue
            if g.get_max_num_running_seqs() > cfg.max_num_seqs:
                self._ignore(
                    g, f"needs {g.get_max_num_running_seqs()} sequences > max_num_seqs {cfg.max_num_seqs}"
                )
                ignored.add(rid)
                out.ignored_seq_groups.append(g)
                continue
            if not self._swapped_allows(g, st):
                if not self.policy.preempts_by_rank:
                    break  # nothing is admitted while a group is swapped out: stop scanning
                # ranked after a swapped group; a group behind it in this order may not be
                # (``fair`` interleaves tenants by projected counter)
                continue
            if cutoff is not None and g.lora_int_id > 0 and self._lora_order.get(rid, cutoff) >= cutoff:
                continue  # keeps no slot busy while a starved group above waits for one
            if not self._lora_fits(g, st.curr_loras):
                # Deferred until one of the step's adapters leaves ``running``.
                n, mark = self._lora_deferrals.get(rid, (0, self._num_added))
                self._lora_deferrals[rid] = (n + 1, mark)
                if n + 1 > LORA_MAX_DEFERRALS:
                    cutoff = mark if cutoff is None else min(cutoff, mark)
                continue
            plan = bm.plan_allocation(g)
            if plan.status == AllocStatus.NEVER:
                self._ignore(
                    g,
                    f"needs {plan.num_required_blocks} KV blocks > "
                    f"{plan.num_usable_blocks} in the cache (block_size "
                    f"{bm.block_size}, {bm.num_total_gpu_blocks} blocks, watermark "
                    f"{bm.watermark_blocks})",
                )
                ignored.add(rid)
                out.ignored_seq_groups.append(g)
                continue
            if plan.status == AllocStatus.LATER:
                if pass_over(g):
                    continue
                break
            if held and bm.get_num_free_gpu_blocks() - plan.cost - held < bm.watermark_blocks:
                break  # what is free belongs to a higher-ranked group skipped above
            margin = self._readmission_margin(g, plan)
            if margin and bm.get_num_free_gpu_blocks() - plan.cost - bm.watermark_blocks < margin:
                if pass_over(g):
                    continue
                break
            if passed:
                if any(self._bypasses.get(p.request_id, 0) >= BACKFILL_MAX_BYPASSES for p in passed):
                    break  # a group passed has waited out its bound: the scan stops at it
                if (
                    keep_blocks
                    and bm.get_num_free_gpu_blocks() - plan.cost - keep_blocks < bm.watermark_blocks
                ) or budget.num_curr_seqs + g.get_max_num_running_seqs() + keep_seqs > cfg.max_num_seqs:
                    if pass_over(g):
                        continue
                    break
            n_live = len(live)
            uncomputed = length - plan.num_cached_tokens
            remaining = budget.remaining_token_budget()
            capped = False
            if enable_chunking or uncomputed * n_live > cfg.max_num_batched_tokens:
                chunk = min(uncomputed, remaining // n_live)
                if enable_chunking and chunk > self.long_prefill_token_threshold:
                    chunk, capped = self.long_prefill_token_threshold, True
                if chunk <= 0:
                    break
                partial = chunk < uncomputed
                if partial and enable_chunking and st.num_partial >= cfg.max_num_partial_prefills:
                    if self.policy.preempts_by_rank:
                        held += plan.cost
                    continue  # leave room for prompts that complete in this step
            else:
                chunk, partial = uncomputed, False
                if chunk * n_live > remaining:
                    if pass_over(g):
                        # it fits an empty step: its blocks and slots wait for the next one
                        keep_blocks += plan.cost
                        keep_seqs += g.get_max_num_running_seqs()
                        continue
                    break
            if not budget.can_schedule(
                num_new_tokens=chunk * n_live, num_new_seqs=g.get_max_num_running_seqs()
            ):
                break
            st.add_copies(bm.allocate(g, plan))
            for s in live:
                s.status = SequenceStatus.RUNNING
            ssg = ScheduledSequenceGroup(g, chunk)
            out.seq_groups.append(ssg)
            if capped:
                st.capped.append(ssg)
            if partial:
                st.num_partial += 1
            budget.add_num_batched_tokens(rid, chunk * n_live)
            budget.add_num_seqs(rid, g.get_max_num_running_seqs())
            admitted.add(rid)
            st.reserved.pop(rid, None)
            self._lora_deferrals.pop(rid, None)
            self._lora_add(g, st.curr_loras)
            self.running.append(g)
            self._bypasses.pop(rid, None)
            if passed:
                self._backfilled.add(rid)
                self.num_backfilled += 1
                for p in passed:
                    self._bypasses[p.request_id] = self._bypasses.get(p.request_id, 0) + 1
            else:
                self._backfilled.discard(rid)
        if admitted:
            self.prev_prompt = True
        if admitted or ignored:
            self.waiting = deque(
                g for g in self.waiting if g.request_id not in admitted and g.request_id not in ignored
            )
        return out
