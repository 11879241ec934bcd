"""What the completion and chat handlers share: errors, body parsing, prompt validation,
admission (capacity, draining), running several engine requests as one HTTP request, client
disconnect handling, token decoding for logprobs, and the per-request log line.

Admission order for a generation request (every check before anything is queued):
auth (api_server) -> body size (413) -> JSON / types (400) -> model name (404) -> sampling
fields (400, ``SamplingParams``) -> tokenization and per-prompt limits (400:
``engine.validate``, ``engine.check_admissible``) -> draining / ``max_waiting`` (503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import anyio
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.input_processor import tokenize_prompt, truncate_prompt
from kvserve.entrypoints.openai.errors import (
    MAX_JSON_DEPTH,
    APIError,
)
from kvserve.entrypoints.openai.offload import OffloadPool, PoolBusyError
from kvserve.entrypoints.openai.protocol import MAX_CHAT_MESSAGES, UsageInfo
from kvserve.entrypoints.openai.tracing import RequestTracer
from kvserve.field_limits import LIMITS
from kvserve.lora_request import LoRARequest
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.transformers_utils.tokenizer_bounds import TokenTextBound

logger = logging.getLogger("kvserve.server")
request_logger = logging.getLogger("kvserve.server.requests")

#: Default limit on request bodies (bytes); ``--max-body-bytes`` changes it.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# The rule each field follows, appended to type and range errors ("got 2.5 (max_tokens must be
# an integer in [1, 2**63 - 1])") so that every 400 names the field and the limit; the numeric
# ones come from the same limits as the schema's constraints and SamplingParams.
_FIELD_RULES = {
    **{name: limit.rule() for name, limit in LIMITS.items() if name not in ("token_id", "logit_bias")},
    "logprobs": f"{LIMITS['logprobs'].rule()} (completions) or a boolean (chat)",
    "prompt": (
        f"a string, a list of strings, a list of token ids ({LIMITS['token_id'].rule()}) "
        "or a list of token-id lists"
    ),
    "stop": "a string or a list of strings",
    "stop_token_ids": f"a list of token ids ({LIMITS['token_id'].rule()})",
    "tokens": f"a list of token ids ({LIMITS['token_id'].rule()})",
    "logit_bias": f"a map of token id -> {LIMITS['logit_bias'].rule()}",
    "bad_words": "a list of non-empty strings",
    "allowed_token_ids": f"a non-empty list of token ids ({LIMITS['token_id'].rule()})",
    "messages": "a list of {role, content} messages",
    "lora_name": "a non-empty string (the adapter's model name)",
    "lora_path": "a non-empty string (a PEFT adapter directory)",
}

# Type tags pydantic puts into error locations of union members; not part of the field path.
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list\[.*\]|constrained-.*|nullable\[.*\]|[A-Z]\w*)$")

_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__) | {
    "prompt",
    "prompt_token_ids",
    "messages",
    "priority",
    "request_id",
    "max_completion_tokens",
    "top_logprobs",
    "echo",
    "best_of",
    "model",
}


class PendingCounter:
    """Server-wide count of admitted sub-requests not yet handed to the engine (between the
    ``max_waiting`` check and ``AsyncLLMEngine.generate`` putting them in its inbox); without
    it, a burst of requests would all pass the check before any of them is queued."""

    def __init__(self) -> None:
        self.value = 0


class Reservation:
    """``n`` places counted in a ``PendingCounter`` until each is consumed (handed to the
    engine) or the rest released (request over). Both are idempotent."""

    def __init__(self, counter: PendingCounter, n: int):
        self.counter, self.left = counter, n
        counter.value += n

    def consume(self) -> None:
        """One sub-request is now in the engine's inbox."""
        if self.left > 0:
            self.left -= 1
            self.counter.value -= 1

    def release(self) -> None:
        """Give back whatever was not consumed."""
        self.counter.value -= self.left
        self.left = 0


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its requests were aborted); the
    message says when (e.g. ``"mid-body: 10 of 200 bytes received"``). The app answers it
    with one INFO log line, never a traceback."""


def param_from_message(message: str, rename: dict[str, str] | None = None) -> str | None:
    """The request field a ``ValueError`` from the engine or ``SamplingParams`` is about.

    Those messages start with the field name (``"max_tokens must be ..."``, ``"prompt (9
    tokens) + max_tokens (30) = 39 > max_model_len (32)"``); a context-length error (past
    ``max_model_len`` or the KV cache) is charged to ``max_tokens`` when the prompt fits and the
    sum does not, to the prompt when the prompt alone leaves no room (``"prompt has 40 tokens,
    which leaves no room ..."``).
    """
    rename = rename or {}
    name: str | None
    if message.startswith("prompt (") and "+ max_tokens (" in message:
        name = "max_tokens"  # over max_model_len or over the KV cache
    else:
        m = re.match(r"^([A-Za-z_]+)", message)
        name = m.group(1) if m else None
        if name is None or name not in _SAMPLING_FIELDS:
            return rename.get("prompt") if "prompt" in message else None
        if name == "prompt_token_ids":
            name = "prompt"
    return rename.get(name, name)


def api_error_from_value_error(e: Exception, rename: dict[str, str] | None = None) -> APIError:
    """Map an engine / ``SamplingParams`` ``ValueError`` to a 400 naming the field, in the
    request's own words (``rename``: engine name -> request field) in ``param`` and message."""
    message = str(e)
    param = param_from_message(message, rename)
    # a limit stated in max_model_len (or the KV cache, the other bound on a sequence) is a
    # context overflow only for the prompt, max_tokens and n; truncate_prompt_tokens is an
    # out-of-range setting whatever its bound is called
    bounded = "max_model_len" in message or "KV cache" in message
    overflow = bounded and param != "truncate_prompt_tokens"
    code = "context_length_exceeded" if overflow else None
    for engine_name, field_name in (rename or {}).items():
        message = re.sub(rf"\b{engine_name}\b", field_name, message)
    return APIError(message, 400, param=param, code=code)


#: Exceptions that parsing or checking one client's input can raise (``json``, pydantic, the
#: chat template's jinja, the tokenizer, ``SamplingParams``): each is that input's fault, a 400
#: naming the field, never a 500. (``UnicodeError`` is a ``ValueError``; ``OverflowError`` and
#: ``ZeroDivisionError`` are ``ArithmeticError``s.)
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    ArithmeticError,
    RecursionError,
    MemoryError,
)


