"""A field the request's path would not read is a 400 naming it, never a silent 200: output
constraints and output options under ``use_beam_search``, whitespace options without a JSON
constraint, unknown keys inside ``structured_outputs`` / ``response_format.json_schema`` and on
chat messages, ``stream_options`` without ``stream``; unknown-field errors stay small however
many keys the body has; a beam search's request-log line carries its real outputs."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.entrypoints.openai.serving_engine import (
    MAX_UNKNOWN_NAMES,
    APIError,
    api_error_from_validation,
)
from kvserve.entrypoints.openai.structured_outputs import structured_outputs_from_request
from tests.server_harness import running_server

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hi"}]


def _validation_error(model, body: dict) -> APIError:
    with pytest.raises(ValidationError) as ei:
        model.model_validate_json(json.dumps(body))
    return api_error_from_validation(ei.value)


def _constraint_error(body: dict) -> APIError:
    req = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **body}))
    with pytest.raises(APIError) as ei:
        structured_outputs_from_request(req)
    return ei.value


# ---------------------------------------------------------------------------- unit: constraints
@pytest.mark.parametrize(
    "body,param,named",
    [
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_whitespace_pattern"),
        (
            {"guided_regex": "a+", "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
            "structured_outputs",
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
            "structured_outputs",
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " ", "disable_any_whitespace": True}},
            "structured_outputs",
            "disable_any_whitespace",
        ),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " "}, "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "structured_outputs",
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": {"schema": {"type": "object"}}}},
            "response_format",
            "json_object",
        ),
        (
            {"response_format": {"type": "text", "json_schema": {"schema": {"type": "object"}}}},
            "response_format",
            "response_format.json_schema",
        ),
    ],
)
def test_a_constraint_option_the_constraint_would_not_read_is_a_400(body, param, named):
    err = _constraint_error(body)
    assert err.status == 400 and err.param == param, (err.param, err.message)
    assert named in err.message


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"}, "[ ]?"),
        ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "[ ]?"}, "[ ]?"),
        ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, " "),
        ({"structured_outputs": {"json_object": True}, "guided_whitespace_pattern": "\n?"}, "\n?"),
    ],
)
def test_whitespace_options_with_a_json_constraint_are_used(body, expected):
    req = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **body}))
    params = structured_outputs_from_request(req)
    assert params.kind in ("json", "json_object") and params.whitespace_pattern == expected


@pytest.mark.parametrize(
    "model,body,path",
    [
        (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a+", "bogus": 1}}, "bogus"),
        (
            CompletionRequest,
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}},
            },
            "x",
        ),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a", "weight": 2}]}, "weight"),
    ],
)
def test_unknown_keys_inside_objects_are_a_400_naming_them(model, body, path):
    err = _validation_error(model, body)
    assert err.status == 400 and err.code == "unsupported_field"
    assert err.param.endswith("." + path) and repr(err.param) in err.message, (err.param, err.message)


def test_an_error_lists_at_most_a_few_unknown_names():
    body = {"prompt": "x", **{f"k{i:06d}": i for i in range(20_000)}}
    err = _validation_error(CompletionRequest, body)
    assert err.param == "k000000"
    listed = [f"k{i:06d}" for i in range(20_000) if f"'k{i:06d}'" in err.message]
    assert listed == [f"k{i:06d}" for i in range(MAX_UNKNOWN_NAMES)]
    assert f"and {20_000 - MAX_UNKNOWN_NAMES} more" in err.message
    assert len(err.message) < 1000
    long = _validation_error(CompletionRequest, {"prompt": "x", "y" * 50_000: 1})
    assert len(long.message) < 1000 and len(long.param) < 1000 and long.param.startswith("yyy")


# ---------------------------------------------------------------------------- server (tiny model)
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    args = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=128, seed=0)
    with running_server(args, MODEL) as s:
        yield s


def _post(server, route: str, body: dict):
    with server.http() as h:
        return h.post(route, json={"model": MODEL, **body})


BEAM = {"prompt": "Hello", "max_tokens": 3, "use_beam_search": True, "best_of": 2}


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_beam_search_refuses_what_it_would_ignore(server, extra, param):
    r = _post(server, "/v1/completions", {**BEAM, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_beam_search_on_chat_is_a_400_naming_it(server):
    r = _post(server, "/v1/chat/completions", {"messages": MSGS, "use_beam_search": True, "best_of": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "use_beam_search"


def test_beam_search_honours_skip_special_tokens_and_logs_its_outputs(server, caplog):
    tok = server.engine.tokenizer
    # ignore_eos: the beams run the full max_tokens, so each choice holds exactly that many tokens
    body = {**BEAM, "n": 2, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="kvserve.server.requests"):
        r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 2 * 3
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "kvserve.server.requests"]
    line = next(ln for ln in lines if ln["request_id"] == out["id"])
    assert line["output_tokens"] == 2 * 3
    assert line["finish_reasons"] == [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert line["ttft_s"] is not None and 0 <= line["ttft_s"] <= line["e2e_s"]
    # the same beams decoded with special tokens kept: the texts differ only by those tokens
    kept = _post(server, "/v1/completions", {**body, "skip_special_tokens": False}).json()
    specials = [t for t in tok.all_special_tokens if t]
    for a, b in zip(out["choices"], kept["choices"], strict=True):
        assert not any(t in a["text"] for t in specials)
        stripped = b["text"]
        for t in specials:
            stripped = stripped.replace(t, "")
        assert stripped == a["text"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(server, route):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": MSGS}
    r = _post(server, route, {**body, "max_tokens": 1, "stream_options": {"include_usage": True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options"
    ok = _post(
        server, route, {**body, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert ok.status_code == 200


def test_chat_message_fields(server):
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "refusal": None, "audio": None, "annotations": []},
        {"role": "user", "content": "Again"},
    ]
    r = _post(server, "/v1/chat/completions", {"messages": history, "max_tokens": 1})
    assert r.status_code == 200, r.text
    for field, value in (("refusal", "no"), ("function_call", {"name": "f", "arguments": "{}"})):
        bad = [dict(m) for m in history]
        bad[1][field] = value
        r = _post(server, "/v1/chat/completions", {"messages": bad, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == f"messages[1].{field}" and field in err["message"], err
    r = _post(server, "/v1/chat/completions", {"messages": [{**MSGS[0], "weight": 2}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].weight", r.text
