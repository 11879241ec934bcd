"""Tool calling on the default model (SmolLM2-135M-Instruct). Its chat template never reads
``tools`` (it renders role and content only), so with ``auto`` it answers in text; ``required``
and a named function still give calls that validate, because the output is constrained."""

import json

import jsonschema
import pytest

from tests.entrypoints.openai.conftest import MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    }
]
MSGS = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


def test_default_model_template_ignores_tools(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    with_tools = tok.apply_chat_template(MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert with_tools == tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)


def test_default_model_named_and_required_calls_validate(server):
    client = server.client()
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        for stream in (False, True):
            kw = dict(
                model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0
            )
            if stream:
                args, reason = "", None
                for chunk in client.chat.completions.create(**kw, stream=True):
                    for ch in chunk.choices:
                        for t in ch.delta.tool_calls or []:
                            assert t.index == 0
                            args += t.function.arguments or ""
                        reason = ch.finish_reason or reason
            else:
                r = client.chat.completions.create(**kw)
                (call,) = r.choices[0].message.tool_calls
                assert call.function.name == "get_weather" and call.id.startswith("call_")
                args, reason = call.function.arguments, r.choices[0].finish_reason
            assert reason == "tool_calls", (choice, stream)
            jsonschema.validate(json.loads(args), WEATHER)


def test_default_model_auto_answers_in_text(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=12, temperature=0
    )
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.message.content
    assert ch.finish_reason in ("stop", "length")
