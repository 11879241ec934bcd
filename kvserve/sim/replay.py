"""Replay timed requests through an ``LLMEngine``: the real one on the wall clock or the
simulated one on its virtual clock, with one loop, so both sides see the same inputs the same way.

The loop: add every request whose arrival time has come (``arrival_time`` = start + its
``arrival_s``, so queueing counts from the trace's time, not from when the loop noticed it),
``step()``, note the time each request's output grew, repeat; when nothing runs, wait for the
next arrival (sleep on the wall clock; jump on the virtual one). Requests are greedy with
``ignore_eos`` and ``max_tokens = output_len``, so both sides generate the same number of tokens.

With ``record_steps`` the loop also keeps a ``StepRecord`` per step (``kvserve.sim.step_record``:
the step's shape, wall times of the step, the executor call and the loop iteration, GC pauses):
what ``compare_steps`` sets against the cost model.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest
from kvserve.sim.step_record import StepRecord
from kvserve.sim.step_shape import StepShape, step_shape
from kvserve.workload.stats import summarize
from kvserve.workload.workload import BenchRequest

#: the statistics kept of each latency (seconds)
STAT_KEYS = ("mean", "p50", "p90", "p99")
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


@dataclass
class ReplayResult:
    """Per request (by ``BenchRequest.id``): arrival, first scheduled, token times (each
    output growth after a step), preemptions, outcome; plus run totals (seconds from start)."""

    arrival: dict[int, float] = field(default_factory=dict)
    first_scheduled: dict[int, float | None] = field(default_factory=dict)
    token_times: dict[int, list[float]] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    preemptions: dict[int, int] = field(default_factory=dict)
    outcome: dict[int, str] = field(default_factory=dict)
    rejected: int = 0
    duration_s: float = 0.0
    total_preemptions: int = 0
    num_steps: int = 0
    num_extrapolated_steps: int = 0  # simulated steps past the profiled shapes (0 for real runs)
    steps: list[StepRecord] = field(default_factory=list)  # with ``record_steps``


def decode_extent(req: ExecuteModelRequest) -> dict:
    """What the cost model's counts leave out of a step's decodes, for ``StepRecord``:
    ``max_context_len`` (the longest decode's KV positions; the decode attention splits work
    per sequence, so one long sequence can bound a step) and ``context_blocks`` (KV blocks the
    decodes read)."""
    longest, blocks = 0, 0
    for meta in req.seq_group_metadata_list:
        if meta.is_prompt:
            continue
        for sid, data in meta.seq_data.items():
            longest = max(longest, data.get_len())
            blocks += len((meta.block_tables or {}).get(sid, ()))
    return {"max_context_len": longest, "context_blocks": blocks}


def _torch_threads() -> int | None:
    try:
        import torch

        return int(torch.get_num_threads())
    except ImportError:  # pragma: no cover - torch is a dependency
        return None


class _StepTimer:
    """Wraps an engine's executor: the shape and wall time of the last ``execute_model``."""

    def __init__(self, inner, timer: Callable[[], float]) -> None:
        self.inner = inner
        self.timer = timer
        self.last: StepShape | None = None
        self.exec_s = 0.0
        self.extra: dict = {}

    def execute_model(self, req: ExecuteModelRequest):
        self.last = step_shape(req)
        self.extra = decode_extent(req)
        t0 = self.timer()
        try:
            return self.inner.execute_model(req)
        finally:
            self.exec_s += self.timer() - t0
            # the worker re-chooses its thread count every 20 s (after the call: it does so first)
            self.extra["num_threads"] = _torch_threads()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _GCTimer:
    """Seconds spent in Python's garbage collector while installed (``gc.callbacks``)."""

    def __init__(self, timer: Callable[[], float]) -> None:
        self.timer = timer
        self.total = 0.0
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self.timer()
        elif self._t0 is not None:
            self.total += self.timer() - self._t0
            self._t0 = None


def greedy_submit(engine, r: BenchRequest, arrival_time: float) -> None:
    """Queue ``r`` greedy with ``ignore_eos``, ``max_tokens = output_len`` and its tenant (the
    default ``submit`` of ``replay``)."""
    engine.add_request(
        str(r.id),
        {"prompt_token_ids": r.prompt_token_ids},
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0),
        arrival_time=arrival_time,
        tenant=r.tenant,
    )


#: queues one request on an engine at an arrival time (engine clock, seconds); raises
#: ValueError for a request the engine rejects
Submit = Callable[[object, BenchRequest, float], None]


