"""Parallel engines losing a process mid-step: the cases ``tests/distributed`` does not cover.

Covered there: a data-parallel replica killed while the server streams from it
(``test_dp_server``), replica deaths before/after output and dead engines in
``DataParallelAsyncEngine.generate`` (``test_dp_engine_faults``), a tensor-parallel peer killed
while the engine is idle (``test_tensor_parallel``, ``test_tp_server``, ``test_dp_tp_peer_death``)
and a fault inside the driver's forward (``test_tp_faults``). Here:

- offline data parallelism (``LLM.generate`` over replicas, ``run_batch``) with a replica dying
  mid-stream: its requests end ``failed`` naming the replica, keeping what they had streamed;
  the others finish; nothing stays outstanding (fake replica handles: no Ray runtime);
- a tensor-parallel peer rank killed inside a step while the server streams: every request in
  flight ends with an error event saying the engine is dead, then ``[DONE]``, in bounded time;
  ``/health`` answers 503; every block is free.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.config import SchedulerConfig
from kvserve.sampling_params import SamplingParams
from tests.golden import TEST_DEVICE


# ------------------------------------------------------------------------------ data parallel
class _Front:
    """The driver's front engine as ``run_batch`` uses it: token-id prompts, every one valid."""

    tokenizer = None
    scheduler_config = SchedulerConfig(max_model_len=64)  # truncate_prompt_tokens reads it

    @staticmethod
    def validate(ids, params):
        return params.max_tokens


def test_offline_data_parallel_replica_dying_mid_stream_fails_only_its_requests():
    pytest.importorskip("ray")
    from kvserve.distributed.dp_engine import run_batch
    from tests.distributed.test_dp_engine_faults import FakeReplica, _engine

    # replica 1 dies after streaming two outputs of every request it runs; replica 0 never
    dp = _engine([FakeReplica(lambda rid: None), FakeReplica(lambda rid: 2)])
    dp.engine = _Front()
    reqs = [
        (f"r{i}", {"prompt_token_ids": [1, 2, i]}, SamplingParams(max_tokens=4), 0, f"t{i % 2}")
        for i in range(6)
    ]
    outs = run_batch(dp, reqs)
    assert [o.request_id for o in outs] == [r[0] for r in reqs]
    # each request reached its replica with its tenant
    sent = {**dp.replicas[0].actor.tenants, **dp.replicas[1].actor.tenants}
    assert sent == {r[0]: r[4] for r in reqs}
    by_outcome: dict = {}
    for o in outs:
        by_outcome.setdefault(o.outcome, []).append(o)
    assert set(by_outcome) == {"finished", "failed"}, {k: len(v) for k, v in by_outcome.items()}
    for o in by_outcome["finished"]:
        assert o.outputs[0].token_ids == [0, 1, 2, 3] and o.error is None
    for o in by_outcome["failed"]:
        assert f"replica 1 died while running request {o.request_id}" in o.error, o.error
        assert o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == [0, 1]  # what streamed
    assert dp.num_in_flight == 0 and [r.outstanding for r in dp.replicas] == [0, 0]


# ------------------------------------------------------------------------------ tensor parallel
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU")
def test_tp_peer_killed_mid_step_ends_every_stream_with_engine_dead(tiny_llama_dir, monkeypatch):
    from kvserve.config import EngineArgs
    from kvserve.worker import tp_executor, worker
    from tests.faults.conftest import scheduled_together
    from tests.server_harness import running_server

    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")  # two ranks on 2 cores: one OpenMP thread each
    monkeypatch.setattr(worker, "PEER_SETTLE_S", 2.0)  # keep the test short: the bound, not its size
    monkeypatch.setattr(tp_executor, "STOP_GRACE_S", 1.0)
    args = EngineArgs(
        model=str(tiny_llama_dir),
        tensor_parallel_size=2,
        block_size=4,
        num_gpu_blocks=64,
        num_cpu_blocks=8,
        max_model_len=64,
    )
    with running_server(args, "tiny") as srv:
        peer = srv.engine.executor.peers._procs[0]
        runner = srv.engine.executor.runner

        class KilledMidStep:
            """The driver's model: on its third forward (a decode step of the batch) the peer
            rank dies after it took the step and before the driver's all-reduces."""

            def __init__(self, model):
                self._model, self.calls = model, 0

            def __getattr__(self, name):
                return getattr(self._model, name)

            def __call__(self, *args, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    os.kill(peer.pid, signal.SIGKILL)
                    peer.join(10)
                return self._model(*args, **kwargs)

        monkeypatch.setattr(runner, "model", KilledMidStep(runner.model))
        body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        bodies = [{**body, "prompt": [5 + i, 6, 7], "stream": i % 2 == 0} for i in range(4)]

        def post(b):
            return srv.http(timeout=120).post("/v1/completions", json=b)

        t = time.monotonic()
        with scheduled_together(srv, len(bodies)), ThreadPoolExecutor(len(bodies)) as pool:
            resps = list(pool.map(post, bodies))
        assert time.monotonic() - t < 60  # a hang waits out the 120 s collective timeout
        for b, r in zip(bodies, resps):
            if b["stream"]:
                lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert r.status_code == 200 and lines[-1] == "data: [DONE]", r.text[-500:]
                err = json.loads(lines[-2][6:])["error"]
                assert len(lines) > 2  # it had streamed tokens before the death
            else:
                assert r.status_code == 503, r.text
                err = r.json()["error"]
            # the driver's all-reduce fails first, but the reason names the peer that died
            assert err["code"] == "engine_dead", err
            assert f"tensor-parallel worker rank 1 (pid {peer.pid}) exited" in err["message"], err
        with srv.http() as h:
            assert h.get("/health").status_code == 503
        st = srv.engine.get_kv_cache_stats()
        assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
        assert not srv.engine.has_unfinished_requests() and srv.async_engine.num_in_flight == 0
    assert not peer.is_alive()