def input_error(e: BaseException, param: str, what: str | None = None) -> APIError:
    """The 400 for an ``INPUT_ERRORS`` exception raised by field ``param``'s value (``what``:
    how the message names it, default ``param``); the message names the field and the cause,
    and the depth or size limit when that is what was hit."""
    what = what or param
    if isinstance(e, RecursionError):
        detail = f"nested too deeply (at most {MAX_JSON_DEPTH} levels)"
    elif isinstance(e, MemoryError):
        detail = "too large to process"
    else:
        detail = str(e)[:500] or type(e).__name__
    return APIError(f"Invalid value for '{what}': {detail}.", 400, param=param, code="invalid_value")


def json_depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar: 0, ``[]``: 1), computed without recursion
    so that any depth is measured."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        elif not isinstance(node, list):
            continue
        depth = max(depth, d)
        stack.extend((child, d + 1) for child in node if isinstance(child, (dict, list)))
    return depth


#: Unknown field names listed in one 400 (the rest are counted), and the characters kept of each.
MAX_UNKNOWN_NAMES = 10
MAX_NAME_CHARS = 100


def _error_path(err: Mapping[str, Any]) -> str:
    """``a.b[0].c`` of a pydantic error location (union type tags dropped; the last element of
    an unknown-field error is the client's field name, kept whatever it looks like)."""
    raw = list(err.get("loc", ()))
    last = raw[-1:] if err.get("type") == "extra_forbidden" else []
    loc = [p for p in raw[: len(raw) - len(last)] if not (isinstance(p, str) and _UNION_TAG.match(p))] + last
    if not loc:
        return ""
    return str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])


