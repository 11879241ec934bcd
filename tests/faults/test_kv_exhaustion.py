"""The KV pool runs out: many concurrent long requests on a pool that holds a fraction of them.

Requests are preempted (recomputed, or swapped for ``n > 1``) and queued, never hung: each one
that fits the pool alone finishes with the output of a roomy run (greedy); one whose
``max_tokens`` the whole pool could never hold is refused at admission (a ``ValueError``
offline, a 400 naming ``max_tokens`` over HTTP); a prompt that can never fit is rejected naming
its size; over HTTP, requests past ``max_waiting`` are refused at once (503 ``queue_full``) and
the rest answer 200. Every block is free afterwards. (``tests/adversarial/test_cache_capacity.py``
covers one request against the pool alone.)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve import LLM, SamplingParams
from tests.faults.conftest import assert_nothing_left, scheduled_together

BS, G, C = 4, 16, 8  # 64 token slots on the device, 32 in swap space
TIGHT = dict(block_size=BS, num_gpu_blocks=G, num_cpu_blocks=C, max_model_len=128, max_num_batched_tokens=128)
# each fits the pool alone (8 + 24 tokens = 8 blocks); together they need 4x the pool
CROWD = [list(range(100 + 10 * i, 108 + 10 * i)) for i in range(8)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
FORKED = SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)  # preempted by swap
OUTGROWS = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # 8 + 100 > 64 slots
NEVER_FITS = list(range(300, 370))  # 70 tokens > 64 slots


def _requests():
    reqs = [(f"crowd{i}", p, GREEDY) for i, p in enumerate(CROWD)]
    reqs += [("forked", CROWD[0], FORKED), ("outgrows", CROWD[1], OUTGROWS), ("never", NEVER_FITS, GREEDY)]
    return reqs


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir):
    """Each request's final output, run alone on a pool with room for it."""
    llm = LLM(model=str(tiny_llama_dir), seed=0, **{**TIGHT, "num_gpu_blocks": 128, "max_model_len": 128})
    out = {}
    for rid, prompt, params in _requests()[:-1]:
        if rid == "outgrows":
            continue
        out[rid] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.shutdown()
    return out


def test_offline_crowd_on_a_tiny_pool_preempts_and_never_hangs(tiny_llama_dir, roomy):
    llm = LLM(model=str(tiny_llama_dir), seed=0, **TIGHT)
    engine = llm.llm_engine
    try:
        for rid, prompt, params in _requests():
            if rid == "outgrows":  # refused before it is queued
                with pytest.raises(ValueError, match=r"max_tokens \(100\) = 108 > 65 tokens"):
                    engine.add_request(rid, prompt, params)
                continue
            engine.add_request(rid, prompt, params)
        final = {}
        # bounded: a livelock (preempting forever) or a lost request fails here instead of hanging
        for _ in range(2000):
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in final, out.request_id
                    final[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert sorted(final) == sorted(rid for rid, *_ in _requests() if rid != "outgrows"), sorted(final)
        assert engine.get_kv_cache_stats()["num_preemptions"] > 0  # the pool was the limit
        never = final.pop("never")
        assert never.outcome == "rejected" and "18 KV blocks" in never.error, never.error
        for rid, out in final.items():
            assert out.outcome == "finished", (rid, out.error)
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in roomy[rid].outputs], rid
        assert_nothing_left(engine)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tight_server(tiny_llama_dir):
    from kvserve.config import EngineArgs
    from tests.server_harness import running_server

    args = EngineArgs(model=str(tiny_llama_dir), seed=0, max_waiting=6, **TIGHT)
    with running_server(args, "tiny", shutdown_grace_s=2.0) as s:
        yield s


def test_server_crowd_on_a_tiny_pool_queues_or_refuses_and_never_hangs(tight_server, roomy):
    def post(prompt, max_tokens):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        return tight_server.http(timeout=120).post("/v1/completions", json=body)

    engine = tight_server.engine
    bodies = [(p, 24) for p in CROWD] + [(CROWD[1], 100), (NEVER_FITS, 24)]
    expected = {tuple(p): roomy[f"crowd{i}"].outputs[0].text for i, p in enumerate(CROWD)}
    # no step runs until the waiting queue (6 places) is full and the others were answered
    with scheduled_together(tight_server, len(bodies)) as go, ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(post, *b) for b in bodies]
        deadline = time.monotonic() + 60
        while not (len(engine._groups) == 6 and sum(f.done() for f in futures) == len(bodies) - 6):
            assert time.monotonic() < deadline, (len(engine._groups), [f.done() for f in futures])
            time.sleep(0.01)
        go.set()
        resps = [f.result() for f in futures]
    never = resps.pop()
    assert never.status_code == 400 and "18 KV blocks" in never.json()["error"]["message"], never.text
    outgrows = resps.pop()  # refused at admission, before it could take a place in the queue
    assert outgrows.status_code == 400 and outgrows.json()["error"]["param"] == "max_tokens", outgrows.text
    refused = [r for r in resps if r.status_code == 503]
    served = [(b, r) for b, r in zip(bodies, resps) if r.status_code == 200]
    assert len(refused) == 2 and len(served) == 6, [r.status_code for r in resps]
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "max_waiting 6" in err["message"], err
        assert r.headers.get("retry-after")
    for (prompt, _), r in served:
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["finish_reason"] == "length", choice
        assert usage["completion_tokens"] == 24 and choice["text"] == expected[tuple(prompt)]
    assert engine.get_kv_cache_stats()["num_preemptions"] > 0
    tight_server.wait_idle()
    assert_nothing_left(engine)
    with tight_server.http() as h:
        assert h.get("/health").status_code == 200
    # a refused request is served once there is room
    assert post(CROWD[-1], 24).status_code == 200
