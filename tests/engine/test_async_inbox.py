"""The async engine's inbox: aborts are applied in batches, in inbox order.

A dropped client whose request had a batch of N prompts queues N aborts; applying them one
``abort_request`` call at a time scans the scheduler's queues N times (O(N^2)): with 20k prompts
the engine thread was busy for minutes and every other request waited."""

from __future__ import annotations

import asyncio

from kvserve.engine.async_llm_engine import AsyncLLMEngine
from kvserve.sampling_params import SamplingParams
from tests.core.simutil import Harness, configs, prompt_of


def _engine():
    cc, sc = configs(BS=4, G=64, S=8, T=64, L=64)
    h = Harness(cc, sc)
    ae = AsyncLLMEngine(h.engine)
    ae._loop = asyncio.new_event_loop()
    return h.engine, ae


def _count_scans(engine):
    calls = []
    orig = engine.scheduler.abort_seq_group

    def spy(ids):
        calls.append(ids)
        return orig(ids)

    engine.scheduler.abort_seq_group = spy
    return calls


def test_many_queued_aborts_cost_one_scan_of_the_queues():
    engine, ae = _engine()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    n = 2000
    for i in range(n):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_of(i, 5)}, params)
    calls = _count_scans(engine)
    for i in range(n):
        ae.abort(f"r{i}")
    ae._drain_inbox()
    assert len(calls) == 1
    assert engine.get_num_unfinished_requests() == 0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(f"r{i}" for i in range(n))
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    st = engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
    ae._loop.close()


def test_aborts_and_adds_keep_their_inbox_order():
    engine, ae = _engine()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    loop = ae._loop
    engine.add_request("old", {"prompt_token_ids": prompt_of(1, 5)}, params)
    ae.abort("old")
    ae.abort("new")  # before its add: must not touch the request added after it
    accepted = loop.create_future()
    ae._inbox.put(("add", "new", {"prompt_token_ids": prompt_of(2, 5)}, params, 0, accepted))
    ae.abort("later")
    accepted2 = loop.create_future()
    ae._inbox.put(("add", "later", {"prompt_token_ids": prompt_of(3, 5)}, params, 0, accepted2))
    ae.abort("later")  # after its add: aborts it
    ae._drain_inbox()
    assert set(engine._groups) == {"new"}
    loop.close()


def test_submit_calls_keep_their_inbox_order():
    """A call (adapter load/unload) queued after an abort runs after it: an unload that
    follows a disconnected request's abort never finds that request still queued."""
    engine, ae = _engine()
    loop = ae._loop
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt_of(1, 5)}, params)
    ae.abort("r")
    fut = loop.create_future()
    ae._inbox.put(("call", lambda: "r" in engine._groups, (), fut))
    ae._drain_inbox()
    assert loop.run_until_complete(fut) is False
    loop.close()


def test_submit_runs_on_the_engine_thread_and_reports_errors():
    """``submit`` runs between steps on the engine thread; its result or exception reaches
    the caller; before ``start`` it runs at once."""
    import threading

    import pytest

    engine, ae = _engine()
    ae._loop.close()

    async def main():
        assert await ae.submit(lambda: threading.current_thread().name) == threading.current_thread().name
        ae.start()
        try:
            assert await ae.submit(lambda: threading.current_thread().name) == "kvserve-engine"

            def boom():
                raise ValueError("lora_path '/x' is not a directory.")

            with pytest.raises(ValueError, match="is not a directory"):
                await ae.submit(boom)
            assert await ae.submit(lambda a, b: a + b, 2, 3) == 5
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_executor_that_dies_stops_the_loop_and_fails_every_request_engine_dead():
    """An executor that can run no more steps (``dead_reason``: a tensor-parallel peer died)
    stops the loop: the requests in flight, one queued in the inbox meanwhile and every later
    one get ``EngineDeadError`` naming the cause (never a wait for an answer that cannot come);
    the blocks are freed."""
    from kvserve.engine.async_llm_engine import EngineDeadError

    engine, ae = _engine()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    reason: list[str] = []
    engine.dead_reason = lambda: reason[0] if reason else None  # type: ignore[method-assign]
    real_step = engine.step
    steps = [0]

    def step():
        # the peer dies after the second step, on the engine thread: a consumer-side trigger
        # would race the loop, which can run all 50 steps before the first stream is read
        out = real_step()
        steps[0] += 1
        if steps[0] == 2:
            reason.append("tensor-parallel worker rank 1 (pid 7) exited with code -9")
        return out

    engine.step = step  # type: ignore[method-assign]

    async def main():
        ae.start(asyncio.get_running_loop())
        results: dict[str, object] = {}

        async def run(rid):
            try:
                async for _ in ae.generate({"prompt_token_ids": prompt_of(3, 5)}, params, rid):
                    pass
                results[rid] = "finished"
            except EngineDeadError as e:
                results[rid] = str(e)

        await asyncio.wait_for(asyncio.gather(run("first"), run("second")), 10)
        await asyncio.wait_for(run("later"), 10)
        return results

    loop = ae._loop
    ae._loop = None
    try:
        results = asyncio.run(main())
    finally:
        loop.close()
    assert set(results) == {"first", "second", "later"}
    assert all("rank 1 (pid 7)" in str(v) for v in results.values()), results
    assert isinstance(ae.errored, EngineDeadError)
    ae._thread.join(5)
    assert not ae._thread.is_alive()
    assert engine.get_num_unfinished_requests() == 0
    st = engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]


def test_arrival_is_stamped_when_generate_is_called_not_when_the_inbox_drains():
    """A request that waits in the inbox while a step runs counts that wait in its TTFT and
    queue time (what its client sees), so the clock is read in ``generate``."""
    engine, ae = _engine()
    loop = ae._loop
    clock = engine.clock  # the harness's virtual clock (callable)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    stream = ae.generate({"prompt_token_ids": prompt_of(1, 5)}, params, "r")
    first = loop.create_task(stream.__anext__())
    loop.run_until_complete(asyncio.sleep(0))  # generate has queued its add
    called_at = engine.clock()
    clock.advance(2.5)  # a step runs meanwhile
    ae._drain_inbox()
    assert engine._groups["r"].metrics.arrival_time == called_at
    first.cancel()
    loop.run_until_complete(asyncio.gather(first, return_exceptions=True))
    loop.close()
