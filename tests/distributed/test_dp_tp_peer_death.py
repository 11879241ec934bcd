"""DP=2 x TP=2 behind one endpoint: one replica's tensor-parallel peer rank is killed. That
replica's engine can run no more steps, so it counts as a dead replica: requests go to the
other one (none is answered 503 while a replica is up), and Ray replaces it with a fresh
process (new peer ranks) that serves again."""

import os
import signal
import time

import pytest

from tests.distributed.test_dp_server import API_KEY, MODEL, _engine_args
from tests.server_harness import running_server

# a Ray runtime and four engine processes on 2 shared cores
pytestmark = pytest.mark.slow


def _peer_pids(replica_pid: int) -> list[int]:
    import psutil

    kids = psutil.Process(replica_pid).children()
    return [p.pid for p in kids if "spawn_main" in " ".join(p.cmdline())]


def test_dp_replica_with_a_dead_peer_rank_is_replaced_and_requests_go_elsewhere(
    ray_runtime, tiny_llama_dir, monkeypatch
):
    from kvserve.distributed import start_data_parallel_engine

    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
    dp = start_data_parallel_engine(
        _engine_args(tiny_llama_dir, data_parallel_size=2, tensor_parallel_size=2, router="round-robin"),
        MODEL,
    )
    with running_server(None, MODEL, api_key=API_KEY, async_engine=dp) as s:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
        with s.http(timeout=60) as h:
            first = h.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            old_pid = dp.replicas[0].pid
            peers = _peer_pids(old_pid)
            assert len(peers) == 1, peers
            os.kill(peers[0], signal.SIGKILL)
            time.sleep(1.0)  # the replica's engine notices while idle
            for _ in range(4):  # round-robin: half of them would meet the sick replica
                r = h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            deadline = time.monotonic() + 300  # a fresh replica: Ray actor, torch, peer rank
            while not (dp.replicas[0].healthy and dp.replicas[0].pid != old_pid):
                assert time.monotonic() < deadline, "the sick replica was never replaced"
                time.sleep(0.5)
            assert dp.replicas[0].restarts >= 1
            # the fresh replica serves
            routed = dp.replicas[0].routed
            for _ in range(2):
                assert h.post("/v1/completions", json=body).status_code == 200
            assert dp.replicas[0].routed > routed
    dp.shutdown()
