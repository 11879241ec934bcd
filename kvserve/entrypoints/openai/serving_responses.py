"""``POST /v1/responses`` (OpenAI's Responses API) and ``GET /v1/responses/{id}``.

A response is a chat completion underneath: the request is translated into a chat request
(``instructions`` -> a system message, ``input`` items -> messages, flat function tools ->
chat tools, ``text.format`` -> ``response_format``, ``max_output_tokens`` ->
``max_completion_tokens``) and run by ``OpenAIServingChat``, so tools, structured outputs,
validation, capacity checks and aborts on disconnect are the chat route's. Its answer is
translated back: text -> a ``message`` item with one ``output_text`` part, tool calls ->
``function_call`` items; a stream of chat chunks -> the Responses event sequence
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., the matching ``.done``
events, ``response.function_call_arguments.delta`` / ``.done`` for tool calls, then
``response.completed`` / ``response.incomplete``; an ``error`` event if generation fails).

``previous_response_id`` continues a conversation kept in memory: the last
``MAX_STORED_RESPONSES`` responses with ``store`` true (the default) are kept, the oldest
dropped first; an unknown id is a 404 naming the field. The previous ``instructions`` are not
carried over (OpenAI's rule).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat

#: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``.
MAX_STORED_RESPONSES = 1000

#: chat request field -> the Responses field a client sent it as (for error ``param``s).
_PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}

#: chat ``finish_reason`` -> (Responses ``status``, ``incomplete_details.reason``).
_STATUS = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "abort": ("cancelled", None),
}


def _text_of(content: Any, where: str) -> str:
    """The text of a message item's ``content``: a string, or ``input_text`` / ``output_text``
    parts joined. Raises APIError naming ``where`` for another part type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of text parts.", 400, param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                f"{where}[{j}]: only input_text / output_text parts with a string text are supported, "
                f"got type {kind!r}.",
                400,
                param=f"{where}[{j}].type",
                code="unsupported",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input``: a string is one user message; ``message``
    items (``role`` user / system / developer / assistant) keep their role, consecutive
    ``function_call`` items become one assistant message's ``tool_calls``, a
    ``function_call_output`` a ``tool`` message.

    Raises:
        APIError: 400 naming ``input[i]`` and the field for an unknown item type or role, or a
            missing ``call_id`` / ``name`` / ``output``.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}.",
                    400,
                    param=f"{where}.role",
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
            for key, value in fields.items():
                if not isinstance(value, str):
                    raise APIError(f"{where}.{key} must be a string.", 400, param=f"{where}.{key}")
            call = {
                "id": fields["call_id"],
                "type": "function",
                "function": {"name": fields["name"], "arguments": fields["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(f"{where}.call_id must be a string.", 400, param=f"{where}.call_id")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")}
            )
        else:
            raise APIError(
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output).",
                400,
                param=f"{where}.type",
                code="unsupported",
            )
    return messages


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request body that runs ``req`` after the stored ``history`` messages."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": bool(req.stream),
        "user": req.user,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict):  # {"type": "function", "name": ...} -> the chat shape
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return {k: v for k, v in body.items() if v is not None}


def _renamed(e: APIError) -> APIError:
    """``e`` with a chat field in its ``param`` named as the Responses field."""
    if e.param:
        head, _, rest = e.param.partition("[")
        if head in _PARAM_NAMES:
            e.param = _PARAM_NAMES[head] + (f"[{rest}" if rest else "")
    return e


class _Conversation:
    """What a stored response continues from: its messages (without instructions) and its
    response object."""

    def __init__(self, messages: list[dict[str, Any]], response: dict[str, Any]):
        self.messages, self.response = messages, response


