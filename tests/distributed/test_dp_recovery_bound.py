"""A data-parallel replica that never comes back (Ray's restarts used up, a node gone): its
recovery pinged it every second forever, and ``/health`` said nothing of it. Recovery is
bounded now: a replica not answering within ``recovery_timeout_s`` of being marked down is
dead for good (its actor killed, its pings stopped), the others keep serving, and ``/health``
answers 200 ``degraded`` naming each replica's state (503 once none is up). Fake replica
handles (no Ray runtime) and timeouts of a fraction of a second keep it fast."""

import asyncio
import time
import types

import pytest

pytest.importorskip("ray")

import ray

from kvserve.distributed.dp_engine import DataParallelAsyncEngine
from kvserve.distributed.router import RoundRobinRouter
from kvserve.engine.async_llm_engine import EngineDeadError
from tests.distributed.test_dp_engine_faults import FakeReplica, _collect, _Method

TIMEOUT_S = 0.3


class _Gone:
    """A ping that fails as a dead actor's does once ``armed`` (before: it answers ``pid``),
    counting the failed tries."""

    def __init__(self, hang: bool = False, pid: int = 100, armed: bool = True):
        self.calls, self.hang, self.pid, self.armed = 0, hang, pid, armed

    async def __call__(self):
        if not self.armed:
            return self.pid
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        raise ray.exceptions.ActorDiedError()


def _dead_replica(hang=False, pid=100):
    """A replica whose first stream dies before any output, and which never answers a ping
    from then on."""
    gone = _Gone(hang, pid, armed=False)

    def plan(rid):
        gone.armed = True
        return 0

    rep = FakeReplica(plan)
    rep.ping_fn = gone
    rep.ping = _Method(gone)
    return rep


def _engine(replicas, front=None, timeout_s=TIMEOUT_S):
    infos = [{"pid": 100 + i, "node": "n"} for i in range(len(replicas))]
    dp = DataParallelAsyncEngine(
        front,
        replicas,
        infos,
        RoundRobinRouter(len(replicas)),
        recovery_timeout_s=timeout_s,
        health_check_interval_s=0.01,
        health_check_timeout_s=30.0,
    )
    killed = []
    dp._ray = types.SimpleNamespace(exceptions=ray.exceptions, kill=lambda a, no_restart: killed.append(a))
    return dp, killed


