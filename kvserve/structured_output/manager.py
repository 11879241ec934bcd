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
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.bitmask import bitmask_words
from kvserve.structured_output.compiler import GrammarCompiler


class GrammarError(ValueError):
    """A constrained sequence's matcher rejected a token or is in an error state (a fault of
    that request only)."""


class MaskStats:
    """Running totals of the mask work (for benchmarks and metrics; seconds of wall time).

    Attributes:
        steps: steps with at least one constrained row.
        rows: mask rows filled (one per constrained sequence and step: one sampled token each).
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
    """One step's bitmask, int32 ``[rows, words]``, filled by a worker thread."""

    def __init__(self, tensor: torch.Tensor, future: Future, stats: MaskStats | None = None):
        self.tensor = tensor
        self._future = future
        self._stats = stats

    def wait(self) -> None:
        """Block until the fill is done; re-raises its exception."""
        if self._stats is not None and not self._future.done():
            t0 = time.perf_counter()
            try:
                self._future.result()
            finally:
                self._stats.wait_s += time.perf_counter() - t0
        self._future.result()


class GroupBitmask:
    """The bitmask rows of one scheduled group, one per sequence in ``seq_data`` order.

    Attributes:
        request_id: the group's request (for error messages).
    """

    def __init__(self, step: StepBitmask, start: int, count: int, request_id: str, matchers: list):
        self._step = step
        self._start, self._count = start, count
        self.request_id = request_id
        self._matchers = matchers

    def rows(self) -> torch.Tensor:
        """int32 ``[num_seqs, words]`` (waits for the step's fill).

        Raises:
            GrammarError: a matcher of this group is in an error state.
        """
        self._step.wait()
        for m in self._matchers:
            if m.is_error():
                raise GrammarError(f"request {self.request_id}: grammar matcher error: {m.get_error()}")
        return self._step.tensor[self._start : self._start + self._count]


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
            raise GrammarError(f"sequence {seq_id}: token {token_id} violates the grammar: {m.get_error()}")
        return m.is_stopped()

    def free(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

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
            md.token_bitmask = GroupBitmask(step, s, n, md.request_id, ms)
        return step

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
            return self._pool

    def _fill(self, jobs: list[tuple[Any, int]], tensor: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        t0 = time.perf_counter()
        try:
            fill_next_token_bitmask_par(self._executor, jobs, tensor)
        finally:
            self.stats.fill_s += time.perf_counter() - t0