def api_error_from_validation(e: ValidationError) -> APIError:
    """Map a pydantic ``ValidationError`` to a 400 naming the field, the rule and the value."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first.get("type") == "json_invalid":
        msg = str(first.get("msg"))
        if "recursion limit exceeded" in msg:
            where = msg.rpartition(" at ")[2]
            return APIError(
                f"Request body is JSON nested more than {MAX_JSON_DEPTH} levels deep (at {where}).",
                400,
                code="invalid_json",
            )
        return APIError(f"Request body is not valid JSON: {msg}", 400, code="invalid_json")
    # An unknown field is named first: it is the one thing the client must change.
    unknown = [err for err in errors if err.get("type") == "extra_forbidden"]
    if unknown:
        first = unknown[0]
    path = _error_path(first)
    if not path:
        return APIError("Request body must be a JSON object.", 400)
    loc = [p for p in first.get("loc", ()) if not (isinstance(p, str) and _UNION_TAG.match(p))]
    param = str(loc[0]) if loc else path
    if unknown:
        names = sorted({_error_path(err) for err in unknown})
        # a body of many unknown keys must not get an error body as large as itself
        listed = ", ".join(repr(n[:MAX_NAME_CHARS]) for n in names[:MAX_UNKNOWN_NAMES])
        if len(names) > MAX_UNKNOWN_NAMES:
            listed += f" and {len(names) - MAX_UNKNOWN_NAMES} more"
        return APIError(
            f"Unknown field(s) {listed}: not supported by this server "
            "(a field kvserve does not implement is refused, never silently ignored).",
            400,
            param=path[:MAX_NAME_CHARS],
            code="unsupported_field",
        )
    if first.get("type") == "missing":
        return APIError(f"'{path}' is a required field.", 400, param=param, code="missing_field")
    rule = _FIELD_RULES.get(param)
    msg = first.get("msg", "invalid value")
    value = first.get("input")
    if param in ("prompt", "stop", "messages") and len(errors) > 1:
        msg = "Input has the wrong type"  # a union: pydantic lists one error per member
        value = None
    if first.get("type") == "string_too_long" or param == "user":
        # the message states the limit; the value itself may be huge (a tenant name is never
        # echoed back: the message gives the position of a bad character instead)
        value = None
    text = f"Invalid value for '{path}': {str(msg).rstrip('.')}"
    if value is not None and not isinstance(value, (dict, list)):
        text += f"; got {value!r}"
    if rule:
        text += f" ({param} must be {rule})"
    return APIError(text + ".", 400, param=param, code="invalid_value")


async def read_json_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """Read the body (at most ``max_bytes``: else 413) and validate it into ``model`` (400).

    Raises:
        APIError: 413 / 400 as above.
        ClientDisconnected: the client went away (or its body timed out) before the end.
    """
    length = request.headers.get("content-length")
    too_big = APIError(
        f"Request body is larger than the limit of {max_bytes} bytes.", 413, code="request_too_large"
    )
    if length is not None:
        try:
            if int(length) > max_bytes:
                raise too_big
        except ValueError:
            raise APIError("Invalid Content-Length header.", 400) from None
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise too_big
    except ClientDisconnect:
        raise ClientDisconnected(
            f"mid-body: {len(body)} of {length if length is not None else '?'} bytes received"
        ) from None
    if not body:
        raise APIError("Request body is empty; expected a JSON object.", 400)
    _precheck_messages(model, body)
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first.get("type") == "json_invalid":
            text_error = invalid_text_error(body, str(first.get("msg")))
            if text_error is not None:
                raise text_error from None
        if first.get("type") != "json_invalid" or "out of range" not in str(first.get("msg")):
            raise api_error_from_validation(e) from None
    # A number too long for the JSON parser ("number out of range", no field named): parse
    # again with such integers replaced by a value past every field's range, so validation
    # names the field and its limit.
    try:
        obj = json.loads(bytes(body), parse_int=_clamped_int)
        too_deep = json_depth(obj) > MAX_JSON_DEPTH  # the first parser's limit, which this one lacks
    except ValueError:
        raise APIError("Request body is not valid JSON.", 400, code="invalid_json") from None
    except RecursionError:
        too_deep = True
    if too_deep:
        raise APIError(
            f"Request body is JSON nested more than {MAX_JSON_DEPTH} levels deep.", 400, code="invalid_json"
        )
    surrogate = _path_of_surrogate(obj)  # this parser keeps what the first one refuses
    if surrogate is not None:
        raise _text_error(surrogate, _SURROGATE_CAUSE)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise api_error_from_validation(e) from None


#: What the JSON parser says of a string that is not Unicode text: raw bytes that are not UTF-8,
#: and a ``\uD800``-``\uDFFF`` escape without its other half.
_NOT_UTF8 = "invalid unicode code point"
_LONE_SURROGATE = ("hex escape", "surrogate")


def invalid_text_error(body: bytes | bytearray, parser_message: str) -> APIError | None:
    """The 400 for a body the JSON parser refused because a string in it is not Unicode text
    (``parser_message``: the parser's words), naming the field that holds it; None when the
    parser refused the body for another reason (the caller then reports the parser's words).

    The body is parsed again by Python's ``json``, which keeps a lone surrogate in a string
    (raw bytes that are not UTF-8 are first decoded to lone surrogates, ``surrogateescape``),
    so the first string holding one is found and its path (``messages[0].content``) named.
    """
    if _NOT_UTF8 in parser_message:
        cause = _NOT_UTF8_CAUSE
    elif any(k in parser_message for k in _LONE_SURROGATE):
        cause = _SURROGATE_CAUSE
    else:
        return None
    try:
        path = _path_of_surrogate(json.loads(bytes(body).decode("utf-8", errors="surrogateescape")))
    except (ValueError, RecursionError):
        return None  # not JSON for this parser either: the first parser's words stand
    if path is None:
        return None
    return _text_error(path, cause)


_NOT_UTF8_CAUSE = "is not valid UTF-8 (it holds bytes that are not UTF-8 text)"
_SURROGATE_CAUSE = (
    "is not valid UTF-8 text: it holds a lone surrogate escape (one of \\uD800-\\uDFFF without "
    "its pair; a character past U+FFFF is sent as a high and a low surrogate together)"
)


def _text_error(path: str, cause: str) -> APIError:
    # a key is the client's text: any length, and maybe the bad text itself (shown escaped, as
    # the answer is UTF-8 too)
    path = path[:MAX_NAME_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    return APIError(f"Invalid value for '{path}': the text {cause}.", 400, param=path, code="invalid_value")


def _path_of_surrogate(obj: Any) -> str | None:
    """``a.b[0].c`` of the first string (key or value, depth first) holding a surrogate code
    point, or None; iterative, so any depth is walked."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if any("\ud800" <= ch <= "\udfff" for ch in node):
                return path or "body"
        elif isinstance(node, dict):
            for key, value in reversed(list(node.items())):
                sub = f"{path}.{key}" if path else str(key)
                if any("\ud800" <= ch <= "\udfff" for ch in key):
                    return sub
                stack.append((value, sub))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def _precheck_messages(model: type[BaseModel], body: bytearray) -> None:
    """A conversation far past ``MAX_CHAT_MESSAGES`` is refused from the raw bytes: pydantic
    checks a list's length only after validating every item, holding the event loop for all of
    them. Every message has a ``"role"`` key, and inside a JSON string the quotes would be
    escaped, so the count of ``"role"`` bounds the number of messages from above; a count of
    twice the cap (slack for other objects with such a key) proves the request over it."""
    if "messages" not in model.model_fields or len(body) < 16 * MAX_CHAT_MESSAGES:
        return
    if body.count(b'"role"') > 2 * MAX_CHAT_MESSAGES:
        raise APIError(
            f"messages must have at most {MAX_CHAT_MESSAGES} messages.",
            400,
            param="messages",
            code="invalid_value",
        )


#: Digits of an integer kept as is on the second parse (2**64 has 20).
_MAX_INT_DIGITS = 40


def _clamped_int(text: str) -> int:
    if len(text) <= _MAX_INT_DIGITS:
        return int(text)
    return -(10**_MAX_INT_DIGITS) if text.startswith("-") else 10**_MAX_INT_DIGITS


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (a transformers tokenizer call)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def decode_ids(tokenizer, token_ids: list[int]) -> str:
    """Text of ``token_ids`` (``tokenizer.decode``), through the Rust backend's batch decode
    when that gives the same text: it releases the GIL, so a long decode on a pool thread does
    not stall the event loop (``decode`` holds it for the whole decode)."""
    if not token_ids:
        return ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch([list(token_ids)], skip_special_tokens=False)[0]
    return tokenizer.decode(token_ids)


@overload
def finite(x: float) -> float: ...
@overload
def finite(x: None) -> None: ...
@overload
def finite(x: float | None) -> float | None: ...
def finite(x: float | None) -> float | None:
    """A logprob JSON can carry: ``-inf`` (or NaN) becomes -9999.0, as the OpenAI API does."""
    if x is None:
        return None
    return x if math.isfinite(x) else -9999.0


def stream_dict(obj: BaseModel) -> dict[str, Any]:
    """``obj`` as a stream chunk's JSON object: null fields left out, except those its class
    lists in ``NULL_IN_STREAM`` (the keys vLLM's chunks always carry, such as a choice's
    ``finish_reason``), recursively through nested models and lists of them."""
    keep: frozenset[str] = getattr(type(obj), "NULL_IN_STREAM", frozenset())
    out: dict[str, Any] = {}
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        if value is None and name not in keep:
            continue
        out[name] = _stream_value(value)
    return out


def _stream_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return stream_dict(value)
    if isinstance(value, list):
        return [_stream_value(v) for v in value]
    return to_jsonable_python(value)


#: Characters Python's ``str.splitlines`` (and so clients such as httpx's ``iter_lines``)
#: breaks a line at that JSON leaves raw in a string: escaped, an event stays one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    """One server-sent event carrying a JSON object (a pydantic model, as ``stream_dict``, or
    a dict): UTF-8 as it is, but for U+0085 / U+2028 / U+2029, escaped (``_LINE_BREAKS``)."""
    if isinstance(obj, BaseModel):
        text = json.dumps(stream_dict(obj), separators=(",", ":"), ensure_ascii=False)
        return f"data: {text.translate(_LINE_BREAKS)}\n\n"
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_outputs(out: RequestOutput, n: int) -> list[CompletionOutput]:
    """The choices of one engine output for a stream: ``out.outputs``, completed to ``n`` when
    a finished request ended before its ``n > 1`` samples were forked (aborted during the
    prefill: the engine reports only the prompt's sequence). The missing choices end the same
    way, with no tokens, so every choice of the stream gets its final chunk."""
    if not out.finished or len(out.outputs) >= n:
        return out.outputs
    have = {c.index for c in out.outputs}
    reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
    return out.outputs + [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason=reason)
        for i in range(n)
        if i not in have
    ]


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always watches for the client going away.

    Starlette only notices a disconnect on ASGI >= 2.4 servers when a ``send`` fails, i.e. not
    while a request waits in the queue or between tokens. Here a watcher task ends the stream
    as soon as ``http.disconnect`` arrives; the body iterator is then closed (``aclose``), which
    aborts its engine requests at once.
    """

    def __init__(self, *args, on_close=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run_stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has closed the connection (the body must be read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro) -> Any:
    """Run ``coro`` while watching the connection; cancel it (aborting its engine requests)
    and raise ``ClientDisconnected`` if the client goes away first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


@dataclass
class SubRequest:
    """One engine request of an HTTP request (one per prompt; ``n`` samples each)."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    #: a cross-encoder pair's segment ids (``PoolingParams.token_type_ids``); None: none
    token_type_ids: list[int] | None = None


@dataclass
class RequestRecord:
    """What the request log line and the usage block need about one HTTP request."""

    request_id: str
    endpoint: str
    arrival: float = field(default_factory=time.time)
    prompt_tokens: int = 0
    n: int = 1
    latest: dict[int, RequestOutput] = field(default_factory=dict)
    first_token_time: float | None = None
    status: str = "ok"
    prompts: list[str | None] | None = None
    #: the adapter the request runs with (None: the base model)
    lora_request: LoRARequest | None = None
    #: the request's ``user`` field, its tenant under ``fair`` (None: the default tenant)
    tenant: str | None = None
    #: the model name answers report; the sampling parameters (None: beam search)
    model: str = ""
    params: SamplingParams | None = None
    #: the parent context of its trace span (``RequestTracer.context_from``), when tracing
    trace_context: Any = None

    def timings(self) -> tuple[float | None, float | None]:
        """``(ttft, queue time)`` in seconds: the earliest first token of its sub-requests
        (else when the server saw the first token), the longest queue time."""
        metrics = [out.metrics for out in self.latest.values() if out.metrics is not None]
        ttft = min((m.ttft for m in metrics if m.ttft is not None), default=None)
        queue = max((m.queue_time for m in metrics if m.queue_time is not None), default=None)
        if ttft is None and self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival
        return ttft, queue

    def observe(self, idx: int, out: RequestOutput) -> None:
        """Remember the newest output of sub-request ``idx``."""
        self.latest[idx] = out
        if self.first_token_time is None and any(o.token_ids for o in out.outputs):
            self.first_token_time = time.time()

    def completion_tokens(self) -> int:
        """Generated tokens over every choice seen so far."""
        return sum(len(o.token_ids) for out in self.latest.values() for o in out.outputs)

    def usage(self) -> UsageInfo:
        """The ``usage`` block."""
        c = self.completion_tokens()
        return UsageInfo(
            prompt_tokens=self.prompt_tokens, completion_tokens=c, total_tokens=self.prompt_tokens + c
        )

    def finish_reasons(self) -> list[str | None]:
        """Finish reason of every choice seen (``None`` where the stream was cut short)."""
        return [o.finish_reason for _, out in sorted(self.latest.items()) for o in out.outputs]


def sleeping_error(engine, retry_after_s: int) -> APIError:
    """The 503 of a request that reaches an engine in sleep mode's sleep (``engine_sleeping``,
    with ``Retry-After``): it is refused, not queued, until ``POST /wake_up``."""
    return APIError(
        f"The engine is asleep (sleep mode, level {engine.sleep_level}); POST /wake_up first.",
        503,
        type="service_unavailable",
        code="engine_sleeping",
        headers={"Retry-After": str(retry_after_s)},
    )


class RequestLogger:
    """One JSON line per finished HTTP generation request on ``kvserve.server.requests``:
    id, endpoint, status, prompt/output tokens, TTFT, queue time, e2e, finish reasons, the
    adapter and the tenant (``user``) where set. Prompt text only when ``log_prompts``."""

    def __init__(self, enabled: bool = True, log_prompts: bool = False, tracer: RequestTracer | None = None):
        self.enabled = enabled
        self.log_prompts = log_prompts
        #: when set, each finished request is also one trace span (``--otlp-traces-endpoint``)
        self.tracer = tracer

    def log(self, rec: RequestRecord) -> None:
        """Emit the line for ``rec`` (and its span, when tracing)."""
        if not self.enabled and self.tracer is None:
            return
        now = time.time()
        ttft, queue = rec.timings()
        reasons = rec.finish_reasons()
        status = rec.status
        if status == "ok" and "abort" in reasons:
            status = "aborted"
        if self.tracer is not None:
            self._trace(self.tracer, rec, now, ttft, queue, status, reasons)
        if not self.enabled:
            return
        line = {
            "event": "request_finished",
            "request_id": rec.request_id,
            "endpoint": rec.endpoint,
            "status": status,
            "n": rec.n,
            "prompt_tokens": rec.prompt_tokens,
            "output_tokens": rec.completion_tokens(),
            "ttft_s": None if ttft is None else round(ttft, 4),
            "queue_s": None if queue is None else round(queue, 4),
            "e2e_s": round(now - rec.arrival, 4),
            "finish_reasons": reasons,
        }
        if rec.lora_request is not None:
            line["lora"] = rec.lora_request.lora_name
        if rec.tenant:
            line["tenant"] = rec.tenant
        if self.log_prompts and rec.prompts is not None:
            line["prompts"] = rec.prompts
        request_logger.info(json.dumps(line, separators=(",", ":")))

    @staticmethod
    def _trace(tracer, rec: RequestRecord, now: float, ttft, queue, status: str, reasons) -> None:
        """``rec`` as one span, with vLLM's ``gen_ai.*`` attribute names."""
        p = rec.params
        attrs = {
            "gen_ai.request.id": rec.request_id,
            "gen_ai.response.model": rec.model or None,
            "gen_ai.request.n": rec.n,
            "gen_ai.request.max_tokens": None if p is None else p.max_tokens,
            "gen_ai.request.temperature": None if p is None else p.temperature,
            "gen_ai.request.top_p": None if p is None else p.top_p,
            "gen_ai.request.top_k": None if p is None else p.top_k,
            "gen_ai.request.seed": None if p is None else p.seed,
            "gen_ai.usage.prompt_tokens": rec.prompt_tokens,
            "gen_ai.usage.completion_tokens": rec.completion_tokens(),
            "gen_ai.usage.num_sequences": sum(len(out.outputs) for out in rec.latest.values()),
            "gen_ai.latency.time_in_queue": queue,
            "gen_ai.latency.time_to_first_token": ttft,
            "gen_ai.latency.e2e": now - rec.arrival,
            "gen_ai.response.finish_reasons": [str(r) for r in reasons],
            "kvserve.endpoint": rec.endpoint,
            "kvserve.status": status,
            "kvserve.lora": None if rec.lora_request is None else rec.lora_request.lora_name,
        }
        error = status if status.startswith("error") else None
        tracer.record(rec.trace_context, rec.arrival, now, attrs, error=error)


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        async_engine: a started ``AsyncLLMEngine``.
        served_model_names: names accepted in the ``model`` field (the first is reported).
        request_logger: the per-request log.
        server_state: an object with a ``draining`` flag (set on shutdown: new requests get
            503) and an ``inflight`` set (engine request ids of running HTTP requests, kept here).
        retry_after_s: the ``Retry-After`` of a 503.
        pool: where heavy prompt work runs (default: a pool of its own).
        text_bound: the tokenizer's ``TokenTextBound`` (None: no refusal by length alone).
        models: the server's ``OpenAIServingModels`` (base names and LoRA adapters; default:
            one of its own over ``served_model_names``, without adapters).
    """

    endpoint = "?"

    def __init__(
        self,
        async_engine,
        served_model_names: Sequence[str],
        request_logger: RequestLogger | None = None,
        server_state: Any = None,
        retry_after_s: int = 1,
        pool: OffloadPool | None = None,
        text_bound: TokenTextBound | None = None,
        models=None,
    ):
        if models is None:
            from kvserve.entrypoints.openai.serving_models import OpenAIServingModels

            models = OpenAIServingModels(async_engine, served_model_names)
        self.models = models
        self.async_engine = async_engine
        self.pool = pool or OffloadPool()
        self.text_bound = text_bound
        self.served_model_names = list(served_model_names)
        self.request_logger = request_logger or RequestLogger()
        self.server_state = server_state
        self.retry_after_s = retry_after_s
        self.pending: PendingCounter = getattr(server_state, "pending", None) or PendingCounter()
        self._token_str_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ engine facts
    @property
    def engine(self):
        """The synchronous ``LLMEngine``."""
        return self.async_engine.engine

    @property
    def tokenizer(self):
        """The engine's tokenizer (None: token ids only)."""
        return self.engine.tokenizer

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The sampling defaults of fields a request leaves out (the engine's, from the
        model's generation_config.json; {} for an engine without them)."""
        return getattr(self.engine, "generation_defaults", None) or {}

    @property
    def model_name(self) -> str:
        """The reported model name."""
        return self.served_model_names[0]

    # ------------------------------------------------------------------ checks
    def request_priority(self, priority: int | None) -> int:
        """``priority`` (0 when left out), which the ``priority`` scheduling policy reads (and
        ``fair``, within a tenant).

        Raises:
            APIError: 400 naming ``priority`` for a non-zero value under another policy (it
                would be accepted and ignored, as vLLM refuses it too).
        """
        value = priority or 0
        policy = getattr(self.engine.scheduler_config, "policy", "priority")
        if value and policy not in ("priority", "fair"):
            raise APIError(
                f"priority={value} needs the priority or fair scheduling policy; this server runs "
                f"--scheduling-policy {policy} (start it with --scheduling-policy priority, or "
                "leave priority out).",
                400,
                param="priority",
                code="unsupported",
            )
        return value

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` chooses (None: the base model, or no name given).

        Raises:
            APIError: 404 ``model_not_found`` unless ``name`` is a served model name or a
                loaded LoRA adapter.
        """
        return self.models.resolve(name)

    def response_model(self, rec: RequestRecord) -> str:
        """The ``model`` of a response: the adapter's name, else the served model name."""
        return rec.lora_request.lora_name if rec.lora_request is not None else self.model_name

    def check_capacity(self, num_requests: int = 1) -> Reservation:
        """503 with ``Retry-After`` when shutting down or when the waiting queue (``waiting`` +
        the engine's inbox + admitted requests not yet handed over) is at ``max_waiting``.
        Returns the reservation of ``num_requests`` places (pass it to ``generate_all``)."""
        headers = {"Retry-After": str(self.retry_after_s)}
        if self.server_state is not None and getattr(self.server_state, "draining", False):
            raise APIError(
                "The server is shutting down.",
                503,
                type="service_unavailable",
                code="shutting_down",
                headers=headers,
            )
        if getattr(self.engine, "is_sleeping", False):
            raise sleeping_error(self.engine, self.retry_after_s)
        errored = getattr(self.async_engine, "errored", None)
        if errored is not None:
            raise APIError(
                f"The engine loop has stopped: {errored!r}",
                503,
                type="service_unavailable",
                code="engine_dead",
            )
        limit = getattr(self.engine.scheduler_config, "max_waiting", None)
        if limit is not None:
            inbox = getattr(self.async_engine, "_inbox", None)
            # a data-parallel engine counts the requests its replicas have not answered yet
            queued = getattr(self.async_engine, "num_waiting", None)
            waiting = (
                (len(self.engine.scheduler.waiting) if queued is None else queued)
                + (inbox.qsize() if inbox is not None else 0)
                + self.pending.value
            )
            if waiting >= limit:
                raise APIError(
                    f"Too many requests are waiting ({waiting} >= max_waiting {limit}); retry later.",
                    503,
                    type="service_unavailable",
                    code="queue_full",
                    headers=headers,
                )
        return Reservation(self.pending, num_requests)

    def make_sampling_params(
        self, kwargs: dict[str, Any], rename: dict[str, str] | None = None
    ) -> SamplingParams:
        """``SamplingParams(**kwargs)`` with its ``ValueError`` mapped to a 400 (``SamplingParams``
        also turns the JSON string keys of ``logit_bias`` into token ids)."""
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise api_error_from_value_error(e, rename) from None
        except INPUT_ERRORS as e:
            param = param_from_message(str(e), rename) or "request"
            raise input_error(e, param) from None

    async def offload(self, size: int, fn, *args):
        """``fn(*args)`` off the event loop when ``size`` (characters or tokens) is large
        (``OffloadPool``); 503 ``server_busy`` when the pool's queue is full."""
        try:
            return await self.pool.run(size, fn, *args)
        except PoolBusyError as e:
            raise APIError(
                f"The server is busy preparing other prompts ({e}); retry later.",
                503,
                type="service_unavailable",
                code="server_busy",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 ``context_length_exceeded`` when a text of ``num_chars`` characters surely has
        ``max_model_len`` tokens or more (``TokenTextBound``): refused without tokenizing."""
        bound = self.text_bound
        limit = self.engine.scheduler_config.max_model_len
        if bound is not None and bound.proves_too_long(num_chars, limit - 1):
            raise APIError(
                f"{param} has {num_chars} characters, so at least {bound.min_tokens(num_chars)} tokens "
                f"(no token of this model covers more than {bound.max_chars_per_token:g} characters), "
                f"which leaves no room to generate within max_model_len {limit}.",
                400,
                param=param,
                code="context_length_exceeded",
            )

    async def compile_constraint(self, params: SamplingParams | StructuredOutputsParams | None) -> None:
        """Compile the request's structured-output constraint (``params.structured_outputs``,
        or the constraint itself) on a worker thread (cached per constraint), so the engine
        thread only finds it in the cache at ``add_request``. Under data parallelism a replica
        compiles it (``DataParallelAsyncEngine.compile_constraint``).

        Raises:
            APIError: 400 naming the constraint's field when it does not compile.
        """
        so = params.structured_outputs if isinstance(params, SamplingParams) else params
        if so is None:
            return
        try:
            on_replica = getattr(self.async_engine, "compile_constraint", None)
            if on_replica is not None:
                # data parallel: a replica compiles it; this process never runs the grammar engine
                await on_replica(so)
            else:
                manager = self.engine.structured_output
                await asyncio.to_thread(manager.compile, so)
        except ValueError as e:
            raise APIError(str(e), 400, param=so.field_name, code="invalid_grammar") from None
        except INPUT_ERRORS as e:  # e.g. a schema too deep for the compiler's own recursion
            err = input_error(e, so.field_name)
            err.code = "invalid_grammar"
            raise err from None

    async def prepare_prompts(
        self, raw_request: Request, prompts: list, params: SamplingParams
    ) -> list[SubRequest]:
        """``prepare_prompt`` of each prompt in turn, under the disconnect watch: a batch of long
        prompts keeps the tokenizer pool busy for seconds, and a client gone meanwhile stops it
        at the prompt being tokenized (``ClientDisconnected``), not after the whole batch."""

        async def prepare_all() -> list[SubRequest]:
            return [await self.prepare_prompt(p, params) for p in prompts]

        return await run_unless_disconnected(raw_request, prepare_all())

    async def prepare_prompt(
        self, prompt, params: SamplingParams, rename: dict[str, str] | None = None, chat: bool = False
    ) -> SubRequest:
        """Tokenize (text) or check (ids) one prompt and hold it to every limit: 0 tokens,
        vocabulary, prompt + max_tokens vs max_model_len, n, prompt_limit and KV-pool size.
        ``rename`` maps engine field names to the request's (chat: ``prompt`` -> ``messages``,
        ``max_tokens`` -> ``max_completion_tokens``) for the 400's ``param``. ``chat``: the
        prompt is a rendered chat template (tokenized without adding special tokens).

        A text that its length alone proves too long is refused before tokenizing; a long one
        is tokenized off the event loop; a token-id list longer than ``max_model_len`` is
        refused before its ids are scanned."""
        rename = rename or {}
        param = rename.get("prompt", "prompt")
        limit = self.engine.scheduler_config.max_model_len
        # a prompt kept to its last tokens may be longer than the context
        truncating = params.truncate_prompt_tokens is not None
        try:
            if isinstance(prompt, str) and self.tokenizer is not None and prompt:
                if not truncating:
                    self.check_prompt_chars(len(prompt), param)
                # a rendered chat template already has its special tokens
                encoded = await self.offload(len(prompt), encode_text, self.tokenizer, prompt, not chat)
                text, ids = tokenize_prompt({"prompt": prompt, "prompt_token_ids": encoded}, None)
            else:
                if isinstance(prompt, list) and len(prompt) >= limit and not truncating:
                    raise ValueError(
                        f"prompt has {len(prompt)} tokens, which leaves no room to generate within "
                        f"max_model_len {limit}."
                    )
                text, ids = tokenize_prompt(prompt, self.tokenizer)
            ids = truncate_prompt(ids, params, limit)
            self.engine.validate(ids, params)
        except ValueError as e:
            raise api_error_from_value_error(e, rename) from None
        except INPUT_ERRORS as e:  # the tokenizer's own failures on this text
            raise input_error(e, param) from None
        reason = self.engine.check_admissible(len(ids))
        if reason is not None:
            raise APIError(
                f"{param}: {reason}; the request can never be scheduled.",
                400,
                param=param,
                code="prompt_too_long",
            )
        return SubRequest("", text, ids)

    # ------------------------------------------------------------------ running requests
    async def generate_all(
        self,
        subs: list[SubRequest],
        params: SamplingParams,
        priority: int,
        reservation: Reservation | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every sub-request concurrently (with ``lora_request``'s adapter, None: the
        base model; for ``tenant``, the request's ``user``, None: the default tenant); yield ``(sub_index, RequestOutput)`` as outputs arrive. Closing or
        cancelling the iterator aborts whatever is still running.

        Raises:
            APIError: 404 when the adapter was unloaded after the request was admitted.
        """
        queue: asyncio.Queue = asyncio.Queue()
        if lora_request is not None:
            try:
                # one use per sub-request, each released once its task is over (after its
                # abort, if any, is queued), so an unload waits for them
                self.models.acquire(lora_request, len(subs))
            except APIError:
                if reservation is not None:
                    reservation.release()
                raise

        inflight = getattr(self.server_state, "inflight", None)

        async def pump(idx: int, sub: SubRequest) -> None:
            prompt = {"prompt": sub.prompt_text, "prompt_token_ids": sub.prompt_token_ids}
            if sub.token_type_ids is not None:
                prompt["token_type_ids"] = sub.token_type_ids
            if inflight is not None:
                inflight.add(sub.request_id)
            if reservation is not None:
                # no await between here and generate() putting the request in the inbox
                reservation.consume()
            try:
                async for out in self.async_engine.generate(
                    prompt,
                    params,
                    sub.request_id,
                    priority=priority,
                    lora_request=lora_request,
                    tenant=tenant,
                ):
                    queue.put_nowait((idx, out, None))
                queue.put_nowait((idx, None, None))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                queue.put_nowait((idx, None, e))
            finally:
                if inflight is not None:
                    inflight.discard(sub.request_id)

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(subs)]
        if lora_request is not None:
            # a done callback runs even for a task cancelled before it started
            adapter = lora_request
            for t in tasks:
                t.add_done_callback(lambda _t: self.models.release(adapter))
        try:
            remaining = len(tasks)
            while remaining:
                idx, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    remaining -= 1
                    continue
                yield idx, out
        finally:
            for t in tasks:  # synchronous: this may run inside a cancelled scope
                if not t.done():
                    t.cancel()
            if reservation is not None:
                reservation.release()

    def engine_error(self, e: BaseException, rename: dict[str, str] | None = None) -> APIError:
        """Map an exception from a running request to an API error."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):
            return api_error_from_value_error(e, rename)
        from kvserve.engine.async_llm_engine import EngineDeadError
        from kvserve.engine.llm_engine import EngineSleepingError

        if isinstance(e, EngineSleepingError):
            return sleeping_error(self.engine, self.retry_after_s)
        if isinstance(e, EngineDeadError):
            return APIError(str(e), 503, type="service_unavailable", code="engine_dead")
        logger.error("request failed in the engine: %r", e)
        return APIError(f"Internal error while generating: {e}", 500, type="internal_server_error")

    @staticmethod
    def rejected_error(out: RequestOutput, param: str = "prompt") -> APIError:
        """A request the engine ended without finishing it: ``"failed"`` (a fault in its step)
        as a 500 naming the request id; ``"rejected"`` as a 400, naming the sampling field
        when its input failed validation while it ran, else the prompt (a scheduler
        rejection: too long for the context or the KV cache)."""
        if out.outcome == "failed":
            return APIError(
                out.error or f"internal error while running request {out.request_id}",
                500,
                type="internal_server_error",
                code="engine_step_failed",
            )
        field = param_from_message(out.error or "")
        if field is not None and field != "prompt":
            return APIError(out.error or "", 400, param=field, code="invalid_value")
        return APIError(
            f"{param}: {out.error or 'rejected by the scheduler'}", 400, param=param, code="prompt_too_long"
        )

    # ------------------------------------------------------------------ helpers
    async def respond(
        self,
        raw_request: Request,
        stream: bool,
        stream_body,
        full_body,
        rec: RequestRecord,
        reservation: Reservation,
    ) -> Response:
        """Send a streaming (SSE) or a whole JSON response. ``stream_body()`` makes the async
        iterator of SSE lines, ``full_body()`` the coroutine computing the JSON body; only the
        one matching ``stream`` is made. A client gone before the body is ready aborts the
        request (499 in the log); the capacity reservation is released and the request logged
        once, whichever way it ends."""
        if stream:
            return DisconnectAwareStreamingResponse(
                stream_body(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rec.request_id},
                on_close=reservation.release,
            )
        try:
            body = await run_unless_disconnected(raw_request, full_body())
            return JSONResponse(body, headers={"X-Request-Id": rec.request_id})
        except ClientDisconnected:
            rec.status = "client_disconnected"
            return Response(status_code=499)
        except APIError as e:
            rec.status = f"error_{e.status}"
            raise
        finally:
            reservation.release()
            self.request_logger.log(rec)

    async def sse_frame(
        self,
        events,
        rec: RequestRecord,
        usage_chunk,
        done: set,
        expected_choices: int,
        rename: dict[str, str] | None = None,
    ):
        """Frame a streaming body: the handler's serialised ``events``, then the usage chunk
        (``usage_chunk()``, when not None) and ``[DONE]``. An error after the 200 header becomes
        an error event; a stream that ends before all ``expected_choices`` finished (``done``)
        is logged as a client disconnect; the request is logged once."""
        try:
            async for event in events:
                yield event
            if usage_chunk is not None:
                yield usage_chunk()
            yield SSE_DONE
        except Exception as e:  # after the 200 header: an error event, then the end
            err = e if isinstance(e, APIError) else self.engine_error(e, rename)
            rec.status = f"error_{err.status}"
            yield sse(err.body())
            yield SSE_DONE
        finally:
            await events.aclose()  # abort the engine request now, not at garbage collection
            if rec.status == "ok" and len(done) < expected_choices:
                rec.status = "client_disconnected"
            self.request_logger.log(rec)

    def new_record(
        self,
        prefix: str,
        n: int,
        subs: list[SubRequest],
        lora_request: LoRARequest | None = None,
        *,
        params: SamplingParams | None = None,
        headers: Mapping[str, str] | None = None,
        tenant: str | None = None,
    ) -> RequestRecord:
        """Assign request ids (``prefix-<hex>`` and ``...-<i>`` per prompt); ``lora_request``:
        the adapter the request runs with; ``params``: its sampling parameters; ``headers``:
        the HTTP request's, whose ``traceparent`` is the parent of its span when tracing;
        ``tenant``: its ``user`` field (logged with it)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        for i, s in enumerate(subs):
            s.request_id = f"{rid}-{i}"
        rec = RequestRecord(
            request_id=rid,
            endpoint=self.endpoint,
            n=n,
            prompt_tokens=sum(len(s.prompt_token_ids) for s in subs),
            lora_request=lora_request,
            params=params,
            tenant=tenant,
        )
        rec.model = self.response_model(rec)
        tracer = self.request_logger.tracer
        if tracer is not None:
            rec.trace_context = tracer.context_from(headers or {})
        if self.request_logger.log_prompts:
            rec.prompts = [s.prompt_text for s in subs]
        return rec

    def prompt_logprobs_json(self, prompt_logprobs) -> list | None:
        """vLLM's JSON shape of ``RequestOutput.prompt_logprobs``: None for the first token,
        then ``{token_id: {"logprob", "rank", "decoded_token"}}`` (-inf as -9999.0)."""
        if prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                t: {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": self.token_str(t)}
                for t, lp in entry.items()
            }
            for entry in prompt_logprobs
        ]

    def token_str(self, token_id: int) -> str:
        """Text of one token (cached)."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            tok = self.tokenizer
            s = tok.decode([token_id]) if tok is not None else str(token_id)
            if len(self._token_str_cache) < 200_000:
                self._token_str_cache[token_id] = s
        return s

    def decode(self, token_ids: list[int]) -> str:
        """Text of a token-id sequence ("" without a tokenizer)."""
        tok = self.tokenizer
        return tok.decode(token_ids) if tok is not None and token_ids else ""
