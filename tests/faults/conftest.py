"""Fault injection shared by the tests of this folder: one tiny random-Llama engine offline and
one served over HTTP, the places a fault is injected, and the check that nothing is left behind.

A fault is aimed at one request by its prompt: a request whose prompt holds ``POISON`` is the
one whose forward rows, sampling, detokenization, stop check or grammar work raises (the forward
and sampler hooks are those of ``tests/engine/test_step_faults_real_model.py``).
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvserve.structured_output import manager as so_manager
from tests.engine.test_step_faults_real_model import POISON, PoisonedModel, poisoned_sampler

#: The engine of every test here: room for all the neighbours at once (no preemption unless a
#: test asks for it), several requests per step.
ENGINE_KWARGS = dict(
    block_size=4,
    num_gpu_blocks=96,
    num_cpu_blocks=16,
    max_model_len=128,
    max_num_batched_tokens=128,
    max_num_seqs=16,
    watermark=0.0,
)

#: Where a fault is injected (``inject``). ``forward_once`` is a transient fault of the whole
#: step (no request is at fault); the others raise for the poisoned request's part only.
SITES = [
    "forward",
    "forward_once",
    "sampler",
    "detokenizer",
    "stop_checker",
    "grammar_fill",
    "grammar_matcher",
]

#: A constraint the tiny random model can always satisfy.
REGEX = "[a-z ]{1,40}"


def poisoned_seq_ids(engine) -> set[int]:
    """Sequence ids of the live requests whose prompt holds ``POISON``."""
    return {
        s.seq_id for g in list(engine._groups.values()) if POISON in g.prompt_token_ids for s in g.get_seqs()
    }


def inject(site: str, engine, monkeypatch) -> None:
    """Make ``site`` raise for the poisoned request (``forward_once``: the first forward after
    two more, for whichever batch is running). Undone by ``monkeypatch.undo()``."""
    runner = engine.executor.runner
    if site == "forward":
        monkeypatch.setattr(runner, "model", PoisonedModel(runner.model))
    elif site == "forward_once":
        monkeypatch.setattr(runner, "model", _FailsOnce(runner.model, at_call=3))
    elif site == "sampler":
        monkeypatch.setattr(runner, "sampler", poisoned_sampler(runner.sampler))
    elif site == "detokenizer":
        real = engine.detokenizer.decode_last_token

        def decode_last_token(seq, skip_special_tokens=True):
            if POISON in seq.data.prompt_token_ids:
                raise RuntimeError("poisoned detokenizer")
            return real(seq, skip_special_tokens)

        monkeypatch.setattr(engine.detokenizer, "decode_last_token", decode_last_token)
    elif site == "stop_checker":
        real_stop = engine.stop_checker.maybe_stop

        def maybe_stop(seq, params, new_text, max_tokens):
            if POISON in seq.data.prompt_token_ids:
                raise RuntimeError("poisoned stop checker")
            return real_stop(seq, params, new_text, max_tokens)

        monkeypatch.setattr(engine.stop_checker, "maybe_stop", maybe_stop)
    elif site == "grammar_fill":
        real_fill = so_manager.StructuredOutputManager._fill

        def _fill(self, jobs, tensor):
            # on the grammar thread, while the engine thread runs the forward
            bad = {id(m) for sid, m in list(self._matchers.items()) if sid in poisoned_seq_ids(engine)}
            if any(id(m) in bad for m, _ in jobs):
                raise RuntimeError("poisoned grammar mask fill")
            return real_fill(self, jobs, tensor)

        monkeypatch.setattr(so_manager.StructuredOutputManager, "_fill", _fill)
    elif site == "grammar_matcher":
        real_accept = so_manager.StructuredOutputManager.accept_token

        def accept_token(self, seq_id, token_id):
            if seq_id in poisoned_seq_ids(engine):
                raise so_manager.GrammarError(f"sequence {seq_id}: poisoned grammar matcher")
            return real_accept(self, seq_id, token_id)

        monkeypatch.setattr(so_manager.StructuredOutputManager, "accept_token", accept_token)
    else:
        raise ValueError(f"unknown fault site {site!r}")


class _FailsOnce:
    """The runner's model, raising once on its ``at_call``-th forward (a transient fault)."""

    def __init__(self, model, at_call: int):
        self._model = model
        self._calls = 0
        self._at = at_call
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        with self._lock:
            self._calls += 1
            fail = self._calls == self._at
        if fail:
            raise RuntimeError("transient forward fault")
        return self._model(*args, **kwargs)


def assert_nothing_left(engine) -> None:
    """No request, sequence, matcher or KV block (GPU or CPU) is held after a run."""
    st = engine.get_kv_cache_stats()
    assert not engine.has_unfinished_requests(), list(engine._groups)
    assert not engine._groups and not engine._max_tokens
    sched = engine.scheduler
    assert not sched.waiting and not sched.running and not sched.swapped
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"], st
    assert st["num_free_cpu_blocks"] == st["num_cpu_blocks"], st
    bm = sched.block_manager
    assert not bm.block_tables, sorted(bm.block_tables)
    bm.check_invariants()
    if engine._structured is not None:
        assert engine._structured.num_live == 0


@contextlib.contextmanager
def scheduled_together(server, n: int, timeout: float = 60.0):
    """Inside the block, the served engine runs no step until ``n`` requests are queued (or
    ``timeout`` s pass), so requests sent at once from several threads share their steps, as
    ``LLM.generate``'s do; the engine thread keeps taking requests meanwhile. Yields an event
    that opens the gate early when set."""
    engine = server.engine
    real_step = engine.step
    deadline = time.monotonic() + timeout
    opened = threading.Event()  # stays open once all ``n`` are in, as the first ones finish

    def step():
        if not opened.is_set():
            if len(engine._groups) < n and time.monotonic() < deadline:
                time.sleep(0.002)
                return []
            opened.set()
        return real_step()

    engine.step = step
    try:
        yield opened
    finally:
        del engine.step  # the class's method again


@pytest.fixture(scope="module")
def fault_llm(tiny_llama_dir):
    from kvserve import LLM

    llm = LLM(model=str(tiny_llama_dir), seed=0, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def fault_server(tiny_llama_dir):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), seed=0, **ENGINE_KWARGS), "tiny", shutdown_grace_s=2.0
    ) as s:
        yield s
