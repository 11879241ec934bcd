"""Tool-call parsers (no model): Hermes blocks -> calls and content; the forced (required /
named) outputs -> calls; streamed deltas always add up to the whole answer."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from kvserve.entrypoints.openai.tool_parsers.forced import NamedFunctionParser, RequiredToolsParser
from kvserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvserve.entrypoints.openai.tools import ChoiceToolCalls


def _whole(parser, text):
    return ChoiceToolCalls(parser, 1 << 30).whole(text)


def _streamed(parser, text, cuts):
    """Content and calls rebuilt from the deltas of ``text`` fed in pieces ending at ``cuts``."""
    reader = ChoiceToolCalls(parser, 1 << 30)
    content, calls = "", {}
    ends = sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    for k, end in enumerate(ends):
        delta, tool_deltas = reader.update(text[:end], k == len(ends) - 1)
        content += delta
        for d in tool_deltas:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def test_registry_has_hermes_and_names_unknown():
    assert "hermes" in tool_parser_names()
    assert get_tool_parser("hermes") is HermesToolParser
    try:
        get_tool_parser("nope")
    except ValueError as e:
        assert "nope" in str(e) and "hermes" in str(e)
    else:
        raise AssertionError("unknown parser accepted")


def test_hermes_two_calls_and_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "x": [1, {"y": "}"}]}}\n</tool_call>'
    )
    content, calls = _whole(HermesToolParser(), text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET", "x": [1, {"y": "}"}]}),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2


def test_hermes_plain_text_is_content_unchanged():
    text = "Hello there. a < b, and <tool is not a tag "
    assert _whole(HermesToolParser(), text) == (text, None)


def test_hermes_arguments_as_string_parameters_key_and_missing_close_tag():
    p = HermesToolParser()
    _, calls = _whole(p, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0].function.arguments == '{"a": 1}'
    _, calls = _whole(p, '<tool_call>{"name": "f", "parameters": {"a": 2}}')
    assert json.loads(calls[0].function.arguments) == {"a": 2}
    _, calls = _whole(p, '<tool_call>{"name": "f"}</tool_call>')
    assert calls[0].function.arguments == "{}"


def test_hermes_malformed_block_is_content():
    text = "<tool_call>not json</tool_call> ok"
    assert _whole(HermesToolParser(), text) == (text, None)


def test_hermes_holds_back_a_partial_tag_while_streaming():
    p = HermesToolParser()
    assert p.parse("Hi <tool_", final=False).content == "Hi"
    assert p.parse("Hi <tool_", final=True).content == "Hi <tool_"
    snap = p.parse('Hi <tool_call>{"name": "f", "arguments": {"a"', final=False)
    assert snap.content == "Hi" and snap.tool_calls[0].name == "f"
    assert snap.tool_calls[0].arguments == '{"a"' and not snap.tool_calls[0].complete


def test_required_and_named_outputs():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls = _whole(RequiredToolsParser(), text)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    content, calls = _whole(NamedFunctionParser("g"), ' {"q": "s"}')
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("g", '{"q": "s"}')
    ]


_ARG = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text("ab}{][\"'\\ <>/", max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("kq", max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.text("ab <>/\n_", max_size=8).map(lambda t: ("text", t)),
            st.tuples(
                st.sampled_from(["f", "g_h"]),
                st.dictionaries(st.text("xy", min_size=1, max_size=2), _ARG, max_size=3),
            ).map(lambda c: ("call", c)),
        ),
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 300), max_size=12),
    compact=st.booleans(),
)
def test_hermes_stream_deltas_add_up_to_the_whole_answer(pieces, cuts, compact):
    sep = (",", ":") if compact else (", ", ": ")
    text = ""
    expected = []
    for kind, v in pieces:
        if kind == "text":
            text += v
        else:
            name, args = v
            text += (
                "<tool_call>\n"
                + json.dumps({"name": name, "arguments": args}, separators=sep)
                + "\n</tool_call>"
            )
            expected.append((name, args))
    content, calls = _whole(HermesToolParser(), text)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]
    if "<tool_call" in "".join(v for k, v in pieces if k == "text"):
        return  # free text that itself opens a block is a different test
    assert got == expected
    s_content, s_calls = _streamed(HermesToolParser(), text, cuts)
    assert s_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in s_calls] == [
        (c.function.name, c.function.arguments) for c in calls or []
    ]


@settings(max_examples=80, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.dictionaries(st.text("xy", min_size=1, max_size=2), _ARG, max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
    cuts=st.lists(st.integers(0, 300), max_size=12),
)
def test_required_stream_deltas_add_up_to_the_whole_answer(calls, cuts):
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls])
    _, whole = _whole(RequiredToolsParser(), text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == calls
    _, s_calls = _streamed(RequiredToolsParser(), text, cuts)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_serve_flag_tool_call_parser():
    import pytest

    from kvserve.entrypoints.openai.api_server import make_arg_parser

    assert make_arg_parser().parse_args([]).tool_call_parser == "hermes"
    assert make_arg_parser().parse_args(["--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--tool-call-parser", "nope"])
