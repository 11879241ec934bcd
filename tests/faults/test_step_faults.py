"""One request's fault, wherever in the step it happens, ends that request ``failed`` with its
reason; every neighbour in flight with it (greedy, seeded random, ``n > 1``, constrained, with a
stop string) gets the output of a run without the fault; the engine keeps serving, and nothing
(KV block, sequence, grammar matcher) is left behind. Offline (``LLM.generate``) and over HTTP
(plain and streamed, ``/health`` after).

Sites: the model forward (for the poisoned request's rows, and once for a whole step: a
transient fault no request is blamed for), the sampler, the detokenizer, the stop checker, the
grammar's mask fill (on the structured-output thread) and its matcher.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve import SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from tests.engine.test_step_faults_real_model import POISON
from tests.faults.conftest import REGEX, SITES, assert_nothing_left, inject, scheduled_together

# ------------------------------------------------------------------------------ offline
NEIGHBOURS = [
    ([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    ([11, 12, 13], SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)),
    ([50, 51], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=9, ignore_eos=True)),
    (
        [60, 61, 62],
        SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)
        ),
    ),
    (list(range(20, 41)), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=["e"])),
]


def _bad_params(site: str) -> SamplingParams:
    if site.startswith("grammar"):
        return SamplingParams(
            max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)
        )
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _result(out):
    return [(list(c.token_ids), c.text, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def clean_offline(fault_llm):
    prompts = [{"prompt_token_ids": p} for p, _ in NEIGHBOURS]
    outs = fault_llm.generate(prompts, [sp for _, sp in NEIGHBOURS], use_tqdm=False)
    assert all(o.outcome == "finished" for o in outs)
    return [_result(o) for o in outs]


@pytest.mark.parametrize("site", SITES)
def test_offline_fault_fails_only_its_request(fault_llm, clean_offline, monkeypatch, site):
    engine = fault_llm.llm_engine
    inject(site, engine, monkeypatch)
    bad_prompt = [70, POISON, 71, 72]
    prompts = [{"prompt_token_ids": p} for p, _ in NEIGHBOURS]
    params = [sp for _, sp in NEIGHBOURS]
    # the poisoned request among its neighbours, all in the same steps
    outs = fault_llm.generate(
        prompts[:2] + [{"prompt_token_ids": bad_prompt}] + prompts[2:],
        params[:2] + [_bad_params(site)] + params[2:],
        use_tqdm=False,
    )
    bad = outs.pop(2)
    if site == "forward_once":
        assert bad.outcome == "finished", bad.error  # retried in halves: nobody is at fault
    else:
        assert bad.outcome == "failed", (bad.outcome, bad.error)
        assert all(c.finish_reason == "error" for c in bad.outputs)
        assert bad.request_id in bad.error and "poisoned" in bad.error, bad.error
    assert [o.outcome for o in outs] == ["finished"] * len(NEIGHBOURS), [o.error for o in outs]
    assert [_result(o) for o in outs] == clean_offline
    assert_nothing_left(engine)
    monkeypatch.undo()
    again = fault_llm.generate(prompts, params, use_tqdm=False)
    assert [_result(o) for o in again] == clean_offline
    assert_nothing_left(engine)


# ------------------------------------------------------------------------------ server
def _body(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "temperature": 0, **kw}


SERVER_NEIGHBOURS = [
    _body([5, 6, 7, 8, 9], max_tokens=8, ignore_eos=True),
    _body([5, 6, 7, 8, 9], max_tokens=8, ignore_eos=True, stream=True),
    _body([60, 61, 62], max_tokens=8, structured_outputs={"regex": REGEX}),
    _body([60, 61, 62], max_tokens=8, structured_outputs={"regex": REGEX}, stream=True),
    _body(list(range(20, 41)), max_tokens=10, ignore_eos=True, stop=["e"]),
]


def _post(server, body):
    return server.http(timeout=120).post("/v1/completions", json=body)


def _answer(resp) -> tuple:
    """``(status, text, finish_reason, error message or None)`` of a plain or streamed answer."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        if resp.status_code != 200:
            return resp.status_code, None, None, resp.json()["error"]["message"]
        c = resp.json()["choices"][0]
        return 200, c["text"], c["finish_reason"], None
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", resp.text[-500:]
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        assert len(errors) == 1 and "error" in events[-1], events  # the error event comes last
        return resp.status_code, None, None, errors[0]["message"]
    text = "".join(c["text"] for e in events for c in e["choices"])
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    return resp.status_code, text, reasons[-1], None


def _run_all(server, bodies):
    """Send ``bodies`` at once; they all start in the same step."""
    with scheduled_together(server, len(bodies)), ThreadPoolExecutor(len(bodies)) as pool:
        return [f.result() for f in [pool.submit(_post, server, b) for b in bodies]]


