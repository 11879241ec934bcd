"""Reasoning over HTTP (tiny random model, official client): ``--reasoning-parser`` splits the
reasoning off into ``reasoning_content`` / ``reasoning``, whole and streamed (``deepseek_r1``, and
``qwen3`` with the ``pythonic`` tool-call format); tool calls are read after it; ``--default-chat-template-kwargs`` sets template variables a request may override; an
output constraint is refused unless the prompt already closed the reasoning block.

The random model is steered with a regex constraint. A constraint is refused while the model is
expected to think (it would forbid the thinking), so the steered tests lift that check."""

import json

import pytest

from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

#: ``no_think`` closes an empty think block in the prompt (as Qwen3's enable_thinking=false does)
TEMPLATE = (
    "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% if no_think %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "Hi"}]
THINK = {"no_think": False}
FORCED = r"<think>\nI should greet\.\n</think>\n\nHello there"
TOOLS = [{"type": "function", "function": {"name": "wave", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS),
        "tiny",
        shutdown_grace_s=2.0,
        chat_template=TEMPLATE,
        reasoning_parser="deepseek_r1",
        default_chat_template_kwargs={"no_think": True},
    ) as s:
        yield s


@pytest.fixture
def steerable(monkeypatch):
    monkeypatch.setattr(OpenAIServingChat, "check_reasoning_constraint", lambda *a: None)


def _create(server, stream, **kw):
    """(reasoning_content, reasoning, content, [(name, arguments)], finish_reason)."""
    # 80: room for the forced answers, and within what the 96-slot KV cache holds after the prompt
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 80, "temperature": 0, **kw}
    client = server.client()
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        extra = m.model_extra or {}
        return (
            extra.get("reasoning_content"),
            extra.get("reasoning"),
            m.content,
            calls,
            r.choices[0].finish_reason,
        )
    rc, rs, content, calls, reason = "", "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            rc += extra.get("reasoning_content") or ""
            rs += extra.get("reasoning") or ""
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                if t.id is not None:
                    calls[t.index] = [t.function.name, ""]
                calls[t.index][1] += t.function.arguments or ""
            reason = ch.finish_reason or reason
    return rc or None, rs or None, content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_off_whole_and_streamed(server, steerable, stream):
    got = _create(server, stream, extra_body={"guided_regex": FORCED, "chat_template_kwargs": THINK})
    assert got == ("I should greet.", "I should greet.", "Hello there", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_from_the_answer_after_the_reasoning(server, steerable, stream):
    call = r'<tool_call>\{"name": "wave", "arguments": \{"hand": "left"\}\}</tool_call>'
    regex = rf"<think>\nMaybe {call} now\.\n</think>\n\nOK\. {call}"
    rc, rs, content, calls, reason = _create(
        server, stream, tools=TOOLS, extra_body={"guided_regex": regex, "chat_template_kwargs": THINK}
    )
    assert rc == rs == 'Maybe <tool_call>{"name": "wave", "arguments": {"hand": "left"}}</tool_call> now.'
    assert content == "OK."
    assert [(n, json.loads(a)) for n, a in calls] == [("wave", {"hand": "left"})]
    assert reason == "tool_calls"


def test_a_constraint_is_refused_while_the_model_is_to_think(server):
    with server.http() as h:
        for field, value in [("guided_regex", "a+"), ("response_format", {"type": "json_object"})]:
            r = h.post(
                "/v1/chat/completions",
                json={"messages": MSGS, "max_tokens": 4, field: value, "chat_template_kwargs": THINK},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and "--reasoning-parser deepseek_r1" in err["message"]
            assert "enable_thinking" in err["message"]
        r = h.post(
            "/v1/chat/completions",
            json={
                "messages": MSGS,
                "max_tokens": 4,
                "tools": TOOLS,
                "tool_choice": "required",
                "chat_template_kwargs": THINK,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_server_default_kwargs_close_the_block_so_the_output_is_content(server, stream):
    # the server's default no_think=true: the prompt ends "</think>", the constraint is allowed,
    # and the output is all content even where it looks like reasoning
    got = _create(server, stream, extra_body={"guided_regex": r"plain</think> text"})
    assert got == (None, None, "plain</think> text", [], "stop")


def test_default_template_kwargs_render_under_the_request_s(server):
    tok = server.engine.tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    with server.http() as h:
        default = h.post("/tokenize", json={"messages": MSGS})
        overridden = h.post("/tokenize", json={"messages": MSGS, "chat_template_kwargs": THINK})
    assert default.json()["tokens"] == ids("Hi\nA:<think>\n\n</think>\n\n")
    assert overridden.json()["tokens"] == ids("Hi\nA:")


def test_serve_flags_for_reasoning_tools_and_template_defaults(capsys):
    from kvserve.entrypoints.openai.api_server import make_arg_parser

    ns = make_arg_parser().parse_args(
        [
            "--tool-call-parser",
            "pythonic",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
        ]
    )
    assert (ns.tool_call_parser, ns.enable_auto_tool_choice, ns.reasoning_parser) == (
        "pythonic",
        True,
        "qwen3",
    )
    assert ns.default_chat_template_kwargs == {"enable_thinking": False}
    assert make_arg_parser().parse_args([]).reasoning_parser is None
    for bad in ("[1]", "{", '{"tokenize": true}'):
        with pytest.raises(SystemExit):
            make_arg_parser().parse_args(["--default-chat-template-kwargs", bad])
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--reasoning-parser", "nope"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'nope'" in err and "deepseek_r1" in err and "qwen3" in err


@pytest.fixture(scope="module")
def qwen3_pythonic_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS),
        "tiny",
        shutdown_grace_s=2.0,
        chat_template=TEMPLATE,
        reasoning_parser="qwen3",
        tool_call_parser="pythonic",
    ) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_reasoning_then_pythonic_calls(qwen3_pythonic_server, steerable, stream):
    regex = r'<think>Wave\.</think>\n\[wave\(hand="left", times=2\)\]'
    rc, rs, content, calls, reason = _create(
        qwen3_pythonic_server, stream, tools=TOOLS, extra_body={"guided_regex": regex}
    )
    assert (rc, rs, content, reason) == ("Wave.", "Wave.", None, "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("wave", {"hand": "left", "times": 2})]
    # without a think block Qwen3's output is all content
    rc, rs, content, calls, reason = _create(
        qwen3_pythonic_server, stream, tools=TOOLS, extra_body={"guided_regex": r"No\. \[1\]"}
    )
    assert (rc, rs, content, calls, reason) == (None, None, "No. [1]", [], "stop")
