"""Per-sequence grammar state and the step's token bitmask (the engine's side of constraints).

The engine owns one ``StructuredOutputManager``. A constrained sequence has one llguidance
matcher, created at ``add_request`` (from the compiler's cached template), copied when an
``n > 1`` request forks, advanced by every token the engine appends, and dropped when the
sequence ends. Nothing the scheduler does changes a sequence's output tokens (chunked prefill
and prefix caching only change how the prompt is computed; preemption by recompute re-runs the
prompt + output through the model, by swap moves its blocks), so the matcher is simply kept
across all of them: there is nothing to replay.

Each step, ``prepare_step`` starts filling one int32 bitmask ``[rows, ceil(V / 32)]`` for the
constrained rows of the step on a worker thread (llguidance computes masks without the GIL, in
parallel across matchers), so it overlaps the forward; each constrained group's
``SequenceGroupMetadata.token_bitmask`` gets a ``GroupBitmask`` view of its rows, which the
sampler reads (waiting for the fill) and applies in one batched pass.

A constrained group that speculates asks its ``GroupBitmask`` for ``verify_masks(drafts)``:
one job, queued on the same (single) grammar thread after the step's fill, cuts each
sequence's drafts at the first one its grammar does not allow (or after the one that
completes it) and fills one mask row per verified position (position ``i``: the matcher after
``drafts[:i]``), rolling the matcher back after. The forward runs meanwhile; the verify step
reads the rows (``VerifyMasks.get``). The matchers themselves only ever advance through
``accept_token``, over the tokens the engine emits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvserve.model_executor.layers.bitmask import bitmask_words
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.compiler import GrammarCompiler, grammar_error_message


class GrammarError(ValueError):
    """A constrained sequence's matcher rejected a token or is in an error state (a fault of
    that request only: the engine ends it ``failed`` with this message, no batch re-run)."""


class MaskStats:
    """Running totals of the mask work (for benchmarks and metrics; seconds of wall time).

    Attributes:
        steps: steps with at least one constrained row.
        rows: mask rows filled (one per constrained sequence and step, plus one per verified
            draft position of a speculating one).
        fill_s: time the worker thread spent filling masks (llguidance), overlapped with the forward.
        wait_s: time the step waited for a fill still running after the forward.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0
        self.fill_s = 0.0
        self.wait_s = 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "fill_s": self.fill_s, "wait_s": self.wait_s}


class StepBitmask:
    """One step's bitmask, int32 ``[rows, words]``, filled by a worker thread (and the step's
    verify-mask jobs, queued after it)."""

    def __init__(self, tensor: torch.Tensor, future: Future, stats: MaskStats | None = None):
        self.tensor = tensor
        self._future = future
        self._stats = stats
        self._verify_jobs: list[Future] = []

    def wait(self) -> None:
        """Block until the fill and every verify-mask job of the step are done (no matcher
        may advance before); re-raises the first exception."""
        futures = [self._future, *self._verify_jobs]
        if self._stats is not None and not all(f.done() for f in futures):
            t0 = time.perf_counter()
            try:
                for f in futures:
                    f.exception()
            finally:
                self._stats.wait_s += time.perf_counter() - t0
        for f in futures:
            f.result()


class VerifyMasks:
    """The mask rows of one constrained group's verify chunks (``GroupBitmask.verify_masks``).

    For the group's sequence ``j`` (``seq_data`` order) with drafts ``d_j``: ``allowed_j``,
    how many leading drafts the grammar allows (cut at the first it forbids, and after the one
    that completes it: the sequence ends there), and rows for positions ``0 .. allowed_j``.
    """

    def __init__(
        self,
        future: Future,
        tensor: torch.Tensor,
        starts: list[int],
        request_id: str,
        matchers: list,
        stats: MaskStats | None = None,
    ):
        self._future = future
        self._tensor = tensor
        self._starts = starts
        self.request_id = request_id
        self._matchers = matchers
        self._stats = stats

    def get(self, j: int) -> tuple[int, torch.Tensor]:
        """``(allowed_j, int32 [allowed_j + 1, words])`` for sequence ``j`` (waits for the job).

        A matcher in an error state does not raise here (that would fail the whole batch's
        forward): it allows no draft and its one row allows EOS only; the engine ends the group
        after the step (``StructuredOutputManager.faults``).

        Raises:
            GrammarError: the job failed (a matcher could not be rolled back).
        """
        if self._stats is not None and not self._future.done():
            t0 = time.perf_counter()
            try:
                self._future.exception()
            finally:
                self._stats.wait_s += time.perf_counter() - t0
        allowed: list[int] = self._future.result()
        start = self._starts[j]
        return allowed[j], self._tensor[start : start + allowed[j] + 1]


