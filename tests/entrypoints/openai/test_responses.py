"""``/v1/responses`` through the official ``openai`` client: text and message inputs,
instructions, streaming events (their text equals the whole response's), a conversation
continued by ``previous_response_id``, a JSON schema, a function tool, retrieval, and errors
named by the Responses fields."""

import json

import openai
import pytest

from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

GREEDY = dict(model="tiny", temperature=0.0, max_output_tokens=8)


@pytest.fixture(scope="module")
def resp_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    kwargs = {
        **TINY_SERVER_KWARGS,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "num_gpu_blocks": 128,
    }
    with running_server(EngineArgs(model=str(tiny_llama_dir), **kwargs), "tiny", shutdown_grace_s=2.0) as s:
        yield s


def _chat_text(server, messages, **kw):
    r = server.client().chat.completions.create(model="tiny", messages=messages, temperature=0.0, **kw)
    return r.choices[0].message.content, r.usage


def test_text_input_with_instructions_equals_the_chat_completion(resp_server):
    c = resp_server.client()
    r = c.responses.create(input="Hello there", instructions="Be brief.", **GREEDY)
    text, usage = _chat_text(
        resp_server,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_completion_tokens=8,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert c.responses.retrieve(r.id).output_text == text


def test_stream_events_add_up_to_the_whole_response(resp_server):
    c = resp_server.client()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Tell me"}]}]
    whole = c.responses.create(input=items, **GREEDY)
    events = list(c.responses.create(input=items, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(resp_server):
    c = resp_server.client()
    first = c.responses.create(input="First question", **GREEDY)
    second = c.responses.create(input="And then?", previous_response_id=first.id, **GREEDY)
    text, _ = _chat_text(
        resp_server,
        [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        max_completion_tokens=8,
    )
    assert second.output_text == text and second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="x", previous_response_id="resp_missing", **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def test_json_schema_format_constrains_the_output(resp_server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = resp_server.client().responses.create(
        input="Give JSON",
        text={"format": {"type": "json_schema", "name": "obj", "schema": schema, "strict": True}},
        model="tiny",
        temperature=0.0,
        max_output_tokens=40,
    )
    # the same constraint as the chat route's response_format (a random model may run out of
    # tokens inside the object, so the texts are compared, not parsed)
    text, _ = _chat_text(
        resp_server,
        [{"role": "user", "content": "Give JSON"}],
        max_completion_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "obj", "schema": schema, "strict": True},
        },
    )
    assert r.output_text == text and text.lstrip().startswith("{")


def test_required_function_tool_gives_a_function_call_item_and_takes_its_output(resp_server):
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    c = resp_server.client()
    r = c.responses.create(
        input="Weather?", tools=[tool], tool_choice="required", model="tiny", max_output_tokens=60
    )
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = c.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=r.id,
        **GREEDY,
    )
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ],
)
def test_bad_requests_are_a_400_naming_the_responses_field(resp_server, body, param):
    with resp_server.http() as h:
        r = h.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
