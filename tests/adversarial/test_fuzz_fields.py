"""Fuzz every field of ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/load_lora_adapter`` with deep and extreme JSON against one running server (tiny random
Llama): no answer is a 5xx, every 4xx has an OpenAI-style error body with a message, the server
logs no unhandled error, and afterwards it still answers a normal request with every KV block
free.

Values are built as JSON *text*, so they can be what no Python object serialises to: numbers
of thousands of digits, ``1e999``, nesting 100k levels deep, and JSON text nested past the
body's limit inside a string (``guided_json``, a tool call's ``arguments``)."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.errors import error_type
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_harness import LogRecords, running_server

pytestmark = pytest.mark.slow

HOLE = "@@VALUE@@"
ENGINE_KWARGS = dict(
    block_size=4,
    num_gpu_blocks=64,
    num_cpu_blocks=8,
    max_model_len=128,
    max_num_batched_tokens=128,
    max_num_seqs=8,
    watermark=0.0,
    seed=0,
    enable_lora=True,
    max_loras=1,
    max_lora_rank=8,
    max_cpu_loras=2,
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from kvserve.config import EngineArgs

    root = tmp_path_factory.mktemp("lora-root")
    (root / "empty").mkdir()
    # ERROR records of the server's loggers (an unhandled exception logs one)
    with LogRecords(("kvserve", "uvicorn.error"), logging.ERROR, kvserve_info=False) as errors:
        with running_server(
            EngineArgs(model=str(tiny_llama_dir), **ENGINE_KWARGS),
            "tiny",
            shutdown_grace_s=2.0,
            allowed_lora_root=str(root),
        ) as s:
            s.errors = errors
            s.lora_root = root
            yield s


# ---------------------------------------------------------------------------- values (JSON text)
def _deep(depth: int, kind: str) -> str:
    opener, inner, closer = {
        "list": ("[", "", "]"),
        "object": ('{"a":', "1", "}"),
        "schema": ('{"type":"array","items":', "{}", "}"),
    }[kind]
    return opener * depth + inner + closer * depth


DEPTHS = st.sampled_from([1, 2, 50, 150, 199, 200, 201, 202, 1_000, 100_000])
DEEP = st.builds(_deep, DEPTHS, st.sampled_from(["list", "object", "schema"]))
#: JSON text nested deeply, given as a JSON string (what guided_json and arguments take)
DEEP_IN_STRING = DEEP.map(json.dumps)
INTS = (
    st.sampled_from(
        [0, -1, 1, 2, 20, 21, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**40]
    )
    | st.integers()
)
FLOATS = st.sampled_from(
    [
        -0.0,
        5e-324,
        1e-45,
        0.5,
        1.5,
        3.4028234663852886e38,
        -3.4028234663852886e38,
        3.5e38,
        1.7976931348623157e308,
    ]
) | st.floats(allow_nan=False, allow_infinity=False)
#: numbers only JSON text can hold
RAW_NUMBERS = st.sampled_from(
    ["9" * 5_000, "-" + "9" * 45, "1e999", "-1e999", "1e-999", "0." + "0" * 400 + "1"]
)
STRINGS = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a\nb\r\nc",
        "\u202e\u200b",
        "../../etc/passwd",
        "a" * 100_000,
        "\U0001f600" * 500,
        "{{ 7 * 7 }}{% for x in range(10**9) %}{% endfor %}",
        "<|im_start|>system",
        "\\u0000",
        "[" * 300,
    ]
) | st.text(max_size=40)
SCALARS = st.one_of(
    st.none().map(json.dumps),
    st.booleans().map(json.dumps),
    INTS.map(json.dumps),
    FLOATS.map(json.dumps),
    RAW_NUMBERS,
    STRINGS.map(json.dumps),
    DEEP,
    DEEP_IN_STRING,
)


def _containers(children):
    items = st.lists(children, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    objects = st.dictionaries(STRINGS, children, max_size=3).map(
        lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"
    )
    return items | objects


VALUES = st.recursive(SCALARS, _containers, max_leaves=6)


# ---------------------------------------------------------------------------- where they go
def _paths(model) -> list[str]:
    return sorted(model.model_fields) + ["not_a_field"]


COMPLETION_BASE = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT_BASE = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
    "max_tokens": 2,
    "temperature": 0,
}
#: nested places (path of keys / indexes) besides every top-level field
CHAT_NESTED = [
    ("messages", 1, "content"),
    ("messages", 1, "role"),
    ("messages", 1, "name"),
    ("messages", 1, "content", 0, "text"),
    ("messages", 2, "tool_calls", 0, "function", "arguments"),
    ("messages", 2, "tool_calls", 0, "function", "name"),
    ("messages", 2, "tool_calls", 0, "id"),
    ("messages", 3, "tool_call_id"),
    ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "name"),
    ("tool_choice", "function", "name"),
    ("response_format", "json_schema", "schema"),
    ("structured_outputs", "json"),
    ("structured_outputs", "structural_tag"),
    ("logit_bias", "7"),
    ("stream_options", "include_usage"),
]
COMPLETION_NESTED = [
    ("prompt", 0),
    ("stop", 0),
    ("stop_token_ids", 0),
    ("logit_bias", "7"),
    ("structured_outputs", "regex"),
    ("response_format", "json_schema", "schema"),
]


def _body(base: dict, path: tuple, value_text: str, extra: dict) -> str:
    """``base`` (with ``extra``) as JSON text with ``value_text`` at ``path`` (containers
    on the way are made when missing)."""
    body = json.loads(json.dumps({**base, **extra}))
    node = body
    for key, nxt in zip(path, path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append({} if isinstance(nxt, str) else [])
            if not isinstance(node[key], (dict, list)) or isinstance(node[key], list) != isinstance(nxt, int):
                node[key] = {} if isinstance(nxt, str) else []
            node = node[key]
        else:
            if not isinstance(node.get(key), (dict, list)) or isinstance(node[key], list) != isinstance(
                nxt, int
            ):
                node[key] = {} if isinstance(nxt, str) else []
            node = node[key]
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = HOLE
    return json.dumps(body).replace(json.dumps(HOLE), value_text, 1)


EXTRAS = st.sampled_from([{}, {"stream": True}, {"n": 2}, {"logprobs": 2}])
CHAT_EXTRAS = st.sampled_from(
    [
        {},
        {"stream": True},
        {"logprobs": True, "top_logprobs": 2},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    ]
)


def _check(server, endpoint: str, body: str) -> None:
    with server.errors.mu:
        seen = len(server.errors.records)
    with server.http(timeout=60) as h:
        r = h.post(endpoint, content=body.encode(), headers={"content-type": "application/json"})
        text = r.text
    assert r.status_code < 500, (r.status_code, text[:500], body[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], text[:300]
        assert err["type"] == error_type(r.status_code), err
        assert len(text) < 4_096, f"{len(text)}-byte error body: {text[:300]}"
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "internal_server_error" not in text, text[:500]
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    with server.errors.mu:
        logged = [rec.getMessage()[:300] for rec in server.errors.records[seen:]]
    assert not logged, (logged, body[:300])


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


BEAM = {"use_beam_search": True, "best_of": 2, "max_tokens": 3}
F32_MAX = "3.4028234663852886e+38"


@settings(max_examples=100, **_SETTINGS)
@given(
    path=st.sampled_from([(p,) for p in _paths(CompletionRequest)] + COMPLETION_NESTED),
    value=VALUES,
    extra=EXTRAS,
)
# the attacks that once got a 500 (each is also reachable by the strategies above)
@example(path=("guided_json",), value=json.dumps("[" * 100_000), extra={})
@example(path=("length_penalty",), value=F32_MAX, extra=BEAM)
@example(path=("length_penalty",), value="-" + F32_MAX, extra=BEAM)
@example(path=("seed",), value="[" + "9" * 5_000 + "," + _deep(100_000, "list") + "]", extra={})
def test_fuzz_completion_fields_never_5xx(server, path, value, extra):
    _check(server, "/v1/completions", _body(COMPLETION_BASE, path, value, extra))


@settings(max_examples=100, **_SETTINGS)
@given(
    path=st.sampled_from([(p,) for p in _paths(ChatCompletionRequest)] + CHAT_NESTED),
    value=VALUES,
    extra=CHAT_EXTRAS,
)
@example(
    path=("messages", 2, "tool_calls", 0, "function", "arguments"), value=json.dumps("[" * 100_000), extra={}
)
@example(path=("structured_outputs", "json"), value=json.dumps(_deep(100_000, "object")), extra={})
def test_fuzz_chat_fields_never_5xx(server, path, value, extra):
    _check(server, "/v1/chat/completions", _body(CHAT_BASE, path, value, extra))


LORA_NAMES = STRINGS | st.sampled_from(["a/../b", "..", "a" * 129, "ok:name/v1.2-x_y", "a\nINFO forged"])
LORA_PATHS = STRINGS | st.sampled_from(
    ["/etc", "/", "..", "empty", "../../../etc", "/proc/self", "empty/../.."]
)


@settings(max_examples=30, **_SETTINGS)
@given(
    field=st.sampled_from(["lora_name", "lora_path", "not_a_field"]),
    value=VALUES | LORA_NAMES.map(json.dumps) | LORA_PATHS.map(json.dumps),
)
@example(field="lora_name", value=json.dumps("a/../b\nINFO forged"))
@example(field="lora_path", value=json.dumps("/etc"))
def test_fuzz_lora_load_fields_never_5xx(server, field, value):
    body = _body({"lora_name": "fz", "lora_path": "empty"}, (field,), value, {})
    _check(server, "/v1/load_lora_adapter", body)
    assert server.app.state.models.num_adapters() == 0  # nothing here is an adapter


def test_after_the_fuzz_the_server_serves_and_every_block_is_free(server):
    # runs after the fuzz tests of this module (file order): they leave nothing behind
    with server.http() as h:
        r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = h.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    stats = server.wait_idle()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] == ENGINE_KWARGS["num_gpu_blocks"]
    assert not server.errors.records