async def _until(pred, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("hang", [False, True], ids=["ping-fails", "ping-hangs"])
def test_replica_that_never_comes_back_is_dead_after_the_recovery_timeout(hang):
    gone, ok = _dead_replica(hang), FakeReplica(lambda rid: None)
    dp, killed = _engine([gone, ok])

    async def main():
        t0 = time.monotonic()
        outs = await _collect(dp, "r1")  # died before output on replica 0: retried on 1
        assert outs[-1].finished and dp.num_retried == 1
        assert dp.replica_states() == ["recovering", "up"]
        await _until(lambda: dp.replicas[0].dead)
        took = time.monotonic() - t0
        assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 2.0
        calls = gone.ping_fn.calls
        await asyncio.sleep(0.2)
        assert gone.ping_fn.calls == calls  # no more pings
        # the rest keeps serving: every later request goes to replica 1 and finishes
        for k in range(4):
            assert (await _collect(dp, f"later{k}"))[-1].finished
        return calls

    calls = asyncio.run(main())
    assert dp.replica_states() == ["dead", "up"] and dp.is_alive()
    assert killed == [gone] and dp.replicas[0].recovering is None
    assert not hang or calls == 1  # a hanging ping is cut by the deadline, not its own 30 s
    assert dp.num_retried == 1 and [r.outstanding for r in dp.replicas] == [0, 0]


def test_every_replica_given_up_on_is_engine_dead_error():
    dp, killed = _engine([_dead_replica(), _dead_replica(pid=101)])

    async def main():
        with pytest.raises(EngineDeadError):
            await _collect(dp, "r1")
        await _until(lambda: all(r.dead for r in dp.replicas))

    asyncio.run(main())
    assert dp.replica_states() == ["dead", "dead"] and not dp.is_alive() and len(killed) == 2
    with pytest.raises(EngineDeadError, match="no data-parallel replica is up"):
        asyncio.run(_collect(dp, "r2"))


def test_recovery_left_pending_by_a_finished_batch_resumes_in_the_next_one():
    """``LLM.generate`` runs each batch on its own event loop, which cancels a recovery still
    pending when the batch ends: the replica then stayed down for good even once Ray had
    replaced it. The next batch resumes it (same deadline)."""
    flaky = FakeReplica(lambda rid: 0 if rid == "r1" else None)
    tries = {"n": 0}

    async def ping():
        tries["n"] += 1
        if tries["n"] < 3:
            raise ray.exceptions.ActorDiedError()
        return 4242

    flaky.ping = _Method(ping)
    dp, _ = _engine([flaky, FakeReplica(lambda rid: None)], timeout_s=60.0)
    dp.health_check_interval_s = 0.5  # the first batch ends before the third ping
    assert asyncio.run(_collect(dp, "r1"))[-1].finished
    assert dp.replica_states() == ["recovering", "up"]

    async def second():
        dp.health_check_interval_s = 0.01
        assert (await _collect(dp, "r2"))[-1].finished
        await _until(lambda: dp.replicas[0].healthy)

    asyncio.run(second())
    assert dp.replica_states() == ["up", "up"] and dp.replicas[0].pid == 4242


def test_health_reports_degraded_then_dead_replicas(tiny_llama_dir):
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from tests.server_harness import running_server

    front = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), num_gpu_blocks=16))
    first = _dead_replica()
    second = FakeReplica(lambda rid: None)
    second_ping = _Gone(pid=101, armed=False)
    second.ping = _Method(second_ping)
    dp, _ = _engine([first, second], front=front, timeout_s=0.5)
    with running_server(None, "dp", async_engine=dp) as srv, srv.http() as c:
        assert c.get("/health").json() == {"status": "ok"}
        body = {"model": "dp", "prompt": [5, 6, 7], "max_tokens": 4}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text  # retried on replica 1
        h = c.get("/health")
        assert h.status_code == 200 and h.json() == {"status": "degraded", "replicas": ["recovering", "up"]}
        deadline = time.monotonic() + 5
        while not dp.replicas[0].dead:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        h = c.get("/health")
        assert h.status_code == 200 and h.json() == {"status": "degraded", "replicas": ["dead", "up"]}
        assert c.post("/v1/completions", json=body).status_code == 200
        # the last replica goes too: 503 naming the states
        second.plan = lambda rid: 0
        second_ping.armed = True
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        deadline = time.monotonic() + 5
        while not dp.replicas[1].dead:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        h = c.get("/health")
        assert h.status_code == 503 and "replicas: dead, dead" in h.json()["error"]["message"]


def test_a_hung_replica_does_not_delay_the_others_health_checks():
    """The watcher pinged replicas one after another: a ping that hangs held every later
    replica's check for the whole ping timeout (30 s by default). All are pinged at once now:
    a replica that dies beside a hung one is marked down within a few intervals."""
    hung, dead = FakeReplica(lambda rid: None), FakeReplica(lambda rid: None)
    hung.ping = _Method(_Gone(hang=True))
    dead.ping = _Method(_Gone())
    dp, _ = _engine([hung, dead], timeout_s=60.0)
    dp.health_check_timeout_s = 5.0

    async def main():
        dp.start()
        try:
            t0 = time.monotonic()
            await _until(lambda: not dp.replicas[1].healthy, limit_s=2.0)
            return time.monotonic() - t0
        finally:
            dp._supervisor.cancel()

    took = asyncio.run(main())
    assert took < 2.0 and dp.replicas[0].healthy  # the hung one: still within its timeout


def test_a_cancelled_recovery_stops_whenever_the_cancel_lands():
    """Found by the test above taking 60 s (its recovery timeout): ``asyncio.wait_for`` (before
    Python 3.12) swallows a cancel that lands just as its ping fails, and the recovery took it
    for one more failed ping, pinging on until its deadline after ``shutdown`` (or the event
    loop's end) cancelled it. A cancel at any point of the retry loop must end it."""
    dead = _dead_replica()
    dead.ping_fn.armed = True  # every ping fails at once
    dp, _ = _engine([dead, FakeReplica(lambda rid: None)], timeout_s=60.0)
    r = dp.replicas[0]

    async def main():
        for ticks in range(8):  # cancel after 0..7 loop turns: inside wait_for and inside sleep
            r.down_since = dp._clock()
            task = asyncio.get_running_loop().create_task(dp._recover(r))
            for _ in range(ticks):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            assert task in done and task.cancelled(), f"recovery survived a cancel after {ticks} turns"
        assert dead.ping_fn.calls > 0

    asyncio.run(main())
