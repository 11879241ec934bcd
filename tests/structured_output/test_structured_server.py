"""Structured outputs over HTTP (tiny random model): response_format, structured_outputs and
guided_* constrain the output; a bad constraint is a 400 naming its field and the next request
still succeeds; the official client's ``chat.completions.parse`` works."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.server_harness import running_server
from tests.structured_output.strategies import JSON_SCHEMAS, REGEXES, max_tokens_for, satisfiable


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=64, seed=0)
    with running_server(args, "tiny") as s:
        yield s


SCHEMA = {
    "type": "object",
    "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"enum": ["x", "y"]}},
    "required": ["k", "s"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_object_chat(server):
    client = server.client()
    for stream in (False, True):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200, temperature=0)
        rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(**kw, response_format=rf, stream=True)
                if c.choices
            )
        else:
            r = client.chat.completions.create(**kw, response_format=rf)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": "[0-9]{2}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{2}-[a-z]{2}", t)),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"regex": "q{2,4}"}}, lambda t: re.fullmatch("q{2,4}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "v" [0-9]'}}, lambda t: re.fullmatch("v[0-9]", t)),
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
    ],
)
def test_vllm_fields_on_completions(server, extra, check):
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 120, "n": 2, "temperature": 1.0, "seed": 3, **extra},
        )
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert check(c["text"]), c


MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "("}, "guided_regex"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
        # compiles, but no output can ever match it (checked on the first token mask)
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
        ({"guided_grammar": 'start: a\na: "x" a'}, "guided_grammar"),
        # past a limit of the grammar compiler
        ({"guided_json": {"type": "integer", "minimum": 1e30}}, "guided_json"),
        ({"guided_regex": "a{1000000}"}, "guided_regex"),
        ({"guided_choice": [f"c{i}" for i in range(5000)]}, "guided_choice"),
        ({"guided_json": MANY_OPTIONAL}, "guided_json"),
        ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20_000))}, "guided_grammar"),
        # fixed expansions past the repetition limit across rules
        (
            {
                "guided_grammar": "start: r0\n"
                + "".join(f"r{i}: r{i + 1} r{i + 1}\n" for i in range(60))
                + 'r60: "a"'
            },
            "guided_grammar",
        ),
        # within every pre-check, past the grammar engine's row limit once its first token is consumed
        (
            {
                "guided_grammar": "start: a | b\n"
                + "a: "
                + " | ".join(f'"w{i}"' for i in range(1000))
                + "\nb: "
                + " | ".join(f'"v{i}"' for i in range(1000))
            },
            "guided_grammar",
        ),
        ({"guided_grammar": 'start: b{100}\nb: c{100}\nc: "a"{100}'}, "guided_grammar"),
        # a required property that is the schema again: no finite JSON matches
        (
            {"guided_json": {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}},
            "guided_json",
        ),
    ],
)
def test_bad_constraint_is_400_naming_the_field_and_next_request_succeeds(server, extra, param):
    with server.http() as h:
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()
        ok = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "guided_regex": "z+"})
        assert ok.status_code == 200 and re.fullmatch("z+", ok.json()["choices"][0]["text"])
    server.wait_idle()


def test_too_many_optional_properties_in_response_format_and_tools_are_400(server):
    tool = {"type": "function", "function": {"name": "big", "parameters": MANY_OPTIONAL}}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": MANY_OPTIONAL}}
    msgs = [{"role": "user", "content": "hi"}]
    with server.http() as h:
        for extra, param in (
            ({"response_format": rf}, "response_format"),
            ({"tools": [tool], "tool_choice": "required"}, "tools"),
        ):
            r = h.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4, **extra}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param and "optional properties" in r.text, r.json()


MAKE = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/definitions/pt"}},
    "required": ["p", "q"],
    "additionalProperties": False,
    "$defs": {"pt": {"enum": ["a", "b"]}},
    "definitions": {"pt": {"type": "integer", "minimum": 0, "maximum": 9}},
}
# a recursive schema (refs to "#"), whose $defs name clashes with MAKE's
TREE = {
    "type": "object",
    "properties": {
        "pt": {"$ref": "#/$defs/pt"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
    },
    "required": ["pt"],
    "additionalProperties": False,
    "$defs": {"pt": {"type": "boolean"}},
}


def test_required_schema_hoists_each_tools_defs():
    from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
    from kvserve.entrypoints.openai.tools import required_schema

    req = ChatCompletionRequest(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        tools=[
            {"type": "function", "function": {"name": "mk", "parameters": MAKE}},
            {"type": "function", "function": {"name": "tree", "parameters": TREE}},
        ],
    )
    wrapper = required_schema(req.tools, True)
    good = [
        {"name": "mk", "parameters": {"p": "a", "q": 3}},
        {"name": "tree", "parameters": {"pt": True, "kids": [{"pt": False}]}},
    ]
    jsonschema.validate(good, wrapper)
    for bad in (
        [{"name": "mk", "parameters": {"p": True, "q": 3}}],  # tree's pt, not mk's
        [{"name": "mk", "parameters": {"p": "a", "q": "a"}}],  # $defs' pt, not definitions'
        [{"name": "tree", "parameters": {"pt": True, "kids": [{"pt": "a"}]}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, wrapper)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "mk"}}])
def test_tool_schemas_with_defs_are_accepted_and_calls_validate(server, choice):
    tools = [
        {"type": "function", "function": {"name": "mk", "parameters": MAKE}},
        {"type": "function", "function": {"name": "tree", "parameters": TREE}},
    ]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 60,
        "temperature": 0,
    }
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={**body, "tools": tools, "tool_choice": choice})
    assert r.status_code == 200, r.text
    if choice == "auto":
        return  # the random model writes no tool-call block: only that the schemas are accepted
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls, r.json()
    for c in calls:
        jsonschema.validate(
            json.loads(c["function"]["arguments"]), {"mk": MAKE, "tree": TREE}[c["function"]["name"]]
        )


class Point(BaseModel):
    label: str = Field(max_length=4)
    x: int = Field(ge=-5, le=5)
    ok: bool


def test_openai_client_parse_with_pydantic_model(server):
    client = server.client()
    r = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "a point"}],
        response_format=Point,
        max_tokens=200,
        temperature=0,
    )
    p = r.choices[0].message.parsed
    assert isinstance(p, Point) and -5 <= p.x <= 5 and len(p.label) <= 4


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    schemas=st.lists(
        JSON_SCHEMAS.filter(lambda s: satisfiable(s) and max_tokens_for(s) <= 120), min_size=3, max_size=4
    ),
    regexes=st.lists(REGEXES, min_size=2, max_size=3),
)
def test_random_constraints_streamed_and_not_always_validate(server, schemas, regexes):
    """Random JSON schemas (hypothesis-jsonschema) and regexes over /v1/completions, sent at once
    (one batch), each streamed and not: every text validates and finishes ``stop``."""
    jobs = []
    for i, schema in enumerate(schemas):
        so = {"json": schema, "disable_any_whitespace": True}
        check = lambda t, s=schema: jsonschema.validate(json.loads(t), s)  # noqa: E731
        jobs += [(f"J{i}", so, max_tokens_for(schema), stream, check) for stream in (False, True)]
    for j, rx in enumerate(regexes):
        check = lambda t, rx=rx: re.fullmatch(rx, t) or pytest.fail(f"{t!r} does not match {rx!r}")  # noqa: E731
        jobs += [(f"R{j}", {"regex": rx}, 60, stream, check) for stream in (False, True)]
    client = server.client()

    def run(job):
        prompt, so, max_tokens, stream, _ = job
        kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=3)
        if not stream:
            c = client.completions.create(**kw, extra_body={"structured_outputs": so}).choices[0]
            return c.text, c.finish_reason
        text, reason = "", None
        for chunk in client.completions.create(**kw, stream=True, extra_body={"structured_outputs": so}):
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for job, (text, reason) in zip(jobs, results):
        assert reason == "stop", (job[:2], text, reason)
        job[4](text)
