"""Reasoning parsers (no model): ``<think>`` blocks split into reasoning and content, for
``deepseek_r1`` and ``qwen3``, whole and streamed (deltas add up to the whole; no piece of a tag
is ever sent), with the prompt's open or closed block, and tool calls read after the reasoning."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.chat_output import ChoiceReader
from kvserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser, reasoning_parser_names
from kvserve.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from kvserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvserve.entrypoints.openai.tools import ChoiceToolCalls

PARSERS = [DeepSeekR1ReasoningParser, Qwen3ReasoningParser]


def _reader(cls, prompt="", tools=False):
    return ChoiceReader(cls(prompt), ChoiceToolCalls(HermesToolParser(), 1 << 30) if tools else None)


def _streamed(cls, text, cuts, prompt="", tools=False):
    """(reasoning, content, [(name, arguments)]) rebuilt from deltas of ``text`` cut at ``cuts``,
    checking that no reasoning delta carries the end tag."""
    reader = _reader(cls, prompt, tools)
    reasoning, content, calls = "", "", {}
    ends = sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    for k, end in enumerate(ends):
        r, c, t = reader.update(text[:end], k == len(ends) - 1)
        assert "</think>" not in r
        reasoning += r
        content += c
        for d in t:
            if d.id is not None:
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def _whole(cls, text, prompt="", tools=False):
    reasoning, content, calls = _reader(cls, prompt, tools).whole(text)
    return reasoning, content, [(c.function.name, c.function.arguments) for c in calls or []]


def test_registry_names_both_and_refuses_unknown():
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("cls", PARSERS)
def test_think_block_then_answer(cls):
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    assert _whole(cls, text) == ("The user greets me.", "Hello!", [])


def test_deepseek_reasons_without_an_opening_tag_qwen3_does_not():
    text = "Thinking it over.</think>Answer."
    assert _whole(DeepSeekR1ReasoningParser, text) == ("Thinking it over.", "Answer.", [])
    assert _whole(Qwen3ReasoningParser, text) == (None, text, [])
    # no end tag at all: R1 is still thinking (cut short), Qwen3 just answered
    assert _whole(DeepSeekR1ReasoningParser, "still going") == ("still going", None, [])
    assert _whole(Qwen3ReasoningParser, "plain answer") == (None, "plain answer", [])
    assert _whole(Qwen3ReasoningParser, "<think>cut short") == ("cut short", None, [])


@pytest.mark.parametrize("cls", PARSERS)
def test_the_prompt_opens_or_closes_the_block(cls):
    # R1 / Qwen3-Thinking templates open the block: output starts inside it, for both parsers
    assert _whole(cls, "why</think>because", prompt="<|Assistant|><think>\n") == ("why", "because", [])
    # thinking disabled (Qwen3 enable_thinking=false): the prompt closes an empty block
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _whole(cls, "Just content</think>", prompt=closed) == (None, "Just content</think>", [])
    assert cls(closed).output_is_content() and not cls("<think>\n").output_is_content()
    assert not cls("plain prompt").output_is_content()


@pytest.mark.parametrize("cls", PARSERS)
def test_partial_tags_are_held_back_while_streaming(cls):
    reader = _reader(cls)
    assert reader.update("<thi", False) == ("", "", [])
    assert reader.update("<think>abc </th", False) == ("abc", "", [])
    assert reader.update("<think>abc </think>", False) == ("", "", [])
    assert reader.update("<think>abc </think>\n\n", False) == ("", "", [])
    assert reader.update("<think>abc </think>\n\nOK", True) == ("", "OK", [])


@pytest.mark.parametrize("cls", PARSERS)
def test_a_tag_lookalike_is_released_as_text(cls):
    text = "<think>a </thinker> b</think>c"
    assert _whole(cls, text) == ("a </thinker> b", "c", [])
    reader = _reader(cls)
    assert reader.update("<think>a </thin", False)[0] == "a"
    assert reader.update("<think>a </think", False)[0] == ""
    assert reader.update("<think>a </thinke", False)[0] == " </thinke"


def test_tool_calls_are_read_only_after_the_reasoning():
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = f"<think>maybe {call} is wrong</think>\n\nSure. {call}"
    reasoning, content, calls = _whole(DeepSeekR1ReasoningParser, text, tools=True)
    assert reasoning == f"maybe {call} is wrong"
    assert content == "Sure."
    assert [(n, json.loads(a)) for n, a in calls] == [("f", {"x": 1})]
    # the reasoning never ended: nothing in it is a call
    assert _whole(DeepSeekR1ReasoningParser, f"maybe {call}", tools=True) == (f"maybe {call}", None, [])


TEXTS = [
    "<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 4.",
    "no tags at all, just words",
    "reasoning only</think>",
    "  <think>a</think>  b </think> c",
    '<think>x</think>\nok <tool_call>{"name": "f", "arguments": {"a": "</think>"}}</tool_call>',
    "<thinking>not a tag</thinking>",
    "<think><think>twice</think></think>",
    "",
]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(TEXTS),
    st.sampled_from(PARSERS),
    st.sampled_from(["", "<think>\n", "<think></think>"]),
    st.booleans(),
    st.lists(st.integers(0, 80), max_size=12),
)
def test_streamed_deltas_add_up_to_the_whole(text, cls, prompt, tools, cuts):
    reasoning, content, calls = _whole(cls, text, prompt, tools)
    s_reasoning, s_content, s_calls = _streamed(cls, text, cuts, prompt, tools)
    assert s_reasoning == (reasoning or "")
    assert s_content == (content or "")
    assert s_calls == calls