def replay(
    engine,
    requests: Sequence[BenchRequest],
    clock: Callable[[], float],
    wait_until: Callable[[float], None],
    max_steps: int = 10_000_000,
    record_steps: bool = False,
    timer: Callable[[], float] = time.perf_counter,
    submit: Submit = greedy_submit,
) -> ReplayResult:
    """Run ``requests`` through ``engine`` (whose clock is ``clock``) until all have ended.

    ``submit`` queues each request when it arrives (default ``greedy_submit``); a request's
    ``num_tokens`` counts the tokens of all its samples, its token times those of the first.
    ``record_steps``: keep a ``StepRecord`` per step in ``ReplayResult.steps``, timed by
    ``timer`` (seconds; the executor is wrapped for the run and put back after).

    A request with ``after_id`` arrives ``arrival_s`` after that request's first token (after
    its end if it ends with none, e.g. rejected).

    Raises:
        RuntimeError: more than ``max_steps`` steps (a stuck engine), never a hang.
        ValueError: an ``after_id`` that names no request of the run, or a cycle of them.
    """
    if not record_steps:
        return _replay(engine, requests, clock, wait_until, max_steps, None, submit)
    st = _StepTimer(engine.executor, timer)
    gct = _GCTimer(timer)
    engine.executor = st
    gc.callbacks.append(gct)
    try:
        return _replay(engine, requests, clock, wait_until, max_steps, (st, gct), submit)
    finally:
        gc.callbacks.remove(gct)
        engine.executor = st.inner


def _replay(engine, requests, clock, wait_until, max_steps, rec, submit: Submit) -> ReplayResult:
    res = ReplayResult()
    pending = sorted((r for r in requests if r.after_id is None), key=lambda r: (r.arrival_s, r.id))
    # requests timed from another's first token, by that request's id
    deferred: dict[int, list[BenchRequest]] = {}
    ids = {r.id for r in requests}
    for r in requests:
        if r.after_id is not None:
            if r.after_id not in ids:
                raise ValueError(f"request {r.id}: after_id {r.after_id} is not a request of the run")
            deferred.setdefault(r.after_id, []).append(r)

    def release(rid: int, t: float) -> None:
        timed = [replace(d, arrival_s=t + d.arrival_s, after_id=None) for d in deferred.pop(rid, [])]
        pending[i:] = sorted([*pending[i:], *timed], key=lambda r: (r.arrival_s, r.id))

    t0 = clock()
    i = 0
    lens: dict[int, int] = {}
    # the engine's count is cumulative: an engine that ran (was profiled) before has some
    preempted0 = engine.get_kv_cache_stats()["num_preemptions"]
    open_rec: tuple[StepRecord, float, float] | None = None  # record, iteration start, gc then

    def close(now_t: float) -> None:
        # the iteration that stepped ends where the next one starts
        if open_rec is not None:
            r, start, gc0 = open_rec
            r.loop_s = now_t - start
            r.gc_s = rec[1].total - gc0
            res.steps.append(r)

    for _ in range(max_steps):
        if rec is not None:
            it_start = rec[0].timer()
            close(it_start)
            open_rec = None
        if i >= len(pending) and not engine.has_unfinished_requests():
            break
        now = clock()
        while i < len(pending) and t0 + pending[i].arrival_s <= now:
            r = pending[i]
            res.arrival[r.id] = pending[i].arrival_s
            try:
                submit(engine, r, t0 + r.arrival_s)
                res.token_times[r.id] = []
            except ValueError:
                res.rejected += 1
                res.outcome[r.id] = "rejected"
                release(r.id, now - t0)
            i += 1
        if not engine.has_unfinished_requests():
            if i < len(pending):  # else the last arrivals were all rejected: done
                wait_until(t0 + pending[i].arrival_s)
            continue
        if rec is not None:
            sched = engine.scheduler
            queues = (len(sched.waiting), len(sched.running), len(sched.swapped))
            rec[0].last, rec[0].exec_s = None, 0.0
            s0 = rec[0].timer()
        outs = engine.step()
        if rec is not None:
            step_s = rec[0].timer() - s0
            if rec[0].last is not None and not rec[0].last.is_empty:
                r = StepRecord(
                    rec[0].last, step_s, rec[0].exec_s, 0.0, 0.0, *queues, start_s=now - t0, **rec[0].extra
                )
                open_rec = (r, it_start, rec[1].total)
        res.num_steps += 1
        t = clock() - t0
        for o in outs:
            rid = int(o.request_id)
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            grew = n - lens.get(rid, 0)
            if rid in deferred and (n > 0 or o.finished):
                release(rid, t)
            if grew > 0:
                res.token_times[rid].extend([t] * grew)
                lens[rid] = n
            if o.finished:
                res.outcome[rid] = o.outcome
                res.num_tokens[rid] = sum(len(c.token_ids) for c in o.outputs)  # all n samples
                m = o.metrics
                res.preemptions[rid] = m.num_preemptions
                res.first_scheduled[rid] = (
                    None if m.first_scheduled_time is None else m.first_scheduled_time - t0
                )
    else:
        raise RuntimeError(f"replay did not finish within {max_steps} steps")
    if deferred:  # a cycle of after_id: none of them could arrive
        raise ValueError(
            f"requests {sorted(d.id for ds in deferred.values() for d in ds)} never arrived: after_id cycle"
        )
    if rec is not None:
        close(rec[0].timer())
    res.duration_s = clock() - t0
    res.total_preemptions = engine.get_kv_cache_stats()["num_preemptions"] - preempted0
    res.num_extrapolated_steps = int(getattr(engine.executor, "num_extrapolated_steps", 0))
    return res