class OpenAIServingResponses:
    """Handler of ``/v1/responses`` on top of the chat handler (see the module docstring)."""

    def __init__(self, chat: OpenAIServingChat, max_stored: int = MAX_STORED_RESPONSES):
        self.chat = chat
        self.max_stored = max_stored
        self._store: OrderedDict[str, _Conversation] = OrderedDict()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """The stored response object. Raises APIError 404 for an unknown id."""
        conv = self._store.get(response_id)
        if conv is None:
            raise APIError(
                f"response {response_id!r} not found (kept: the last {self.max_stored} stored responses).",
                404,
                param="response_id",
                code="response_not_found",
            )
        return conv.response

    def _remember(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self._store[response_id] = _Conversation(messages, response)
        while len(self._store) > self.max_stored:
            self._store.popitem(last=False)

    async def create_response(self, req: ResponsesRequest, raw_request: Request) -> Response:
        """Validate, run and answer one Responses request (JSON, or an SSE event stream)."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self._store.get(req.previous_response_id)
            if prev is None:
                raise APIError(
                    f"previous_response_id {req.previous_response_id!r} not found (kept: the last "
                    f"{self.max_stored} responses stored with store=true).",
                    404,
                    param="previous_response_id",
                    code="response_not_found",
                )
            history = [dict(m) for m in prev.messages]
        history += input_messages(req.input)
        try:
            chat_req = ChatCompletionRequest(**chat_body(req, history))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise _renamed(APIError(f"{loc}: {err['msg']}", 400, param=loc)) from None
        try:
            answer = await self.chat.create_chat_completion(chat_req, raw_request)
        except APIError as e:
            raise _renamed(e) from None
        response_id = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            inner = answer.body_iterator  # type: ignore[attr-defined]
            answer.body_iterator = self._events(req, inner, history, response_id, created)  # type: ignore[attr-defined]
            return answer
        if not isinstance(answer, JSONResponse):
            return answer  # the client went away (499)
        chat = json.loads(bytes(answer.body))
        choice = chat["choices"][0]
        msg = choice["message"]
        items = self._output_items(msg.get("content"), msg.get("tool_calls") or [])
        response = self._response(
            req, response_id, created, items, choice.get("finish_reason"), chat["usage"]
        )
        if req.store is not False:
            self._remember(response_id, history + [self._assistant_message(msg)], response)
        return JSONResponse(response, headers={"X-Request-Id": response_id})

    # ------------------------------------------------------------------ shapes
    @staticmethod
    def _assistant_message(msg: dict[str, Any]) -> dict[str, Any]:
        # an answer that was all reasoning has null content: stored as empty text, since only an
        # assistant turn with tool calls may leave its content out
        content = msg.get("content")
        if content is None and not msg.get("tool_calls"):
            content = ""
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if msg.get("tool_calls"):
            out["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": dict(c["function"])}
                for c in msg["tool_calls"]
            ]
        return out

    @staticmethod
    def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        return {
            "type": "message",
            "id": item_id or f"msg_{uuid.uuid4().hex}",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
        return {
            "type": "function_call",
            "id": item_id or f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def _output_items(self, content: str | None, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items = [self._message_item(content, "completed")] if content else []
        for c in tool_calls:
            items.append(
                self._call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
            )
        return items

    def _response(
        self,
        req: ResponsesRequest,
        response_id: str,
        created: int,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The Responses API ``response`` object."""
        status, incomplete = (
            _STATUS.get(finish_reason, ("failed", None)) if finish_reason else ("in_progress", None)
        )
        usage = usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "model": req.model or self.chat.served_model_names[0],
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "store": req.store is not False,
            "metadata": req.metadata or {},
            "usage": {
                "input_tokens": usage.get("prompt_tokens", 0),
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage.get("completion_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.get("total_tokens", 0),
            }
            if usage
            else None,
        }

    # ------------------------------------------------------------------ streaming
    async def _events(
        self,
        req: ResponsesRequest,
        chunks: AsyncIterator[str],
        history: list[dict[str, Any]],
        response_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        """The Responses event stream for the chat route's SSE ``chunks``."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, **fields, "sequence_number": seq}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        yield event("response.created", response=self._response(req, response_id, created, [], None, None))
        yield event(
            "response.in_progress", response=self._response(req, response_id, created, [], None, None)
        )
        items: list[dict[str, Any]] = []  # in output order
        message: dict[str, Any] | None = None
        text = ""
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        finish: str | None = None
        usage: dict[str, Any] | None = None
        failed = False
        try:
            async for raw in chunks:
                for line in raw.splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[len("data: ") :])
                    if "error" in obj:
                        failed = True
                        err = obj["error"]
                        yield event(
                            "error", code=err.get("code"), message=err.get("message"), param=err.get("param")
                        )
                        continue
                    usage = obj.get("usage") or usage
                    for ch in obj.get("choices") or []:
                        delta = ch.get("delta") or {}
                        if delta.get("content"):
                            if message is None:
                                message = self._message_item("", "in_progress")
                                message["content"] = []
                                items.append(message)
                                yield event(
                                    "response.output_item.added", output_index=len(items) - 1, item=message
                                )
                                yield event(
                                    "response.content_part.added",
                                    item_id=message["id"],
                                    output_index=len(items) - 1,
                                    content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []},
                                )
                            text += delta["content"]
                            yield event(
                                "response.output_text.delta",
                                item_id=message["id"],
                                output_index=items.index(message),
                                content_index=0,
                                delta=delta["content"],
                                logprobs=[],
                            )
                        for tc in delta.get("tool_calls") or []:
                            fn = tc.get("function") or {}
                            item = calls.get(tc["index"])
                            if item is None:
                                item = self._call_item(
                                    tc.get("id") or "", fn.get("name") or "", "", "in_progress"
                                )
                                calls[tc["index"]] = item
                                items.append(item)
                                yield event(
                                    "response.output_item.added", output_index=len(items) - 1, item=item
                                )
                            if fn.get("arguments"):
                                item["arguments"] += fn["arguments"]
                                yield event(
                                    "response.function_call_arguments.delta",
                                    item_id=item["id"],
                                    output_index=items.index(item),
                                    delta=fn["arguments"],
                                )
                        finish = ch.get("finish_reason") or finish
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        if message is not None:
            i = items.index(message)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=i,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=i,
                content_index=0,
                part=part,
            )
            items[i] = self._message_item(text, "completed", message["id"])
            yield event("response.output_item.done", output_index=i, item=items[i])
        for item in calls.values():
            i = items.index(item)
            item["status"] = "completed"
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                arguments=item["arguments"],
            )
            yield event("response.output_item.done", output_index=i, item=item)
        response = self._response(
            req, response_id, created, items, None if failed else finish or "abort", usage
        )
        if failed:
            response["status"] = "failed"
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        if req.store is not False and not failed:
            tool_calls = [
                {"id": c["call_id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]
            self._remember(
                response_id,
                history + [self._assistant_message({"content": text or None, "tool_calls": tool_calls})],
                response,
            )
        yield event(final, response=response)
