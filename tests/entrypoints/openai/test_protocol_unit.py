"""Unit tests of the server's request models and error mapping (no model, no server)."""

import pytest
from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import (
    HARMLESS_FIELDS,
    MAX_CHAT_MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.serving_engine import (
    APIError,
    api_error_from_validation,
    api_error_from_value_error,
    param_from_message,
)
from kvserve.sampling_params import SamplingParams


def _err(model, body: str) -> APIError:
    with pytest.raises(ValidationError) as ei:
        model.model_validate_json(body)
    return api_error_from_validation(ei.value)


@pytest.mark.parametrize("prompt", ['"text"', '["a", "b"]', "[1, 2, 3]", "[[1, 2], [3]]", "[]", '[""]'])
def test_prompt_forms_parse(prompt):
    req = CompletionRequest.model_validate_json(f'{{"prompt": {prompt}}}')
    assert req.max_tokens == 16 and req.n == 1 and req.stream is False


@pytest.mark.parametrize("value", ["2.5", '"10"', "true", "2.0"])
def test_max_tokens_must_be_a_json_integer(value):
    e = _err(CompletionRequest, f'{{"prompt": "x", "max_tokens": {value}}}')
    assert e.status == 400 and e.param == "max_tokens"
    assert "max_tokens" in e.message and "an integer in [1, 2**63 - 1]" in e.message


def test_union_and_nested_errors_name_the_top_level_field():
    assert _err(CompletionRequest, '{"prompt": [1.5]}').param == "prompt"
    assert _err(CompletionRequest, '{"prompt": "x", "stop": 3}').param == "stop"
    e = _err(ChatCompletionRequest, '{"messages": [{"role": "user", "content": 5}]}')
    assert e.param == "messages" and "messages[0].content" in e.message
    assert _err(ChatCompletionRequest, '{"messages": [{"content": "x"}]}').code == "missing_field"
    assert _err(CompletionRequest, '{"max_tokens": 3}').param == "prompt"


def test_numbers_are_strict_and_finite():
    assert _err(CompletionRequest, '{"prompt": "x", "temperature": "0.5"}').param == "temperature"
    assert _err(CompletionRequest, '{"prompt": "x", "temperature": NaN}').param == "temperature"
    assert CompletionRequest.model_validate_json('{"prompt": "x", "temperature": 1}').temperature == 1.0


def test_bad_json_and_non_object():
    assert _err(CompletionRequest, "{oops").code == "invalid_json"
    e = _err(CompletionRequest, "[1]")
    assert e.status == 400 and e.param is None


@pytest.mark.parametrize(
    "model,body,path",
    [
        (CompletionRequest, '{"prompt": "x", "some_future_field": 1}', "some_future_field"),
        (CompletionRequest, '{"prompt": "x", "Temperature": 1}', "Temperature"),
        (
            CompletionRequest,
            '{"prompt": "x", "stream_options": {"continuous_usage_stats": true}}',
            "stream_options.continuous_usage_stats",
        ),
        (
            ChatCompletionRequest,
            '{"messages": [{"role": "user", "content": "x"}], "guided_decoding_backend": "x"}',
            "guided_decoding_backend",
        ),
        (
            ChatCompletionRequest,
            '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
            "messages[0].content[0].image_url",
        ),
        (TokenizeRequest, '{"prompt": "x", "return_token_strs": true}', "return_token_strs"),
        (DetokenizeRequest, '{"tokens": [1], "foo": 1}', "foo"),
    ],
)
def test_unknown_field_is_a_400_naming_it(model, body, path):
    e = _err(model, body)
    assert e.status == 400 and e.param == path and e.code == "unsupported_field"
    assert repr(path) in e.message


@pytest.mark.parametrize("model", [ChatCompletionRequest, TokenizeRequest])
def test_more_messages_than_the_cap_is_a_400_naming_messages_and_the_cap(model):
    import json

    msg = {"role": "user", "content": "hi"}
    assert len(model.model_validate_json(json.dumps({"messages": [msg] * MAX_CHAT_MESSAGES})).messages) == (
        MAX_CHAT_MESSAGES
    )
    e = _err(model, json.dumps({"messages": [msg] * (MAX_CHAT_MESSAGES + 1)}))
    assert e.status == 400 and e.param == "messages"
    assert f"at most {MAX_CHAT_MESSAGES} items" in e.message and str(MAX_CHAT_MESSAGES + 1) in e.message


def test_unknown_field_is_named_before_other_errors():
    e = _err(CompletionRequest, '{"prompt": "x", "max_tokens": "a", "guided_decoding_backend": "x"}')
    assert e.param == "guided_decoding_backend"


@pytest.mark.parametrize("route,model", [("completions", CompletionRequest), ("chat", ChatCompletionRequest)])
def test_harmless_fields_are_declared(route, model):
    assert set(HARMLESS_FIELDS[route]) <= set(model.model_fields)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=2.0), "top_p"),
        (dict(n=0), "n"),
        (dict(temperature=-1.0), "temperature"),
        (dict(logprobs=40), "logprobs"),
        (dict(top_k=0), "top_k"),
        (dict(stop=[""]), "stop"),
        (dict(logit_bias={1: 300}), "logit_bias"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_sampling_param_errors_map_to_their_field(kwargs, param):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    e = api_error_from_value_error(ei.value)
    assert e.status == 400 and e.param == param and e.type == "BadRequestError"


def test_engine_messages_map_to_fields():
    assert (
        param_from_message("prompt (8 tokens) + max_tokens (25) = 33 > max_model_len (32).") == "max_tokens"
    )
    e = api_error_from_value_error(
        ValueError("prompt (8 tokens) + max_tokens (25) = 33 > max_model_len (32).")
    )
    assert e.code == "context_length_exceeded"
    assert param_from_message("prompt must contain at least 1 token; got an empty string.") == "prompt"
    assert param_from_message("prompt_token_ids must be integers in [0, 10); got [11].") == "prompt"
    assert param_from_message("prompt must contain at least 1 token", {"prompt": "messages"}) == "messages"
    assert param_from_message("something odd happened") is None


def test_a_prompt_longer_than_the_context_is_charged_to_the_prompt():
    """Whatever max_tokens says, a prompt of >= max_model_len tokens is the prompt's fault
    (the server used to name max_tokens); a prompt that fits with a too-large max_tokens is
    still max_tokens' fault."""
    from kvserve.engine.input_processor import validate_request

    with pytest.raises(ValueError) as ei:
        validate_request(
            list(range(40)), SamplingParams(max_tokens=5), vocab_size=100, max_model_len=32, max_num_seqs=4
        )
    e = api_error_from_value_error(ei.value, {"prompt": "messages"})
    assert (e.param, e.code) == ("messages", "context_length_exceeded"), (e.param, str(ei.value))
    with pytest.raises(ValueError) as ei:
        validate_request(
            list(range(20)), SamplingParams(max_tokens=20), vocab_size=100, max_model_len=32, max_num_seqs=4
        )
    assert api_error_from_value_error(ei.value).param == "max_tokens"


def test_error_body_shape():
    body = APIError("bad", 400, param="n", code="invalid_value").body()
    assert body == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "n", "code": "invalid_value"}
    }
