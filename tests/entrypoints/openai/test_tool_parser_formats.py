"""The Llama 3 JSON, Mistral and pythonic tool-call formats (no model): calls and content, whole
and streamed (deltas add up to the whole), partial markers held back, malformed output given
back as content."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from kvserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from kvserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from tests.entrypoints.openai.test_tool_parsers import _streamed, _whole

PARSERS = {"llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser, "pythonic": PythonicToolParser}


def _calls(parser, text):
    content, calls = _whole(parser, text)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def test_registry_has_every_format():
    assert set(PARSERS) | {"hermes"} == set(tool_parser_names())
    for name, cls in PARSERS.items():
        assert get_tool_parser(name) is cls


def test_llama3_json_calls_with_and_without_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _calls(Llama3JsonToolParser(), one) == (None, [("get_weather", {"city": "Paris"})])
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, "}"]}}'
    assert _calls(Llama3JsonToolParser(), two) == (None, [("a", {}), ("b", {"x": [1, "}"]})])
    after = '{"name": "a", "parameters": {"k": 1}}\nDone.'
    assert _calls(Llama3JsonToolParser(), after) == ("Done.", [("a", {"k": 1})])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"answer": 42}',  # JSON, but not a call
        '{"name": 5, "parameters": {}}',  # the name is not a string
        "<|python_tag|>print(1)",  # code for a built-in tool, not JSON
        '{"nam',
    ],
)
def test_llama3_json_malformed_is_content(text):
    assert _calls(Llama3JsonToolParser(), text) == (text, [])


def test_llama3_json_cut_short_call_is_an_incomplete_call():
    snap = Llama3JsonToolParser().parse('{"name": "f", "parameters": {"a": 1', True)
    assert [(c.name, c.arguments, c.complete) for c in snap.tool_calls] == [("f", '{"a": 1', False)]
    assert snap.content == ""


def test_llama3_json_holds_back_until_decided():
    p = Llama3JsonToolParser()
    assert p.parse("  <|python", False).content == ""
    assert p.parse('{"na', False).content == ""
    assert p.parse('{"answer": 4', False).content == ""
    assert p.parse('{"answer": 4}', False).content == '{"answer": 4}'
    assert p.parse("Hi", False).content == "Hi"


def test_mistral_calls_after_content_and_ids():
    text = 'Sure.\n[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    content, calls = _whole(MistralToolParser(), text)
    assert content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    single = '[TOOL_CALLS]{"name": "f", "arguments": {"a": 2}}'
    assert _calls(MistralToolParser(), single) == (None, [("f", {"a": 2})])


@pytest.mark.parametrize(
    "text",
    [
        "plain [TOOL words",
        "[TOOL_CALLS] not json",
        '[TOOL_CALLS] [{"answer": 1}]',
        "[TOOL_CALLS] [1, 2]",
        "[TOOL_CALLS]",
        '[TOOL_CALLS] [{"na',
    ],
)
def test_mistral_malformed_is_content(text):
    assert _calls(MistralToolParser(), text) == (text, [])


def test_mistral_holds_back_a_partial_marker():
    p = MistralToolParser()
    assert p.parse("Hello [TOOL_CA", False).content == "Hello"
    assert p.parse("Hello [TOOL_CALLS] [", False).content == "Hello"
    assert p.parse("Hello [TOOLS", False).content == "Hello [TOOLS"


def test_pythonic_calls_literals_only():
    text = '[get_weather(city="Paris", days=3), get_time(tz=\'CET\', opts={"a": [1, -2.5, None, true]})]'
    assert _calls(PythonicToolParser(), text) == (
        None,
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            ("get_time", {"tz": "CET", "opts": {"a": [1, -2.5, None, True]}}),
        ],
    )
    tagged = "<|python_start|>[f()]<|python_end|> ok"
    assert _calls(PythonicToolParser(), tagged) == ("ok", [("f", {})])


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "[1] Smith et al.",
        "[f(1)]",  # a positional argument
        "[f(a=g())]",  # not a literal
        "[f(a=x)]",  # a name
        "[f(**kw)]",
        "[__import__('os').system('true')]",
        "[f(a=1e999)]",  # not finite
        "[f(a=b'x')]",
        "[]",
        "[f(a=1",  # cut short
        "[f(a='])'",
    ],
)
def test_pythonic_malformed_is_content(text):
    assert _calls(PythonicToolParser(), text) == (text, [])


def test_pythonic_holds_back_until_the_list_closes():
    p = PythonicToolParser()
    assert p.parse('[f(a="]', False) == p.parse('[f(a="]', False)
    assert p.parse('[f(a="]', False).content == "" and not p.parse('[f(a="]', False).tool_calls
    snap = p.parse('[f(a="]")]', False)
    assert [c.name for c in snap.tool_calls] == ["f"] and json.loads(snap.tool_calls[0].arguments) == {
        "a": "]"
    }
    assert PythonicToolParser().parse("[f()] <|python_e", False).content == ""


TEXTS = {
    "llama3_json": [
        '<|python_tag|>{"name": "a", "parameters": {"x": "y;z"}}; {"name": "b", "parameters": {"n": [1, 2]}}',
        '  {"name": "a", "parameters": {"q": "}"}} trailing words ',
        '{"answer": {"name": "x"}}',
        '{"name": "a", "parameters": {"x": 1}}; {"oops": 1}',
        "just text {not json}",
        "",
    ],
    "mistral": [
        'Hi [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}] bye',
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"bad": 1}]',
        "[TOOL_CALLS] nope",
        "text [TOOL_ and more [TOOL_CALLS]",
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1',
    ],
    "pythonic": [
        '[a(x="]", y=[1, 2]), b()] done',
        "<|python_start|>[a(x=1)]<|python_end|>",
        "[1, 2] are numbers",
        "[a(x=1), 3]",
        "[a(x=",
        "no list here",
    ],
}


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from([(n, t) for n, ts in TEXTS.items() for t in ts]),
    st.lists(st.integers(0, 120), max_size=14),
)
def test_streamed_deltas_add_up_to_the_whole(case, cuts):
    name, text = case
    content, calls = _whole(PARSERS[name](), text)
    s_content, s_calls = _streamed(PARSERS[name](), text, cuts)
    assert s_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in s_calls] == [
        (c.function.name, c.function.arguments) for c in calls or []
    ]
