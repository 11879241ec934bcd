"""TP=2 engine lifecycle under careless use: an abort mid-stream, a request that fails
validation, shutdown twice, and an LLM dropped without shutdown: the engine keeps serving,
every request ends, and no peer process outlives its engine."""

from __future__ import annotations

import gc
import time

import psutil
import pytest

from kvserve import LLM, SamplingParams
from tests.engine.test_e2e_tiny import assert_idle
from tests.golden import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU")

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=32, num_cpu_blocks=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")


def _children() -> set[int]:
    """Child processes started by multiprocessing's spawn (how the TP peers start), less its
    resource tracker (it lives as long as this interpreter, whatever the engine does). Not
    the session's Ray runtime (its raylet starts and reaps workers on its own schedule) nor
    the background kernel builds (a python -c and its compilers, started at any time)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def _wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    deadline = time.time() + timeout
    alive = set(pids)
    while alive and time.time() < deadline:
        alive = {
            p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        }
        time.sleep(0.1)
    return alive


def test_tp2_abort_bad_request_and_double_shutdown(tiny_llama_dir):
    before = _children()
    llm = LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE)
    peers = _children() - before
    assert peers == {p.pid for p in llm.llm_engine.executor.peers._procs}
    try:
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        eng = llm.llm_engine
        eng.add_request("keep", PROMPTS[0], GREEDY)
        eng.add_request("cut", PROMPTS[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        ends = {}
        for step in range(200):
            if not eng.has_unfinished_requests():
                break
            if step == 2:
                eng.abort_request("cut")
            for out in eng.step():
                if out.finished:
                    ends[out.request_id] = out
        assert ends["cut"].outcome == "aborted" and len(ends["cut"].outputs[0].token_ids) < 50
        assert ends["keep"].outcome == "finished" and ends["keep"].outputs[0].token_ids == ref[0]
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=-1), use_tqdm=False)
        with pytest.raises(ValueError):
            llm.generate([{"prompt_token_ids": [10**9]}], GREEDY, use_tqdm=False)
        assert_idle(eng)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
    finally:
        llm.shutdown()
    llm.shutdown()  # a second shutdown is a no-op, not an error or a hang
    assert not _wait_gone(peers), "peer ranks outlived shutdown"


def test_tp2_llm_dropped_without_shutdown_stops_its_peers(tiny_llama_dir):
    before = _children()
    llm = LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE)
    peers = _children() - before
    assert peers == {p.pid for p in llm.llm_engine.executor.peers._procs}
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    del llm
    gc.collect()
    assert not _wait_gone(peers), "peer ranks outlived their garbage-collected LLM"


def test_rank0_store_holds_its_port_from_the_start():
    """The driver's store is bound when its port is read (no window for another process to take
    the port before the rendezvous), two engines get two ports, and only rank 0 may host."""
    import socket

    from kvserve.worker.parallel_state import TensorParallelGroup, host_store

    a, b = host_store(2, 5.0), host_store(2, 5.0)
    assert a.port > 0 and b.port > 0 and a.port != b.port
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", a.port))
    with pytest.raises(ValueError, match="rank 0"):
        TensorParallelGroup(0, 2, a.port, "cpu", timeout_s=1.0)
    with pytest.raises(ValueError, match="rank 1"):
        TensorParallelGroup(1, 2, a.port, "cpu", timeout_s=1.0, store=a)