class GroupBitmask:
    """The bitmask rows of one scheduled group, one per sequence in ``seq_data`` order.

    Attributes:
        request_id: the group's request (for error messages).
    """

    def __init__(
        self,
        step: StepBitmask,
        start: int,
        count: int,
        request_id: str,
        matchers: list,
        manager: StructuredOutputManager | None = None,
    ):
        self._step = step
        self._start, self._count = start, count
        self.request_id = request_id
        self._matchers = matchers
        self._manager = manager

    def rows(self) -> torch.Tensor:
        """int32 ``[num_seqs, words]`` (waits for the step's fill).

        A matcher in an error state does not raise here (that would fail the whole batch's
        forward): its row allows EOS only, and the engine ends the group after the step
        (``StructuredOutputManager.faults``).
        """
        self._step.wait()
        return self._step.tensor[self._start : self._start + self._count]

    def fault(self) -> GrammarError | None:
        """The error of the first matcher of this group in an error state, else None."""
        for m in self._matchers:
            if m.is_error():
                return GrammarError(f"its grammar matcher failed: {grammar_error_message(m.get_error())}")
        return None

    def verify_masks(self, drafts: list[list[int]]) -> VerifyMasks:
        """Start checking ``drafts`` (one list per sequence, ``seq_data`` order; ``[]``: none)
        and filling their verify chunks' masks on the grammar thread; returns at once.

        Raises:
            ValueError: ``drafts`` does not have one list per sequence of the group.
        """
        if len(drafts) != self._count:
            raise ValueError(
                f"request {self.request_id}: {len(drafts)} draft lists for {self._count} sequences"
            )
        if self._manager is None:
            raise ValueError(f"request {self.request_id}: this bitmask has no manager to fill verify masks")
        return self._manager._verify_masks(self._step, self.request_id, self._matchers, drafts)


