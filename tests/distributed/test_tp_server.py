"""The OpenAI server over a TP=2 engine: completions and streams equal the single-process
engine's greedy output; a bad request is still a 400; the peer ranks stop with the server."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from tests.golden import TEST_DEVICE
from tests.server_harness import running_server

pytestmark = [pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU"), pytest.mark.slow]

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=96)
PROMPTS = [[5, 17, 900, 31, 4000, 12], [77, 3, 1200, 8, 9], [3000, 41, 42, 43, 44, 45, 46, 47, 48]]


def test_tp2_server_completions_and_streams_equal_single_process(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
    one = LLM(model=str(tiny_llama_dir), **ENGINE)
    ref = [
        o.outputs[0].text
        for o in one.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    args = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE)
    with running_server(args, "tiny") as srv:
        procs = list(srv.engine.executor.peers._procs)
        client = srv.client()
        for p, want in zip(PROMPTS, ref):
            got = client.completions.create(
                model="tiny", prompt=p, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
            )
            assert got.choices[0].text == want
            stream = client.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=8,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
        with srv.http() as h:
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": -1})
            assert r.status_code == 400
        stats = srv.wait_idle()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert not any(p.is_alive() for p in procs), "peer ranks outlived the server"


def test_tp2_server_dead_peer_is_503_engine_dead_and_health_503(tiny_llama_dir, monkeypatch):
    """A dead peer rank leaves the engine unable to run any step: the server says so (503
    ``engine_dead`` naming the rank, ``/health`` 503 so an orchestrator restarts it), in bounded
    time, instead of answering every request 500 while ``/health`` says ok."""
    import os
    import signal
    import time

    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")
    args = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE)
    with running_server(args, "tiny") as srv:
        peer = srv.engine.executor.peers._procs[0]
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3}
        with srv.http(timeout=120) as h:
            assert h.post("/v1/completions", json=body).status_code == 200
            os.kill(peer.pid, signal.SIGKILL)
            peer.join(10)
            t = time.monotonic()
            for _ in range(2):  # the request that meets the death, and one after it
                r = h.post("/v1/completions", json=body)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "engine_dead" and "tensor-parallel worker rank 1" in err["message"]
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                text = "".join(r.iter_lines())
            assert r.status_code == 503 and "engine_dead" in text, text
            assert h.get("/health").status_code == 503
            assert time.monotonic() - t < 60  # a hang waits out the 120 s collective timeout
        st = srv.engine.get_kv_cache_stats()
        assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