def summarize_replay(res: ReplayResult) -> dict:
    """``{"ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s": {n, mean, p50, p90, p99, ...},
    "num_preemptions", "preempted_ids", "output_tok_s", "num_finished", "duration_s"}``.

    TTFT: first token - arrival; TPOT: (last token - first token) / (tokens - 1); ITL: every
    gap between successive token times of a request (0 within one multi-token step); e2e: last
    token - arrival; queue: first scheduled - arrival. Only finished requests count.
    """
    done = [rid for rid, o in res.outcome.items() if o == "finished"]
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    queue: list[float] = []
    for rid in done:
        tt = res.token_times.get(rid) or []
        if not tt:
            continue
        a = res.arrival[rid]
        ttft.append(tt[0] - a)
        e2e.append(tt[-1] - a)
        if len(tt) > 1:
            tpot.append((tt[-1] - tt[0]) / (len(tt) - 1))
            itl.extend(b - a_ for a_, b in zip(tt, tt[1:]))
        fs = res.first_scheduled.get(rid)
        if fs is not None:
            queue.append(fs - a)
    out_tokens = sum(res.num_tokens.get(rid, 0) for rid in done)
    return {
        "num_finished": len(done),
        "duration_s": res.duration_s,
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpot),
        "itl_s": summarize(itl),
        "e2e_s": summarize(e2e),
        "queue_s": summarize(queue),
        "num_preemptions": res.total_preemptions,
        "preempted_ids": sorted(rid for rid, k in res.preemptions.items() if k),
        "output_tok_s": out_tokens / res.duration_s if res.duration_s else 0.0,
        "num_steps": res.num_steps,
        "num_extrapolated_steps": res.num_extrapolated_steps,
    }


def wall_replay(
    engine, requests: list[BenchRequest], record_steps: bool = False, submit: Submit = greedy_submit
) -> ReplayResult:
    """``replay`` on the wall clock (the engine's own ``clock``), sleeping while idle;
    ``record_steps`` and ``submit`` as in ``replay`` (timed by ``time.perf_counter``)."""

    def wait_until(t: float) -> None:
        d = t - engine.clock()
        if d > 0:
            time.sleep(d)

    return replay(engine, requests, engine.clock, wait_until, record_steps=record_steps, submit=submit)


def simulated_engine(engine_configs: tuple, cost_model, vocab_size: int):
    """An ``LLMEngine`` on a ``SimulatedExecutor`` with copies of ``(model_config, cache_config,
    scheduler_config)`` -- e.g. the real engine's, block counts included -- and its virtual
    clock. Returns ``(engine, clock)``."""
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sim.cost_model import VirtualClock
    from kvserve.sim.executor import SimulatedExecutor
    from kvserve.sim.preemption_cost import CostModelPreemptionCost

    mc, cc, sc = (copy.deepcopy(c) for c in engine_configs)
    clock = VirtualClock()
    executor = SimulatedExecutor(
        vocab_size, cost_model, cache_config=cc, check_kv=False, strict=False, clock=clock
    )
    engine = LLMEngine(
        mc,
        cc,
        sc,
        executor=executor,
        clock=clock,
        vocab_size=vocab_size,
        preemption_cost=CostModelPreemptionCost(executor.cost_model),
    )
    return engine, clock


def sim_replay(
    engine_configs: tuple,
    cost_model,
    vocab_size: int,
    requests: list[BenchRequest],
    record_steps: bool = False,
    submit: Submit = greedy_submit,
) -> ReplayResult:
    """``replay`` on a simulated engine (``simulated_engine``); idle time is skipped.
    ``record_steps``: step records timed by the virtual clock (``step_s`` = the cost model's
    time of each step); ``submit`` as in ``replay``."""
    engine, clock = simulated_engine(engine_configs, cost_model, vocab_size)
    return replay(engine, requests, clock, clock.set, record_steps=record_steps, timer=clock, submit=submit)
