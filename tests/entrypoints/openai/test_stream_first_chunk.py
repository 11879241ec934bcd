"""Streams time honestly: the first data chunk of a stream carries the first generated token
(on chat with ``"role": "assistant"`` in the same delta), never an empty chunk sent before the
prefill. Each stream is compared with the non-streamed answer to the same greedy request, and
the edge cases still end well-formed: ``n = 2``, one token, usage, logprobs, no visible output,
a request aborted before its first token."""

import contextlib
import json

import pytest

from tests.entrypoints.openai.conftest import MODEL

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def shown(x):
    """``x`` without its null values, recursively: every chunk carries all of vLLM's choice keys
    (``logprobs``, ``finish_reason``, ``stop_reason``, ``token_ids``, ... null until set)."""
    if isinstance(x, dict):
        return {k: shown(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [shown(v) for v in x]
    return x


def counts(usage: dict) -> dict:
    """The token counts of a ``usage`` (a stream's usage chunk leaves out the null ``*_details``
    a whole answer carries, as vLLM's does)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def gen_tokens(server) -> int:
    return server.engine.stats.num_generation_tokens


def stream_events(server, path: str, body: dict) -> tuple[list[dict], int]:
    """The JSON events of a 200 stream (``[DONE]`` checked and left off) and how many tokens
    the engine had generated (over its whole life) when the first event arrived."""
    before = gen_tokens(server)
    events: list[dict] = []
    lines: list[str] = []
    at_first = -1
    with server.http().stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if line.startswith("data: {"):
                if not events:
                    at_first = gen_tokens(server) - before
                events.append(json.loads(line[6:]))
    assert lines and lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1, lines[-3:]
    assert len(events) == len(lines) - 1
    return events, at_first


def post(server, path: str, body: dict) -> dict:
    r = server.http().post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def choice_events(events: list[dict], index: int) -> list[dict]:
    """The stream choices of one ``index``, in order."""
    return [c for e in events for c in e["choices"] if c["index"] == index]


def test_chat_first_chunk_has_role_and_first_token(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/chat/completions", dict(body, logprobs=True))
    want = full["choices"][0]
    assert want["message"]["content"]
    events, at_first = stream_events(
        server, "/v1/chat/completions", dict(body, stream_options={"include_usage": True})
    )
    # the engine had sampled this request's first token before the first chunk was sent
    assert at_first >= 1
    first = events[0]["choices"]
    assert len(first) == 1 and first[0]["index"] == 0
    delta = first[0]["delta"]
    assert delta["role"] == "assistant"
    assert delta["content"] == want["logprobs"]["content"][0]["token"] and delta["content"]
    choices = choice_events(events, 0)
    assert all("role" not in c["delta"] for c in choices[1:])
    assert "".join(c["delta"].get("content", "") for c in choices) == want["message"]["content"]
    reasons = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    assert reasons == [want["finish_reason"]] and choices[-1].get("finish_reason")
    # include_usage: the last event has no choices and the non-streamed usage
    assert events[-1]["choices"] == [] and counts(events[-1]["usage"]) == counts(full["usage"])
    assert all("usage" not in e for e in events[:-1])
    server.wait_idle()


def test_completions_first_chunk_has_first_token_text(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    full = post(server, "/v1/completions", dict(body, logprobs=1))
    want = full["choices"][0]
    events, at_first = stream_events(server, "/v1/completions", body)
    assert at_first >= 1
    first = events[0]["choices"]
    assert len(first) == 1 and first[0]["text"] == want["logprobs"]["tokens"][0] and first[0]["text"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == want["text"]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == [
        want["finish_reason"]
    ]
    server.wait_idle()


def test_chat_n2_each_choice_first_chunk_has_role(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5}
    full = post(server, "/v1/chat/completions", body)
    want = {c["index"]: c for c in full["choices"]}
    assert sorted(want) == [0, 1]
    events, _ = stream_events(server, "/v1/chat/completions", body)
    for i in (0, 1):
        choices = choice_events(events, i)
        assert choices[0]["delta"]["role"] == "assistant"
        assert choices[0]["delta"].get("content") or choices[0].get("finish_reason")
        assert all("role" not in c["delta"] for c in choices[1:])
        # same seed, same tokens as the non-streamed choices
        assert "".join(c["delta"].get("content", "") for c in choices) == want[i]["message"]["content"]
        assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == [want[i]["finish_reason"]]
    server.wait_idle()


def test_chat_one_token_stream_with_usage(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    full = post(server, "/v1/chat/completions", body)
    text = full["choices"][0]["message"]["content"]
    assert text and full["usage"]["completion_tokens"] == 1
    events, _ = stream_events(
        server, "/v1/chat/completions", dict(body, stream_options={"include_usage": True})
    )
    # the token with the role, then the finish, then the usage
    assert [shown(e["choices"]) for e in events[:2]] == [
        [{"index": 0, "delta": {"role": "assistant", "content": text}}],
        [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}],  # vLLM's finish chunk
    ]
    assert (
        len(events) == 3
        and events[2]["choices"] == []
        and counts(events[2]["usage"]) == counts(full["usage"])
    )
    server.wait_idle()


def test_completions_one_token_stream_with_usage(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    full = post(server, "/v1/completions", body)
    text = full["choices"][0]["text"]
    assert text
    events, _ = stream_events(server, "/v1/completions", dict(body, stream_options={"include_usage": True}))
    assert len(events) == 2
    (c,) = events[0]["choices"]
    assert c["text"] == text and c["finish_reason"] == "length"
    assert events[1]["choices"] == [] and counts(events[1]["usage"]) == counts(full["usage"])
    server.wait_idle()


def test_chat_stream_logprobs_ride_with_the_tokens(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    want = post(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    events, _ = stream_events(server, "/v1/chat/completions", body)
    choices = choice_events(events, 0)
    assert choices[0]["delta"]["role"] == "assistant" and choices[0]["logprobs"]["content"]
    got = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert [t["token"] for t in got] == [t["token"] for t in want]
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-4)
    server.wait_idle()


def test_chat_no_visible_output_still_sends_role_and_finish(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    base = post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    stop = base[:3]  # the answer stops before its first character
    assert len(stop) == 3
    full = post(server, "/v1/chat/completions", dict(body, stop=[stop]))
    assert full["choices"][0]["message"]["content"] == "" and full["choices"][0]["finish_reason"] == "stop"
    events, _ = stream_events(
        server, "/v1/chat/completions", dict(body, stop=[stop], stream_options={"include_usage": True})
    )
    assert shown(events[0]["choices"]) == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": "stop",
            "stop_reason": stop,
        }
    ]
    assert (
        len(events) == 2
        and events[1]["choices"] == []
        and counts(events[1]["usage"]) == counts(full["usage"])
    )
    server.wait_idle()


@contextlib.contextmanager
def aborted_before_first_token(server, prefix: str):
    """Inside the block, the engine aborts each request whose id starts with ``prefix`` before
    running a step for it (it never gets a token)."""
    engine = server.engine
    real_step = engine.step
    patched_before = "step" in vars(engine)

    def step():
        ids = [rid for rid in list(engine._groups) if rid.startswith(prefix)]
        if ids:
            engine.abort_request(ids)
        return real_step()

    engine.step = step
    try:
        yield
    finally:
        if patched_before:
            engine.step = real_step
        else:
            del engine.step


@pytest.mark.parametrize(
    "route,prefix,body,final",
    [
        (
            "/v1/chat/completions",
            "chatcmpl-",
            {"messages": MESSAGES},
            {"delta": {"role": "assistant", "content": ""}, "finish_reason": "abort"},
        ),
        ("/v1/completions", "cmpl-", {"prompt": PROMPT}, {"text": "", "finish_reason": "abort"}),
    ],
)
def test_aborted_before_first_token_ends_every_choice_well_formed(server, route, prefix, body, final):
    body = dict(body, model=MODEL, max_tokens=8, temperature=0, n=2)
    before = gen_tokens(server)
    with aborted_before_first_token(server, prefix):
        events, _ = stream_events(server, route, dict(body, stream_options={"include_usage": True}))
    assert gen_tokens(server) == before
    finals = [c for e in events for c in e["choices"]]
    assert shown(sorted(finals, key=lambda c: c["index"])) == [{"index": i, **final} for i in (0, 1)]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 0
    server.wait_idle()
