"""``DynamicDraftPolicy``: the per-step draft lengths of ``SpeculativeConfig.dynamic``.

It turns a step's metadata (and, for a cheap proposer, its full proposals) into the
``goodput.allocate_draft_lengths`` problem, and learns from what the step cost and what was
accepted. It knows nothing of tensors: the ``SpecDecodeWorker`` times the forward and reports.

Per step the scheduler has reserved ``md.num_speculative_tokens`` lookahead slots per
speculating decode; the policy only decides how many of them to fill, so the scheduler, block
manager, rollback and prefix hashes are exactly as with a fixed k (a sequence given 0 drafts
is a plain decode whose slots go unused, as when the n-gram finds nothing).

A seeded sampled request (``seed`` set, temperature > 0) always gets its full proposal: its
draft lengths decide how its generator is consumed by rejection sampling, and lengths chosen
from this machine's timings would make the same seed give different text on another run.
Greedy output does not depend on the lengths at all.

A speculating sequence given no drafts is a skipped draft opportunity, with a reason
(``skip_reasons``, per step; the worker adds its own and the engine counts them by reason):
``goodput`` (no draft length was expected to raise the step's tokens per second: a low
acceptance estimate, or a draft model whose forwards cost about as much as the target's),
``measuring_plain_step`` (a plain step timed so drafts can be priced against it) or
``row_cap`` (the step's rows left no room for drafts). The first ``goodput`` or ``row_cap``
skip of a request is logged at INFO with the figures behind it and how to force drafts
(``speculative_config.dynamic=false``), at most one line per ``LOG_INTERVAL_S``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.spec_decode.goodput import (
    AcceptanceEstimator,
    DraftCandidate,
    StepCostModel,
    allocate_draft_lengths,
    expected_tokens,
    step_goodput,
)

if TYPE_CHECKING:
    from kvserve.sequence import ExecuteModelRequest, SequenceGroupMetadata
    from kvserve.spec_decode.interfaces import Proposal

logger = logging.getLogger("kvserve.spec_decode")

#: Reasons a speculating sequence gets no drafts from the policy (module docstring).
SKIP_GOODPUT = "goodput"
SKIP_MEASURING = "measuring_plain_step"
SKIP_ROW_CAP = "row_cap"

#: At most one "drafting off" INFO line per this many seconds (each request is named once);
#: the next line counts the requests left unnamed meanwhile.
LOG_INTERVAL_S = 10.0
#: Requests remembered as already named (the oldest are forgotten first).
_LOGGED_MAX = 10_000


def step_rows(metas: list[SequenceGroupMetadata]) -> int:
    """Query rows of a forward over ``metas`` (prefill chunk tokens, decode / verify chunks)."""
    return sum(max(1, md.token_chunk_size) * len(md.seq_data) for md in metas)


def base_rows(metas: list[SequenceGroupMetadata]) -> int:
    """Query rows of the step before any draft: prefill chunks plus one row per decode."""
    return sum((md.token_chunk_size if md.is_prompt else 1) * len(md.seq_data) for md in metas)


#: Samples of a batch's plain (draft-free) step the policy wants before it stops forcing
#: one every ``BASE_EVERY``-th decision at that batch; up to ``BASE_SAMPLES_MAX`` while the
#: two fastest still differ by more than ``BASE_AGREE`` (all were slowed by the host).
BASE_SAMPLES = 4
BASE_SAMPLES_MAX = 8
BASE_AGREE = 0.03
BASE_EVERY = 4


def decode_seqs(metas: list[SequenceGroupMetadata]) -> int:
    """Decoding sequences of a step (each emits at least one token)."""
    return sum(len(md.seq_data) for md in metas if not md.is_prompt)


def has_prompt(metas: list[SequenceGroupMetadata]) -> bool:
    """Whether the step holds a prompt chunk (the cost model's other step class)."""
    return any(md.is_prompt for md in metas)


def _pinned(md: SequenceGroupMetadata) -> bool:
    """Whether the group's draft lengths must not depend on timings (a seeded sampled request)."""
    params = md.sampling_params
    return params.seed is not None and not params.is_greedy


def _draft_cap(md: SequenceGroupMetadata, seq_output_len: int, k: int) -> int:
    """Most drafts a decode's sequence may get: its slots, ``k``, and no draft past
    ``max_tokens`` (it could never be emitted)."""
    m = min(k, md.num_speculative_tokens)
    max_tokens = md.sampling_params.max_tokens
    if max_tokens is not None:
        m = min(m, max_tokens - seq_output_len - 1)
    return max(0, m)


class DynamicDraftPolicy:
    """Chooses per-sequence draft lengths each step (see the module docstring).

    Args:
        k: ``num_speculative_tokens`` (the most drafts per sequence).
        cost_model: the step-cost model (default ``StepCostModel()``).
        estimator: the acceptance estimator (default ``AcceptanceEstimator()``).
        explore_interval: every this many steps that had candidates, one sequence's worth of
            drafts beyond the chosen allocation is added, so row counts the model has never seen
            get measured (0: never).
        warmup_steps: the first steps' times are not learned from (they include one-time
            costs: lazy initialisation, first-touch of the weights and the KV cache); nor are
            a costly proposer's first that many drafting calls (``observe_proposer``).
        margin: the drafts' modelled extra cost is counted ``1 + margin`` times
            (``allocate_draft_lengths``): a safety factor against the cost model's error.

    ``trace``: set to a list to get one dict per step (rows, seconds, and for steps with a
    decision the base rows, candidates, drafts chosen and the predicted costs): what the
    benchmarks print; None (default) records nothing.

    Counters (for metrics and benchmarks): ``num_decisions`` (steps with candidates),
    ``num_candidates`` (sequence-steps considered), ``num_chosen_drafts`` (drafts chosen).
    """

    def __init__(
        self,
        k: int,
        cost_model: StepCostModel | None = None,
        estimator: AcceptanceEstimator | None = None,
        explore_interval: int = 16,
        warmup_steps: int = 2,
        margin: float = 0.1,
    ):
        self.k = k
        self.cost_model = cost_model or StepCostModel()
        self.estimator = estimator or AcceptanceEstimator()
        self.explore_interval = explore_interval
        self._warmup_left = warmup_steps
        self._proposer_warmup_left = warmup_steps
        self.margin = margin
        # The cost signal: thread CPU time (set by the worker on CPU devices) or wall clock.
        self.use_cpu_time = False
        self.trace: list[dict] | None = None
        self._pending: dict | None = None
        self.depth_cost_s = 0.0  # seconds per draft position of a sequential proposer (EMA)
        self.num_decisions = 0
        self.num_candidates = 0
        self.num_chosen_drafts = 0
        self._match_len: dict[int, int | None] = {}  # seq_id -> class of this step's drafts
        #: most query rows a step may have with its drafts (None: no cap); the worker sets it
        #: to the rows past which the target's kernels change (``uniform_kernel_rows``)
        self.max_rows: int | None = None
        #: this step's candidates given no drafts: seq_id -> reason (``SKIP_*``)
        self.skip_reasons: dict[int, str] = {}
        #: how the log names the proposer (the worker sets it: "draft model", "ngram")
        self.proposer_label = "draft model"
        self._logged: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._unlogged: set[str] = set()
        self._last_log = float("-inf")

    def _allocate(
        self, metas: list[SequenceGroupMetadata], cands: list[DraftCandidate], pinned_rows: int = 0
    ) -> dict[int, int]:
        self.num_decisions += 1
        self.num_candidates += len(cands)
        base = base_rows(metas) + pinned_rows
        prefill = has_prompt(metas)
        cm = self.cost_model

        def cost(rows: int) -> float:
            return cm.cost(rows, prefill)

        # Tokens the step emits without drafts: one per decoding sequence. A step with a
        # prompt chunk is valued at the decode-only rate (its prompt work is paid anyway):
        # a draft there must buy tokens faster than a plain decode step does.
        n_dec = decode_seqs(metas)
        tokens: float = float(max(n_dec, len(cands)))
        if prefill and n_dec > 0:
            tokens = cost(base) * n_dec / cm.cost(n_dec, False)
        depth = self.depth_cost_s
        cap = None if self.max_rows is None else max(0, self.max_rows - base)
        seen = getattr(cm, "max_observed_rows", None)
        if seen is not None:
            # Ramp up: at most a quarter of the plain step's rows (or one sequence's drafts)
            # past the most rows timed so far, or past the plain step. The cost model only
            # extrapolates above what it has seen: a cold start that drafted for every
            # sequence at once would pay for a step many times the plain one where rows are
            # dear, and even a doubling per step lets one noisy early fit draft far too many.
            ramp = max(seen(prefill), base) + max(self.k, base // 4) - base
            cap = ramp if cap is None else min(cap, ramp)
        ks = allocate_draft_lengths(
            cands, base, cost, depth, max_total=cap, margin=self.margin, base_tokens=tokens
        )
        observed = getattr(cm, "is_observed", None)
        samples = getattr(cm, "num_samples", None)
        measuring = False
        if samples is not None and not prefill and self._base_unsettled(base):
            # Every draft is priced against the plain step of this batch, so that step must
            # be timed, more than once (one stalled sample can make drafts look free, and a
            # batch that always drafts never times it again): no drafts every BASE_EVERY-th
            # decision until it has BASE_SAMPLES samples, more while they disagree (a short
            # request's first steps still draft: a tight cache may give it lookahead slots
            # only then).
            if self.explore_interval > 0 and self.num_decisions % BASE_EVERY == 0:
                ks = {c.seq_id: 0 for c in cands}
                measuring = True
        elif (
            self.explore_interval > 0
            and self.num_decisions % self.explore_interval == 0
            and observed is not None
            and not observed(base + sum(ks.values()) + self.k, prefill)
        ):
            # Measure a row count the model has only extrapolated to (one sequence's drafts
            # more than the optimum), unless that is expected to cost more than a tenth of
            # the step's goodput (exploring then costs < 1% over explore_interval steps).
            more = allocate_draft_lengths(
                cands,
                base,
                cost,
                depth,
                max_total=cap,
                explore_extra=self.k,
                margin=self.margin,
                base_tokens=tokens,
            )
            g_best = step_goodput(cands, ks, base, cost, depth, tokens)
            if step_goodput(cands, more, base, cost, depth, tokens) >= 0.9 * g_best:
                ks = more
        self._note_skips(metas, cands, ks, measuring, cap, lambda: (base, cost, depth, tokens, n_dec))
        n = sum(ks.values())
        self.num_chosen_drafts += n
        if self.trace is not None:
            self._pending = {
                "base_rows": base,
                "prefill": prefill,
                "cands": [(c.max_drafts, round(c.p_accept, 3)) for c in cands],
                "drafts": n,
                "pred_base_s": cost(base),
                "pred_s": cost(base + n),
            }
        return ks

    def _note_skips(
        self,
        metas: list[SequenceGroupMetadata],
        cands: list[DraftCandidate],
        ks: dict[int, int],
        measuring: bool,
        cap: int | None,
        figures: Callable[[], tuple],
    ) -> None:
        """Record why each candidate given 0 drafts got none (``skip_reasons``) and name the
        first ``goodput`` / ``row_cap`` skip of each request in the log (``figures``: the step's
        ``(base rows, cost, depth cost, plain tokens, decodes)``, only evaluated to log)."""
        skipped = [c for c in cands if ks.get(c.seq_id, 0) == 0]
        if not skipped:
            return
        reason = (
            SKIP_MEASURING if measuring else SKIP_ROW_CAP if cap is not None and cap <= 0 else SKIP_GOODPUT
        )
        for c in skipped:
            self.skip_reasons[c.seq_id] = reason
        if reason == SKIP_MEASURING or not logger.isEnabledFor(logging.INFO):
            return
        request_of = {sid: md.request_id for md in metas for sid in md.seq_data}
        fresh = [c for c in skipped if request_of.get(c.seq_id) not in self._logged]
        if not fresh:
            return
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            self._unlogged.update(request_of.get(c.seq_id, "?") for c in fresh)
            return
        c = fresh[0]
        rid = request_of.get(c.seq_id, "?")
        self._last_log = now
        self._logged[rid] = None
        if len(self._logged) > _LOGGED_MAX:
            self._logged.popitem(last=False)
        self._unlogged.discard(rid)
        others = len(self._unlogged)
        self._unlogged.clear()
        base, cost, depth, tokens, n_dec = figures()
        if reason == SKIP_ROW_CAP:
            why = (
                f"the step's {base} rows leave no room for drafts under its cap of "
                f"{self.max_rows if self.max_rows is not None else base} rows"
            )
        else:
            m, ratio = self._best_uniform(cands, base, cost, depth, tokens)
            why = (
                f"the best draft length (k={m}) is expected to give {ratio:.2f}x the tokens/s of a plain "
                f"step, not above 1.0: acceptance {c.p_accept:.2f} per draft (estimated), {n_dec} decodes "
                f"in the batch, plain step {cost(base) * 1e3:.1f} ms, draft proposer "
                f"{depth * 1e3:.1f} ms per position, drafts' extra target cost counted {1 + self.margin:.2f}x"
            )
        logger.info(
            "%s: drafting off for request %s: %s; set speculative_config.dynamic=false to force up to "
            "num_speculative_tokens=%d drafts every step%s",
            self.proposer_label,
            rid,
            why,
            self.k,
            f" ({others} more requests had drafting off since the last such line)" if others else "",
        )

    def _best_uniform(
        self,
        cands: list[DraftCandidate],
        base: int,
        cost: Callable[[int], float],
        depth: float,
        tokens: float,
    ) -> tuple[int, float]:
        """``(m, ratio)``: the uniform draft length ``m`` (every candidate up to ``m``) with
        the best expected tokens/s relative to the plain step, costed as the allocator does
        (the drafts' extra target cost ``1 + margin`` times, the proposer ``depth`` per
        position)."""
        base_cost = max(cost(base), 1e-12)
        plain = tokens / base_cost
        best = (1, 0.0)
        for m in range(1, max((c.max_drafts for c in cands), default=0) + 1):
            ks = {c.seq_id: min(m, c.max_drafts) for c in cands}
            gain = sum(expected_tokens(c.p_accept, ks[c.seq_id]) - 1.0 for c in cands)
            t = base_cost + (1 + self.margin) * (cost(base + sum(ks.values())) - base_cost) + depth * m
            ratio = (tokens + gain) / max(t, 1e-12) / plain
            if ratio > best[1]:
                best = (m, ratio)
        return best

    def _base_unsettled(self, base: int) -> bool:
        """Whether the plain step of ``base`` rows needs more samples: fewer than
        ``BASE_SAMPLES``, or fewer than ``BASE_SAMPLES_MAX`` whose two fastest differ by more
        than ``BASE_AGREE`` (a host's stalls only add time, so two fast samples that agree
        are the step's own cost; stalled samples price it too high, and every draft then
        looks cheap against it)."""
        cm = self.cost_model
        n = cm.num_samples(base, False)
        if n < BASE_SAMPLES:
            return True
        if n >= BASE_SAMPLES_MAX:
            return False
        fastest = getattr(cm, "fastest", None)
        if fastest is None:
            return False
        two = fastest(base, 2, False)
        return len(two) == 2 and two[1] > two[0] * (1 + BASE_AGREE)

    def cut_proposals(
        self, metas: list[SequenceGroupMetadata], proposals: dict[int, Proposal]
    ) -> dict[int, Proposal]:
        """For a cheap proposer: cut the step's full proposals to the chosen lengths
        (sequences given 0 drafts are left out: they decode plainly)."""
        from kvserve.spec_decode.interfaces import Proposal

        self.skip_reasons = {}
        cands: list[DraftCandidate] = []
        out: dict[int, Proposal] = {}
        pinned_rows = 0
        for md in metas:
            if md.is_prompt or md.num_speculative_tokens < 1:
                continue
            for sid, data in md.seq_data.items():
                p = proposals.get(sid)
                if p is None or not p.token_ids:
                    continue
                self._match_len[sid] = p.match_len
                if _pinned(md):
                    out[sid] = p
                    pinned_rows += len(p.token_ids)
                    continue
                cap = min(len(p.token_ids), _draft_cap(md, data.get_output_len(), self.k))
                if cap < 1:
                    continue
                cands.append(DraftCandidate(sid, cap, self.estimator.estimate(sid, p.match_len)))
        if not cands:
            return out
        ks = self._allocate(metas, cands, pinned_rows)
        for sid, m in ks.items():
            if m > 0:
                p = proposals[sid]
                probs = p.probs[:m] if p.probs is not None else None
                out[sid] = Proposal(list(p.token_ids[:m]), probs, p.match_len)
        return out

    def limit_request(self, req: ExecuteModelRequest) -> ExecuteModelRequest:
        """For a costly proposer: the step's request with each speculating decode's
        ``num_speculative_tokens`` set to its chosen length (the group's largest; 0: no
        drafts this step). Blocks and slots are untouched (the scheduler reserved them)."""
        self.skip_reasons = {}
        metas = req.seq_group_metadata_list
        cands: list[DraftCandidate] = []
        pinned_rows = 0
        for md in metas:
            if md.is_prompt or md.num_speculative_tokens < 1:
                continue
            for sid, data in md.seq_data.items():
                cap = _draft_cap(md, data.get_output_len(), self.k)
                self._match_len[sid] = None
                if _pinned(md):
                    pinned_rows += cap
                elif cap >= 1:
                    cands.append(DraftCandidate(sid, cap, self.estimator.estimate(sid, None)))
        if not cands:
            return req
        ks = self._allocate(metas, cands, pinned_rows)
        new_metas = []
        for md in metas:
            if md.is_prompt or md.num_speculative_tokens < 1 or _pinned(md):
                new_metas.append(md)
                continue
            m = max((ks.get(sid, 0) for sid in md.seq_data), default=0)
            new_metas.append(
                md if m == md.num_speculative_tokens else dataclasses.replace(md, num_speculative_tokens=m)
            )
        return dataclasses.replace(req, seq_group_metadata_list=new_metas)

    # ------------------------------------------------------------------ learning
    def observe_step(
        self, rows: int, seconds: float, prefill: bool = False, cpu_seconds: float | None = None
    ) -> None:
        """A target forward (with its verification) of ``rows`` query rows took ``seconds``
        of wall-clock time and ``cpu_seconds`` of the calling thread's CPU time (learned
        instead when ``use_cpu_time``); ``prefill``: the step had a prompt chunk."""
        if self.trace is not None:
            entry = self._pending or {}
            entry.update(rows=rows, prefill=prefill, wall_s=seconds, cpu_s=cpu_seconds)
            self.trace.append(entry)
        self._pending = None
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        signal = cpu_seconds if self.use_cpu_time and cpu_seconds is not None else seconds
        self.cost_model.observe(rows, signal, prefill)

    def set_regime(self, regime: object) -> None:
        """The forwards from now on run under ``regime`` (the worker's thread count)."""
        set_regime = getattr(self.cost_model, "set_regime", None)
        if set_regime is not None:
            set_regime(regime)

    def observe_proposer(self, depth: int, seconds: float) -> None:
        """A costly proposer drafted ``depth`` positions (its sequential forwards) in
        ``seconds``. The first ``warmup_steps`` such calls are not learned from: a draft
        model's first forwards carry its one-time costs (and the catch-up of the prompt), and
        a first call taken as the per-position cost would price the draft far above its steady
        cost and switch drafting off for good (with no drafts, nothing is timed again)."""
        if depth >= 1 and seconds > 0:
            if self._proposer_warmup_left > 0:
                self._proposer_warmup_left -= 1
                return
            per = seconds / depth
            self.depth_cost_s = (
                per if self.depth_cost_s == 0.0 else self.depth_cost_s + 0.2 * (per - self.depth_cost_s)
            )

    def observe_verified(self, drafted: dict[int, int], accepted: dict[int, int]) -> None:
        """seq_id -> drafts verified this step, and -> how many were accepted."""
        for sid, m in drafted.items():
            self.estimator.observe(sid, self._match_len.get(sid), m, accepted.get(sid, 0))
        self._match_len.clear()
        if self.trace:
            self.trace[-1].update(
                verified=sum(drafted.values()), accepted=sum(accepted.get(s, 0) for s in drafted)
            )

    def free(self, seq_ids) -> None:
        """Forget ended sequences."""
        seq_ids = list(seq_ids)
        self.estimator.free(seq_ids)
        for sid in seq_ids:
            self._match_len.pop(sid, None)

    @property
    def mean_draft_length(self) -> float:
        """Drafts chosen per candidate sequence-step so far (0.0 before any)."""
        return self.num_chosen_drafts / self.num_candidates if self.num_candidates else 0.0
