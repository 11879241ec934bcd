"""``DataParallelAsyncEngine`` against fake replica handles (no Ray runtime: only Ray's
exception types): a replica that dies before any output has its request retried elsewhere, one
that dies after output ends it with ``ReplicaDiedError``, an invalid request's ``ValueError``
comes through unwrapped, and under random deaths every request ends one way with the
outstanding counts back at zero."""

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ray")

import ray

from kvserve.distributed.dp_engine import DataParallelAsyncEngine, ReplicaDiedError
from kvserve.distributed.router import RoundRobinRouter
from kvserve.engine.async_llm_engine import EngineDeadError
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams


def _out(rid, n, finished):
    return RequestOutput(
        rid,
        None,
        [1, 2],
        [CompletionOutput(0, "", list(range(n)), finish_reason="length" if finished else None)],
        finished,
    )


async def _value(v):
    return v


class _Stream:
    """What ``actor.generate.options(...).remote(...)`` returns: async iteration over
    awaitables; ``die_after`` outputs, then the actor's death (None: never)."""

    def __init__(self, rid, n_tokens, die_after, error=None):
        self.rid, self.n, self.die_after, self.error = rid, n_tokens, die_after, error

    async def __aiter__(self):
        if self.error is not None:
            raise self.error
        for i in range(self.n):
            if self.die_after is not None and i >= self.die_after:
                raise ray.exceptions.ActorDiedError()
            await asyncio.sleep(0)
            yield _value(_out(self.rid, i + 1, i == self.n - 1))


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **kw):
        return self

    def remote(self, *args):
        return self.fn(*args)


class FakeReplica:
    """A replica handle whose streams die per ``plan(request_id) -> die_after or None``."""

    def __init__(self, plan, n_tokens=4, error=None):
        self.plan, self.n, self.error = plan, n_tokens, error
        self.aborted = []
        self.tenants: dict[str, str | None] = {}  # request id -> the tenant it was sent with
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda rid: self.aborted.append(rid))
        self.ping = _Method(lambda: _value(4242))

    def _generate(self, prompt, params, rid, prio, tenant):
        self.tenants[rid] = tenant
        return _Stream(rid, self.n, self.plan(rid), self.error)


def _engine(replicas):
    infos = [{"pid": 100 + i, "node": "n"} for i in range(len(replicas))]
    return DataParallelAsyncEngine(None, replicas, infos, RoundRobinRouter(len(replicas)))


async def _collect(dp, rid):
    outs = []
    async for o in dp.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4), rid):
        outs.append(o)
    return outs


def test_death_before_output_is_retried_on_another_replica():
    dead, ok = FakeReplica(lambda rid: 0), FakeReplica(lambda rid: None)
    dp = _engine([dead, ok])

    async def main():
        outs = await _collect(dp, "r1")
        await asyncio.sleep(0)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert dp.num_retried == 1
    # marked down, then back once its replacement (a new pid) answered a ping
    assert dp.replicas[0].restarts == 1 and dp.replicas[0].pid == 4242 and dp.replicas[0].healthy
    assert [r.outstanding for r in dp.replicas] == [0, 0] and dp.num_in_flight == 0


def test_death_after_output_ends_the_request_with_replica_died_error():
    dp = _engine([FakeReplica(lambda rid: 2), FakeReplica(lambda rid: None)])

    async def main():
        got = []
        with pytest.raises(ReplicaDiedError, match="replica 0 died while running request r1"):
            async for o in dp.generate({"prompt_token_ids": [1]}, SamplingParams(), "r1"):
                got.append(o)
        return got

    got = asyncio.run(main())
    assert len(got) == 2  # what had streamed before the death
    assert dp.num_retried == 0 and dp.num_in_flight == 0
    # the next request avoids the dead replica
    assert asyncio.run(_collect(dp, "r2"))[-1].finished


def test_every_replica_dead_is_engine_dead_error():
    dp = _engine([FakeReplica(lambda rid: 0), FakeReplica(lambda rid: 0)])
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(dp, "r1"))
    with pytest.raises(EngineDeadError, match="no data-parallel replica is up"):
        asyncio.run(_collect(dp, "r2"))


def test_replica_value_error_comes_through_unwrapped():
    err = ray.exceptions.RayTaskError("generate", "tb", ValueError("max_tokens must be >= 1"))
    dp = _engine([FakeReplica(lambda rid: None, error=err)])
    with pytest.raises(ValueError, match="max_tokens must be >= 1") as e:
        asyncio.run(_collect(dp, "r1"))
    assert type(e.value) is ValueError
    assert dp.replicas[0].healthy