@pytest.fixture(scope="module")
def clean_server(fault_server):
    answers = [_answer(r) for r in _run_all(fault_server, SERVER_NEIGHBOURS)]
    assert all(a[0] == 200 and a[3] is None for a in answers), answers
    fault_server.wait_idle()
    return answers


@pytest.mark.parametrize("site", SITES)
def test_server_fault_fails_only_its_request_and_keeps_serving(fault_server, clean_server, monkeypatch, site):
    engine = fault_server.engine
    inject(site, engine, monkeypatch)
    extra = {"structured_outputs": {"regex": REGEX}} if site.startswith("grammar") else {"ignore_eos": True}
    bad = _body([70, POISON, 71, 72], max_tokens=6, **extra)
    answers = [_answer(r) for r in _run_all(fault_server, [bad, {**bad, "stream": True}, *SERVER_NEIGHBOURS])]
    bad_plain, bad_stream, neighbours = answers[0], answers[1], answers[2:]
    if site == "forward_once":
        assert bad_plain[0] == 200 and bad_plain[3] is None, bad_plain
        assert bad_stream[:3] == bad_plain[:3], (bad_stream, bad_plain)
    else:
        # a 500 naming the request; a stream's error event (after its 200 header), then [DONE]
        assert bad_plain[0] == 500 and "cmpl-" in bad_plain[3] and "poisoned" in bad_plain[3], bad_plain
        assert bad_stream[0] == 200 and "cmpl-" in bad_stream[3] and "poisoned" in bad_stream[3], bad_stream
    assert neighbours == clean_server
    fault_server.wait_idle()
    assert_nothing_left(engine)
    monkeypatch.undo()
    with fault_server.http() as h:
        assert h.get("/health").status_code == 200
    assert [_answer(r) for r in _run_all(fault_server, SERVER_NEIGHBOURS)] == clean_server
    fault_server.wait_idle()
    assert_nothing_left(engine)


# ------------------------------------------------------------------------------ engine thread
@pytest.fixture
def throwaway_server(fault_llm):
    """``fault_llm``'s engine served by an asyncio loop and app of its own (no model load); the
    engine outlives it, every request of it ended."""
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from tests.server_harness import running_server

    engine = fault_llm.llm_engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "shutdown", lambda: None)  # the harness shuts the engine down at exit
        with running_server(None, "tiny", async_engine=AsyncLLMEngine(engine)) as s:
            yield s
    # (the test's patched abort_request is still in place here)
    type(engine).abort_request(engine, list(engine._groups))
    engine.step()
    assert_nothing_left(engine)


@pytest.mark.parametrize("times", [1, 10**9])
def test_server_fault_outside_any_request_on_the_engine_thread_never_hangs(
    request, clean_server, monkeypatch, times
):
    """An abort that raises (a fault of the engine, not of a request: once, or from then on) on
    the engine thread, between steps: the requests in flight end (500 internal error, or 503
    engine_dead when the engine cannot recover), none waits forever, and ``/health`` says
    whether the engine still serves."""
    if times == 1:
        fault_server = request.getfixturevalue("fault_server")
    else:  # the loop stops for good: serve the offline engine through a loop of its own
        fault_server = request.getfixturevalue("throwaway_server")
    engine = fault_server.engine
    real_abort = engine.abort_request
    calls = []

    def abort_request(request_id):
        calls.append(request_id)
        if len(calls) <= times:
            raise RuntimeError("abort bug")
        return real_abort(request_id)

    body = _body([5, 6, 7, 8, 9], max_tokens=8, ignore_eos=True)
    with scheduled_together(fault_server, 2) as go, ThreadPoolExecutor(1) as pool:
        # the neighbour is queued in the engine, its steps held back
        running = pool.submit(_post, fault_server, body)
        deadline = time.monotonic() + 60
        while len(engine._groups) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(engine, "abort_request", abort_request)
        fault_server.async_engine.abort("gone")  # as for a client that went away
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        go.set()
        neighbour = running.result(timeout=60)
    assert calls
    health = fault_server.http().get("/health").status_code
    if times == 1:  # recovered: in-flight requests failed, the next one is served
        assert neighbour.status_code == 500 and "abort bug" in neighbour.json()["error"]["message"], (
            neighbour.text
        )
        assert health == 200
        monkeypatch.undo()
        assert [_answer(r) for r in _run_all(fault_server, SERVER_NEIGHBOURS)] == clean_server
        fault_server.wait_idle()
        assert_nothing_left(engine)
    else:  # the engine cannot abort: it stops and says so
        assert neighbour.status_code == 503 and neighbour.json()["error"]["code"] == "engine_dead", (
            neighbour.text
        )
        assert health == 503
