"""One request, or one client, never hurts another (server and offline API).

- Extreme values in every numeric field (hypothesis): never a 5xx (a 400 naming the field, or a
  normal answer), the engine keeps serving, and a request running at the same time gets exactly
  the answer of a clean run.
- The issue's reproduction (``top_k = 2**63`` / ``10**30``): a 400 naming top_k, nothing queued.
- A request whose step fails inside the engine (a poisoned forward): a 500 naming its request
  id (an error event when streaming), while concurrent streams finish unchanged.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.engine.test_step_faults_real_model import POISON, PoisonedModel

INNOCENT = {
    "model": "tiny",
    "prompt": "Hello there, how",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}

EXTREME_INTS = st.sampled_from(
    [0, 1, -1, -2, 2, 8, 20, 21, 64, 127, 128, 49151, 49152, 2**31, 2**32]
    + [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30)]
) | st.integers(-3, 140)
EXTREME_FLOATS = st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 1.5, 2.0, 2.0000001, 100.0, 100.5]
    + [3.4028234663852886e38, 3.5e38, 1e308, -1e308, -1.0, -2.0, -100.0, math.inf, -math.inf, math.nan]
) | st.floats(-1e3, 1e3)
NUMBER = EXTREME_INTS | EXTREME_FLOATS

SAMPLING_FIELDS = {
    "n": EXTREME_INTS,
    "max_tokens": EXTREME_INTS | st.none(),
    "min_tokens": EXTREME_INTS,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": EXTREME_INTS,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "seed": EXTREME_INTS,
    "priority": EXTREME_INTS,
    "logit_bias": st.dictionaries(EXTREME_INTS.map(str), NUMBER, max_size=3),
    "stop_token_ids": st.lists(EXTREME_INTS, max_size=3),
    "ignore_eos": st.booleans(),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": st.just("Hi") | st.lists(EXTREME_INTS, min_size=1, max_size=4),
    "logprobs": EXTREME_INTS,
    "best_of": EXTREME_INTS,
    "echo": st.booleans(),
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "max_completion_tokens": EXTREME_INTS,
    "logprobs": st.booleans(),
    "top_logprobs": EXTREME_INTS,
}


def _post(server, path: str, body: dict):
    # json.dumps writes NaN/Infinity (not JSON): the server must answer 400 for those too
    return server.http(timeout=60).post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )


@pytest.fixture(scope="module")
def clean_text(tiny_server):
    r = _post(tiny_server, "/v1/completions", INNOCENT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _run_beside_innocent(server, path: str, body: dict, clean: str):
    with ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(_post, server, "/v1/completions", INNOCENT)
        resp = pool.submit(_post, server, path, body).result()
        ok = innocent.result()
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == clean
    return resp


def _check_answer(resp):
    event(f"status {resp.status_code}")
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert resp.status_code in (400, 503) and err["message"], err
        if err["param"] is not None:
            assert err["param"] in err["message"], err


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fields=st.fixed_dictionaries({}, optional=COMPLETION_FIELDS))
def test_extreme_completion_fields_never_5xx_nor_disturb_others(tiny_server, clean_text, fields):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, **fields}
    _check_answer(_run_beside_innocent(tiny_server, "/v1/completions", body, clean_text))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fields=st.fixed_dictionaries({}, optional=CHAT_FIELDS), stream=st.booleans())
def test_extreme_chat_fields_never_5xx_nor_disturb_others(tiny_server, clean_text, fields, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    body["stream"] = stream
    resp = _run_beside_innocent(tiny_server, "/v1/chat/completions", body, clean_text)
    _check_answer(resp)
    if stream and resp.status_code == 200:
        assert '"internal_server_error"' not in resp.text
        assert resp.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("top_k", [2**63, 10**30])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_overflowing_top_k_is_400_naming_it_and_others_finish(tiny_server, clean_text, top_k, path):
    body = {"model": "tiny", "top_k": top_k, "max_tokens": 4}
    body.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    added = tiny_server.engine.stats.num_requests_added
    resp = _run_beside_innocent(tiny_server, path, body, clean_text)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "top_k" and "2**63 - 1" in err["message"], err
    assert tiny_server.engine.stats.num_requests_added == added + 1  # only the innocent one
    tiny_server.wait_idle()


def test_top_k_above_the_vocabulary_is_400_naming_the_limit(tiny_server):
    resp = _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": 49153})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "top_k" and "49152" in err["message"], err


def test_a_request_whose_step_fails_is_500_with_its_id_and_others_stream_on(
    tiny_server, clean_text, monkeypatch
):
    runner = tiny_server.engine.executor.runner
    monkeypatch.setattr(runner, "model", PoisonedModel(runner.model))
    bad = {"model": "tiny", "prompt": [5, POISON, 7], "max_tokens": 4, "temperature": 0}
    stream_body = {**INNOCENT, "stream": True}
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_post, tiny_server, "/v1/completions", stream_body) for _ in range(2)]
        failed = pool.submit(_post, tiny_server, "/v1/completions", bad).result()
        failed_stream = pool.submit(_post, tiny_server, "/v1/completions", {**bad, "stream": True}).result()
        streamed = [f.result() for f in streams]
    assert failed.status_code == 500, failed.text
    err = failed.json()["error"]
    assert (
        err["type"] == "internal_server_error" and "cmpl-" in err["message"] and "poisoned" in err["message"]
    )
    assert failed_stream.status_code == 200
    assert '"internal_server_error"' in failed_stream.text and "cmpl-" in failed_stream.text
    for r in streamed:
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
        assert text == clean_text
    tiny_server.wait_idle()
    monkeypatch.undo()
    assert _post(tiny_server, "/v1/completions", INNOCENT).json()["choices"][0]["text"] == clean_text


# ------------------------------------------------------------------------------ offline
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    kw = {k: v for k, v in TINY_SERVER_KWARGS.items() if k != "seed"}
    return LLM(model=str(tiny_llama_dir), **kw)


PARAM_FIELDS = {k: v for k, v in SAMPLING_FIELDS.items() if k not in ("priority", "logit_bias")} | {
    "logprobs": EXTREME_INTS,
    "logit_bias": st.dictionaries(EXTREME_INTS, NUMBER, max_size=3),
}


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fields=st.fixed_dictionaries({}, optional=PARAM_FIELDS), priority=EXTREME_INTS)
def test_extreme_sampling_params_offline_are_errors_naming_the_field_or_run_cleanly(llm, fields, priority):
    good = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    clean = [5, 6, 7]
    if not hasattr(llm, "_clean"):
        llm._clean = llm.generate([clean], good, use_tqdm=False)[0].outputs[0].token_ids
    fields.setdefault("max_tokens", 4)
    try:
        bad = SamplingParams(**fields)
        outs = llm.generate([clean, [9, 10]], [good, bad], use_tqdm=False, priority=[0, priority])
    except ValueError as e:
        event("ValueError")
        assert str(e).split()[0].strip("(") in set(PARAM_FIELDS) | {"priority", "prompt", "n"}, e
    else:
        event("ran")
        assert outs[0].outputs[0].token_ids == llm._clean
        assert outs[1].outcome == "finished", outs[1].error
    eng = llm.llm_engine
    st_ = eng.get_kv_cache_stats()
    assert not eng.has_unfinished_requests()
    assert st_["num_free_gpu_blocks"] == st_["num_gpu_blocks"]