class StructuredOutputManager:
    """Matchers of the live constrained sequences, by sequence id.

    Args:
        compiler: the engine's ``GrammarCompiler`` (shared with the server's compile thread).
    """

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[int, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self.stats = MaskStats()

    # ---------------------------------------------------------------- lifecycle of a sequence
    def compile(self, params: StructuredOutputsParams) -> None:
        """Compile (or find cached) ``params``. Raises ValueError naming the field."""
        self.compiler.compile(params)

    def add_sequence(self, seq_id: int, params: StructuredOutputsParams) -> None:
        """Start a matcher for a new sequence. Raises ValueError naming the field."""
        self._matchers[seq_id] = self.compiler.new_matcher(params)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child continues from the parent's state (``n > 1``, before their first token)."""
        parent = self._matchers.get(parent_seq_id)
        if parent is not None:
            self._matchers[child_seq_id] = parent.deep_copy()

    def is_constrained(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def accept_token(self, seq_id: int, token_id: int) -> bool:
        """Advance the sequence's matcher by one appended token.

        Returns:
            True when the grammar is now complete (only EOS may follow): the engine ends the
            sequence. False otherwise, and for unconstrained sequences.
        Raises:
            GrammarError: the token is not allowed (the matcher is left in its error state).
        """
        m = self._matchers.get(seq_id)
        if m is None:
            return False
        if not m.consume_token(int(token_id)):
            raise GrammarError(
                f"its grammar does not allow token {token_id}: {grammar_error_message(m.get_error())}"
            )
        return m.is_stopped()

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def faults(self, metas) -> dict[int, GrammarError]:
        """``{index in metas: error}`` for the groups whose ``token_bitmask`` has a matcher in
        an error state (call after the step's fill): the engine ends exactly those."""
        out = {}
        for i, md in enumerate(metas):
            bitmask = getattr(md, "token_bitmask", None)
            if isinstance(bitmask, GroupBitmask):
                err = bitmask.fault()
                if err is not None:
                    out[i] = err
        return out

    @property
    def num_live(self) -> int:
        """Matchers held (one per live constrained sequence)."""
        return len(self._matchers)

    # ---------------------------------------------------------------- the step
    def prepare_step(self, metas) -> StepBitmask | None:
        """Attach a ``GroupBitmask`` to the metadata of every constrained group that samples this
        step and start filling the step's bitmask; returns it (``wait()`` before advancing any
        matcher), or None when no scheduled row is constrained."""
        entries: list[tuple[Any, list]] = []
        for md in metas:
            md.token_bitmask = None
            if not md.do_sample:
                continue
            ms = [self._matchers.get(sid) for sid in md.seq_data]
            if any(m is None for m in ms):
                continue
            entries.append((md, ms))
        if not entries:
            return None
        num_rows = sum(len(ms) for _, ms in entries)
        tensor = torch.empty(num_rows, bitmask_words(self.compiler.vocab_size), dtype=torch.int32)
        jobs: list[tuple[Any, int]] = []
        start = 0
        views = []
        for md, ms in entries:
            views.append((md, start, len(ms), ms))
            jobs.extend((m, start + j) for j, m in enumerate(ms))
            start += len(ms)
        future = self._thread_pool().submit(self._fill, jobs, tensor)
        step = StepBitmask(tensor, future, self.stats)
        self.stats.steps += 1
        self.stats.rows += num_rows
        for md, s, n, ms in views:
            md.token_bitmask = GroupBitmask(step, s, n, md.request_id, ms, self)
        return step

    def _verify_masks(
        self, step: StepBitmask, request_id: str, matchers: list, drafts: list[list[int]]
    ) -> VerifyMasks:
        starts, total = [], 0
        for d in drafts:
            starts.append(total)
            total += len(d) + 1
        # -1 (all allowed) where a row is never written: only positions past a cut, never read.
        tensor = torch.full((total, bitmask_words(self.compiler.vocab_size)), -1, dtype=torch.int32)
        # The pool has one thread: this job runs after the step's fill, which reads the same
        # matchers, and before any later step's.
        future = self._thread_pool().submit(self._fill_verify, matchers, drafts, starts, tensor)
        step._verify_jobs.append(future)
        self.stats.rows += total
        return VerifyMasks(future, tensor, starts, request_id, matchers, self.stats)

    def _fill_verify(
        self, matchers: list, drafts: list[list[int]], starts: list[int], tensor: torch.Tensor
    ) -> list[int]:
        from llguidance.numpy import (  # not llguidance.torch: see _fill
            fill_next_token_bitmask_par,
            fill_next_token_bitmask_par_with_draft_tokens,
        )

        t0 = time.perf_counter()
        try:
            allowed = [allowed_prefix(m, d) for m, d in zip(matchers, drafts)]
            # llguidance takes only non-empty drafts here; a sequence with none gets one row.
            with_drafts = [(m, s, d[:a]) for m, s, d, a in zip(matchers, starts, drafts, allowed) if a]
            plain = [(m, s) for m, s, a in zip(matchers, starts, allowed) if not a]
            if with_drafts:
                fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, tensor.numpy())
            if plain:
                fill_next_token_bitmask_par(self._executor, plain, tensor.numpy())
            return allowed
        finally:
            self.stats.fill_s += time.perf_counter() - t0

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
            return self._pool

    def _fill(self, jobs: list[tuple[Any, int]], tensor: torch.Tensor) -> None:
        # llguidance.numpy's fill writes through the array's pointer as the torch one does; the
        # torch module also builds a torch.compile kernel at import, which imports torch._dynamo:
        # seconds on the grammar thread while the first constrained step waits for its masks.
        from llguidance.numpy import fill_next_token_bitmask_par

        t0 = time.perf_counter()
        try:
            fill_next_token_bitmask_par(self._executor, jobs, tensor.numpy())  # shares the memory
        finally:
            self.stats.fill_s += time.perf_counter() - t0


def allowed_prefix(matcher: Any, drafts: list[int]) -> int:
    """How many leading ``drafts`` the matcher allows, stopping after one that completes the
    grammar (nothing is emitted after it). The matcher is left as it was.

    Raises:
        GrammarError: the matcher could not be rolled back (an llguidance fault).
    """
    n = 0
    for t in drafts:
        if matcher.is_stopped() or matcher.try_consume_tokens([int(t)]) != 1:
            break
        n += 1
    if n and not matcher.rollback(n):
        raise GrammarError(
            f"cannot roll the grammar matcher back by {n} tokens: {grammar_error_message(matcher.get_error())}"
        )
    return n