def test_consumer_that_stops_early_aborts_on_the_replica():
    rep = FakeReplica(lambda rid: None, n_tokens=10)
    dp = _engine([rep])

    async def main():
        gen = dp.generate({"prompt_token_ids": [1]}, SamplingParams(), "r1")
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(main())
    assert rep.aborted == ["r1"] and dp.num_in_flight == 0


def test_duplicate_request_id_is_refused():
    dp = _engine([FakeReplica(lambda rid: None, n_tokens=3)])

    async def main():
        gen = dp.generate({"prompt_token_ids": [1]}, SamplingParams(), "same")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(dp, "same")
        await gen.aclose()

    asyncio.run(main())


@settings(max_examples=40, deadline=None)
@given(
    n_replicas=st.integers(1, 3),
    n_requests=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    death_rate=st.floats(0.0, 0.6),
)
def test_random_replica_deaths_every_request_ends_one_way(n_replicas, n_requests, seed, death_rate):
    """Fuzz: streams die at random points; each request finishes in full, or ends with
    ``ReplicaDiedError`` after output, or ``EngineDeadError`` when nothing is left to try;
    nothing stays outstanding."""
    rng = random.Random(seed)
    plans = {}

    def plan_for(i):
        def plan(rid):
            key = (i, rid)
            if key not in plans:
                plans[key] = rng.randrange(4) if rng.random() < death_rate else None
            return plans[key]

        return plan

    dp = _engine([FakeReplica(plan_for(i)) for i in range(n_replicas)])

    async def one(k):
        got = []
        try:
            async for o in dp.generate({"prompt_token_ids": [k]}, SamplingParams(), f"r{k}"):
                got.append(o)
            return "finished" if got and got[-1].finished and len(got) == 4 else "cut"
        except ReplicaDiedError:
            return "died" if got else "bad"
        except EngineDeadError:
            return "dead"

    async def main():
        return await asyncio.gather(*(one(k) for k in range(n_requests)))

    results = asyncio.run(main())
    assert set(results) <= {"finished", "died", "dead"}, results
    assert [r.outstanding for r in dp.replicas] == [0] * n_replicas
    assert dp.num_in_flight == 0 and dp.num_waiting == 0
    if death_rate == 0.0:
        assert results == ["finished"] * n_requests


def test_num_waiting_counts_requests_without_output_yet():
    """The server's ``max_waiting`` check reads ``num_waiting``: sent, nothing back yet."""
    gate = asyncio.Event()

    class _Slow(_Stream):
        async def __aiter__(self):
            await gate.wait()
            async for ref in super().__aiter__():
                yield ref

    rep = FakeReplica(lambda rid: None, n_tokens=2)
    rep.generate = _Method(lambda prompt, params, rid, prio, tenant: _Slow(rid, 2, None))
    dp = _engine([rep])

    async def main():
        task = asyncio.ensure_future(_collect(dp, "w1"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert dp.num_waiting == 1 and dp.num_in_flight == 1
        gate.set()
        outs = await task
        assert outs[-1].finished and dp.num_waiting == 0 and dp.num_in_flight == 0

    asyncio.run(main())


def test_replica_whose_engine_died_is_marked_down_and_the_request_retried_elsewhere():
    """A replica process that is alive but whose engine can run no more steps (e.g. one of
    its tensor-parallel peer ranks died) answers ``EngineDeadError``: it is a dead replica
    (marked down, replaced) and a request that had streamed nothing runs on another one,
    instead of the endpoint answering 503 while a healthy replica is idle."""
    dead_engine = ray.exceptions.RayTaskError(
        "generate", "tb", EngineDeadError("tensor-parallel worker rank 1 (pid 7) exited with code -9")
    )
    sick, ok = FakeReplica(lambda rid: None, error=dead_engine), FakeReplica(lambda rid: None)
    dp = _engine([sick, ok])

    async def main():
        outs = await _collect(dp, "r1")
        await asyncio.sleep(0)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert dp.num_retried == 1
    assert dp.replicas[0].restarts == 1  # replaced (its ping answered with a new pid)
    assert [r.outstanding for r in dp.replicas] == [0, 0] and dp.num_in_flight == 0


def test_replica_ping_exits_the_process_when_its_engine_is_dead(monkeypatch):
    """The replica's liveness answer is its engine's: a dead engine loop ends the actor's
    process (exit code 70), so Ray starts a fresh replica (new peer ranks, empty cache)."""
    from kvserve.distributed import replica as replica_mod

    exits = []
    monkeypatch.setattr(replica_mod.os, "_exit", lambda code: exits.append(code))
    r = replica_mod.EngineReplica.__new__(replica_mod.EngineReplica)

    class _AE:
        errored = None

    r.async_engine = _AE()
    assert asyncio.run(r.ping()) == replica_mod.os.getpid() and exits == []
    r.async_engine.errored = EngineDeadError("rank 1 died")
    asyncio.run(r.ping())
    assert exits == [70]
