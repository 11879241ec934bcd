"""Tool calling over HTTP with the official client (tiny random model): ``required`` and a named
function are enforced by structured outputs (the calls always validate against the schemas),
``auto`` reads Hermes ``<tool_call>`` blocks (here steered by a regex constraint); streamed and
not; a multi-turn conversation with a tool result; bad tool fields are a 400 naming them."""

import json

import jsonschema
import openai
import pytest

from tests.server_harness import running_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=64, seed=0)
    with running_server(args, "tiny") as s:
        yield s


def _create(server, stream, **kw):
    """(content, [(id, name, arguments)], finish_reason) of one choice, streamed or not."""
    client = server.client()
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 120, "temperature": 0, "tools": TOOLS, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.type == "function" for c in m.tool_calls or [])
        return m.content, calls, r.choices[0].finish_reason
    content, calls, reason = "", {}, None
    for k, chunk in enumerate(client.chat.completions.create(**kw, stream=True)):
        for ch in chunk.choices:
            d = ch.delta
            if k == 0:  # the role rides on the first content or call, nothing comes before it
                assert d.role == "assistant" and (d.content or d.tool_calls or ch.finish_reason), chunk
            else:
                assert d.role is None, chunk
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.id is not None:  # a call's first delta: index, id, type, name
                    assert t.index not in calls and t.type == "function" and t.function.name
                    calls[t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.function.name is None
                calls[t.index][2] += t.function.arguments or ""
            reason = ch.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


def _check_calls(calls, names=None):
    assert calls
    for cid, name, args in calls:
        assert cid.startswith("call_") and len(cid) > 10
        assert name in (names or SCHEMAS)
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_called_with_valid_arguments(server, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, calls, reason = _create(server, stream, tool_choice=choice)
    assert reason == "tool_calls" and content is None
    assert len(calls) == 1
    _check_calls(calls, ["get_time"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_single_call_validates(server, stream):
    content, calls, reason = _create(server, stream, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls" and content is None and len(calls) == 1
    _check_calls(calls)


@pytest.mark.parametrize("seed", [0, 1])
def test_required_parallel_calls_validate_streamed_and_not(server, seed):
    # The random model never closes the array, so it runs to max_tokens: every call it
    # finished validates, the cut one is last, and the reason is "length", not "tool_calls".
    kw = dict(tool_choice="required", temperature=1.0, seed=seed, max_tokens=100)
    whole = _create(server, False, **kw)
    streamed = _create(server, True, **kw)
    for content, calls, reason in (whole, streamed):
        assert content is None and len(calls) >= 2
        if reason == "length":
            calls = calls[:-1]
        else:
            assert reason == "tool_calls"
        _check_calls(calls)
    # same seed, same tokens: the stream carries the same calls (ids are per response)
    assert [c[1:] for c in whole[1]] == [c[1:] for c in streamed[1]]
    assert whole[2] == streamed[2]


# The tiny model is steered into Hermes' format with a regex constraint: "auto" reads the text.
HERMES_REGEX = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-3]\}\}\n'
    r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(CET|UTC)"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_tool_calls(server, stream):
    content, calls, reason = _create(
        server, stream, tool_choice="auto", extra_body={"guided_regex": HERMES_REGEX}, max_tokens=200
    )
    assert reason == "tool_calls"
    assert content == "Checking."
    assert [c[1] for c in calls] == ["get_weather", "get_time"]
    _check_calls(calls)


def test_auto_parallel_false_keeps_the_first_call(server):
    content, calls, reason = _create(
        server, False, extra_body={"guided_regex": HERMES_REGEX}, max_tokens=200, parallel_tool_calls=False
    )
    assert [c[1] for c in calls] == ["get_weather"] and content == "Checking."


def test_auto_without_a_call_is_plain_content(server):
    client = server.client()
    kw = dict(model="tiny", messages=MSGS, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    auto = client.chat.completions.create(**kw, tools=TOOLS).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason == plain.finish_reason == "length"
    assert auto.message.content  # the model's text, not lost


def test_multi_turn_with_a_tool_result(server):
    client = server.client()
    first = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    history = MSGS + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=6, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result are in the prompt
    # and again, forced, after the result
    third = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    _check_calls([(c.id, c.function.name, c.function.arguments) for c in third.choices[0].message.tool_calls])


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"messages": MSGS + [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field(server, extra, param):
    client = server.client()
    kw = dict(model="tiny", messages=MSGS, max_tokens=4)
    kw.update(extra)
    messages = kw.pop("messages")
    if "guided_regex" in kw:
        kw["extra_body"] = {"guided_regex": kw.pop("guided_regex")}
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(messages=messages, **kw)
    assert ei.value.body["param"] == param, ei.value.body
    # the server keeps serving
    assert client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2).choices


def test_tools_and_tool_messages_reach_the_chat_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    from kvserve.entrypoints.openai.protocol import ChatMessage
    from kvserve.entrypoints.openai.serving_chat import render_chat, render_messages

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }})"
        "{% endfor %}{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}"
    )
    msgs = [
        ChatMessage(role="user", content="hi"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    text = render_chat(
        tok,
        render_messages(msgs),
        False,
        [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
    )
    assert text == (
        f"[tool get_time {json.dumps(TIME)}]<user>hi<assistant>(call call_1 get_weather Rome)<tool>sunny(result of call_1)"
    )
