"""Requests the server must refuse with a 400 naming the field, not serve differently than
asked: ``max_tokens`` past what the KV cache holds (not only past ``max_model_len``), a ``user``
with control characters (it becomes a /metrics label), a chat message without ``content``, and
text that is not UTF-8 (a lone surrogate escape). Also: ``user: ""`` is the default tenant."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.openai.protocol import ChatMessage
from kvserve.entrypoints.openai.serving_chat import render_messages
from kvserve.entrypoints.openai.serving_engine import APIError
from tests.server_harness import running_server

MODEL = "tiny"
PROMPT = [5 + (37 * i) % 2000 for i in range(100)]  # 100 tokens of a 128-slot cache


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    # 8 blocks of 16 tokens: 128 token slots (a sequence of 129: its last token is never cached),
    # under max_model_len 256
    args = EngineArgs(
        model=str(tiny_llama_dir), block_size=16, num_gpu_blocks=8, max_model_len=256, seed=0, dtype="float32"
    )
    with running_server(args, MODEL) as s:
        yield s


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 50}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 14, "n": 2}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 14, "n": 1, "best_of": 2}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi " * 90}], "max_tokens": 100},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi " * 90}], "max_completion_tokens": 100},
            "max_completion_tokens",
        ),
    ],
)
def test_max_tokens_past_the_kv_cache_is_a_400(server, route, body, param):
    with server.http() as h:
        err = _error(h.post(route, json={"model": MODEL, **body}))
    assert err["param"] == param and err["code"] == "context_length_exceeded"
    message = err["message"]
    assert "KV cache" in message and "8 KV blocks of 16 tokens" in message
    if route == "/v1/completions":
        assert "(100 tokens)" in message  # the prompt's length
        assert (
            "at most 13 here" in message
            if body.get("n", 1) > 1 or "best_of" in body
            else "at most 29 here" in message
        )
    server.wait_idle()


def test_the_largest_max_tokens_the_cache_holds_runs_to_the_end(server):
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 29, "ignore_eos": True, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 29 and body["choices"][0]["finish_reason"] == "length"
        r = h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 13, "n": 2, "ignore_eos": True, "seed": 1},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 26
    server.wait_idle()


def test_chat_without_max_tokens_runs_until_the_cache_is_full(server):
    with server.http() as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 90}], "ignore_eos": True},
        )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] < 128 and usage["total_tokens"] == 129
    assert r.json()["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


def _tenant_lines(server) -> list[str]:
    with server.http() as h:
        text = h.get("/metrics").text
    return [ln for ln in text.splitlines() if ln.startswith("kvserve:tenant_requests_total{")]


@pytest.mark.parametrize("user", ["a\x00b", "line\nbreak", "tab\there", "del\x7f", "c1\x85"])
def test_user_with_a_control_character_is_a_400_and_never_a_label(server, user):
    with server.http() as h:
        err = _error(
            h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": user})
        )
    assert err["param"] == "user" and "control characters" in err["message"]
    assert f"U+{ord(next(c for c in user if not c.isalnum())):04X}" in err["message"]
    assert not any(user in ln or "\x00" in ln for ln in _tenant_lines(server))


def test_an_empty_user_is_the_default_tenant(server):
    def default_count() -> float:
        lines = [ln for ln in _tenant_lines(server) if 'tenant="default"' in ln]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = default_count()
    with server.http() as h:
        for extra in ({}, {"user": ""}):
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
    server.wait_idle()
    assert default_count() == before + 2
    assert not any('tenant=""' in ln for ln in _tenant_lines(server))


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("content", ["missing", None])
def test_a_message_without_content_is_a_400_naming_it(role, content):
    msg = {"role": role, **({"tool_call_id": "call_1"} if role == "tool" else {})}
    if content is None:
        msg["content"] = None
    messages = [ChatMessage(role="user", content="hi"), ChatMessage.model_validate(msg)]
    with pytest.raises(APIError) as e:
        render_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages[1].content"


def test_an_assistant_message_may_leave_content_out():
    """With tool calls, or without (an answer that was all reasoning, echoed back by a client,
    as vLLM accepts it): the turn renders with empty text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for msg in (
        {"role": "assistant", "tool_calls": [call]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ):
        conv = render_messages([ChatMessage(role="user", content="hi"), ChatMessage.model_validate(msg)])
        assert conv[1]["content"] == "" and conv[1]["tool_calls"][0]["id"] == "call_1"
    for msg in ({"role": "assistant"}, {"role": "assistant", "content": None}):
        conv = render_messages([ChatMessage(role="user", content="hi"), ChatMessage.model_validate(msg)])
        assert conv[1]["content"] == "" and "tool_calls" not in conv[1]


def test_chat_message_without_content_over_http(server):
    with server.http() as h:
        err = _error(h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user"}]}))
    assert err["param"] == "messages[0].content"


@pytest.mark.parametrize(
    "route,raw,param",
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "x\\udc00"], "max_tokens": 2}', "prompt[1]"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
            "messages[0].content",
        ),
        # in a key (an unknown field): the path shows it escaped
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "k\\udc00": 1}', "k\\udc00"),
        # a huge number first: the second parser, which keeps surrogates, must refuse it too
        ("/v1/completions", b'{"model": "tiny", "seed": 1' + b"0" * 40 + b', "prompt": "\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, raw, param):
    with server.http() as h:
        err = _error(h.post(route, content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == param
    assert "lone surrogate" in err["message"] and "UTF-8" in err["message"]


def test_bytes_that_are_not_utf8_are_a_400_naming_the_field(server):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\xffb"}], "max_tokens": 2}'
    with server.http() as h:
        err = _error(
            h.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        )
    assert err["param"] == "messages[0].content" and "not valid UTF-8" in err["message"]


def test_a_surrogate_pair_is_one_character_and_served(server):
    raw = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    with server.http() as h:
        r = h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    server.wait_idle()


def test_a_stream_event_stays_one_line_for_line_splitting_clients():
    """JSON leaves U+0085 / U+2028 / U+2029 raw in a string, and ``str.splitlines`` (httpx's
    ``iter_lines``) breaks a line there: the event escapes them, and decodes to the same text."""
    import json

    from pydantic import BaseModel

    from kvserve.entrypoints.openai.serving_engine import sse

    class Chunk(BaseModel):
        text: str

    text = "a\u2028b\x85c\u2029d é"
    frame = sse(Chunk(text=text))
    lines = frame.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0].removeprefix("data: "))["text"] == text
    assert "é" in frame  # everything else stays UTF-8 as it is
