"""``POST /v1/chat/completions``: messages are rendered with the tokenizer's chat template
(``apply_chat_template``), then run like a completion of those token ids.

Streaming: per choice, content (or tool-call) deltas, the growth of ``CompletionOutput.text``;
the first of them also carries ``"role": "assistant"``, so nothing is sent before the first
token and a client timing the first chunk measures the real time to first token. Then a chunk
with the ``finish_reason`` and an empty delta (``{"role": "assistant", "content": ""}`` for a
choice that ended without any visible output, e.g. aborted); a usage chunk (``choices: []``)
when ``stream_options.include_usage``; then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.chat_template import check_chat_template, check_template_kwargs
from kvserve.entrypoints.openai.chat_output import ChoiceReader
from kvserve.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TokenizeRequest,
    TopLogprob,
)
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from kvserve.entrypoints.openai.serving_completion import sampling_kwargs
from kvserve.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    RequestRecord,
    Reservation,
    SubRequest,
    encode_text,
    finite,
    sse,
    stream_outputs,
)
from kvserve.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, ToolParser, get_tool_parser
from kvserve.entrypoints.openai.tools import (
    ChoiceToolCalls,
    ToolPlan,
    finish_reason,
    plan_tools,
    template_message,
)
from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams

_ROLES = {"system", "user", "assistant", "tool", "developer"}


def render_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``{"role", "content"}`` dicts for the chat template (text parts joined), plus an
    assistant message's ``tool_calls`` (arguments decoded from JSON) and a tool message's
    ``tool_call_id`` / ``name``.

    Raises:
        APIError: 400 naming ``messages`` for an empty list, an unknown role, a non-text part
            or a ``tool`` message without ``tool_call_id``; naming the field for a text part
            without text, ``tool_call_id`` on a message that is not ``tool``'s or
            ``tool_calls`` on one that is not the assistant's; naming ``messages[i].<field>`` for
            a non-empty ``refusal`` / ``audio`` / ``function_call`` / ``annotations``, and
            ``messages[i].content`` when it is missing or null on any message but an assistant
            one with ``tool_calls``.
    """
    if not messages:
        raise APIError(
            "messages must contain at least 1 message; got an empty list.",
            400,
            param="messages",
            code="invalid_value",
        )
    conv = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise APIError(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {m.role!r}.",
                400,
                param="messages",
                code="invalid_value",
            )
        unused = m.unused_fields()
        if unused:
            raise APIError(
                f"messages[{i}].{unused[0]} is accepted only empty (null): kvserve does not show it "
                "to the model.",
                400,
                param=f"messages[{i}].{unused[0]}",
                code="unsupported",
            )
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(
                f"messages[{i}].tool_call_id belongs on a 'tool' message (the answer to a call), "
                f"not on a {m.role!r} one.",
                400,
                param=f"messages[{i}].tool_call_id",
                code="invalid_value",
            )
        if m.tool_calls and m.role != "assistant":
            raise APIError(
                f"messages[{i}].tool_calls belongs on an 'assistant' message, not on a {m.role!r} one.",
                400,
                param=f"messages[{i}].tool_calls",
                code="invalid_value",
            )
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(
                f"messages[{i}]: a message with role 'tool' needs the tool_call_id it answers.",
                400,
                param="messages",
                code="invalid_value",
            )
        if m.content is None and m.role != "assistant":
            # an assistant turn may come back without text (tool calls, or an answer that was
            # all reasoning, as clients echo it): it renders empty; any other turn is the input
            raise APIError(
                f"messages[{i}].content is required on a {m.role!r} message (missing or null "
                "content is allowed only on an assistant message).",
                400,
                param=f"messages[{i}].content",
                code="missing_field",
            )
        content = m.content
        if isinstance(content, list):
            texts: list[str] = []
            for j, part in enumerate(content):
                if part.type == "text" and part.text is None:
                    raise APIError(
                        f"messages[{i}].content[{j}].text is missing (a text part needs its text).",
                        400,
                        param=f"messages[{i}].content[{j}].text",
                        code="invalid_value",
                    )
                if part.type != "text":
                    raise APIError(
                        f"messages[{i}].content[{j}]: only text parts are supported, got type {part.type!r}.",
                        400,
                        param="messages",
                        code="unsupported",
                    )
                texts.append(part.text or "")
            content = "".join(texts)
        entry: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        entry.update(template_message(m, i))
        conv.append(entry)
    return conv


def render_chat(
    tokenizer,
    conv: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation rendered by a chat template, as text (tokenize it with
    ``add_special_tokens=False``: the template already has them). ``tools`` (OpenAI's
    ``{"type": "function", "function": {...}}`` entries) are passed to the template, which
    decides how to show them (a template that never reads ``tools`` ignores them).
    ``chat_template``: the template to use (``None``: the tokenizer's own);
    ``template_kwargs``: extra template variables (``chat_template.check_template_kwargs``).

    Raises:
        APIError: 400 naming ``messages`` when there is no tokenizer or template, or the
            template rejects the conversation (e.g. roles out of order).
    """
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise APIError(
            "This model has no chat template; use /v1/completions, or start the server with --chat-template.",
            400,
            param="messages",
            code="no_chat_template",
        )
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(
            conv,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template,
            **extra,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja2 TemplateError / ValueError: the conversation is invalid
        raise APIError(
            f"messages could not be rendered with the chat template: {e}",
            400,
            param="messages",
            code="invalid_value",
        ) from None
    return str(text)


def chat_text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat (``render_chat``), as ``apply_chat_template(tokenize=True)``
    would give them."""
    return [int(t) for t in encode_text(tokenizer, text, add_special_tokens=False)]


def chat_template_ids(
    tokenizer,
    conv: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by a chat template (``render_chat`` then
    ``chat_text_ids``; same arguments and errors)."""
    text = render_chat(tokenizer, conv, add_generation_prompt, None, chat_template, template_kwargs)
    return chat_text_ids(tokenizer, text)


class OpenAIServingChat(OpenAIServing):
    """Handler of ``/v1/chat/completions``."""

    endpoint = "chat"

    def __init__(
        self,
        *args,
        tool_call_parser: str = DEFAULT_TOOL_PARSER,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        reasoning_parser: str | None = None,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        #: the format ``tool_choice: "auto"`` reads (``--tool-call-parser``)
        self.tool_parser_cls: type[ToolParser] = get_tool_parser(tool_call_parser)
        #: splits the reasoning off every choice (``--reasoning-parser``); None: off
        self.reasoning_parser_cls: type[ReasoningParser] | None = (
            None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        )
        #: template variables every chat gets unless it sets them (``--default-chat-template-kwargs``)
        self.default_template_kwargs = check_template_kwargs(
            default_chat_template_kwargs, "default_chat_template_kwargs"
        )
        #: the server's template (``--chat-template``, checked); None: the tokenizer's own
        self.chat_template = chat_template
        #: whether a request may bring its own ``chat_template`` (``--trust-request-chat-template``)
        self.trust_request_chat_template = trust_request_chat_template

    def template_for(self, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str | None, dict[str, Any]]:
        """``(template, extra variables)`` that render ``req``'s messages: its own
        ``chat_template`` (only on a server that trusts request templates), else the server's;
        its ``chat_template_kwargs`` over the server's defaults.

        Raises:
            APIError: 400 naming ``chat_template`` (not trusted, or invalid Jinja2) or the
                reserved ``chat_template_kwargs`` key.
        """
        template = self.chat_template
        if req.chat_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(
                    "chat_template in a request is refused: a template runs code on the server; start "
                    "it with --trust-request-chat-template to allow it, or use --chat-template.",
                    400,
                    param="chat_template",
                    code="unsupported",
                )
            try:
                template = check_chat_template(req.chat_template, "chat_template")
            except ValueError as e:
                raise APIError(str(e), 400, param="chat_template", code="invalid_value") from None
        try:
            kwargs = check_template_kwargs(req.chat_template_kwargs, "chat_template_kwargs")
        except ValueError as e:
            raise APIError(str(e), 400, param="chat_template_kwargs", code="invalid_value") from None
        return template, {**self.default_template_kwargs, **kwargs}

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        """Validate, queue and answer one chat request (JSON or an SSE stream)."""
        lora = self.check_model(req.model)
        priority = self.request_priority(req.priority)
        plan = plan_tools(req, self.tool_parser_cls)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(
                "prompt_logprobs is not supported with stream=true on chat completions.",
                400,
                param="prompt_logprobs",
                code="unsupported",
            )
        logprobs: int | None = None
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(
                    "top_logprobs requires logprobs=true.", 400, param="top_logprobs", code="invalid_value"
                )
            if not 0 <= req.top_logprobs <= 20:
                raise APIError(
                    f"top_logprobs must be an integer in [0, 20], got {req.top_logprobs}.",
                    400,
                    param="top_logprobs",
                    code="invalid_value",
                )
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rename = {"prompt": "messages"}
        if req.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        kwargs = sampling_kwargs(req, max_tokens, logprobs, self.generation_defaults)
        if (
            plan.mode == "auto"
            and self.tool_parser_cls.keeps_special_tokens
            and "skip_special_tokens" not in req.model_fields_set
        ):
            # the format's markers are special tokens: keep them in the text the parser reads
            kwargs["skip_special_tokens"] = False
        if plan.constraint is not None:
            own = kwargs["structured_outputs"]
            if own is not None:
                param = own.origin.split(".")[0]
                raise APIError(
                    f"{param} cannot be combined with tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'naming a function'!r}, "
                    "which constrains the output to the tool call.",
                    400,
                    param=param,
                    code="invalid_value",
                )
            kwargs["structured_outputs"] = plan.constraint
        params = self.make_sampling_params(kwargs, rename)
        if plan.schema_check is not None:
            await self.compile_constraint(plan.schema_check)
        await self.compile_constraint(params.structured_outputs)
        conv = render_messages(req.messages)
        template, template_kwargs = self.template_for(req)
        size = sum(len(m["content"]) for m in conv) + (
            len(json.dumps(plan.template_tools)) if plan.template_tools else 0
        )
        text = await self.offload(
            size,
            render_chat,
            self.tokenizer,
            conv,
            req.add_generation_prompt is not False,
            plan.template_tools,
            template,
            template_kwargs,
        )
        make_reasoning = None
        if self.reasoning_parser_cls is not None:
            cls = self.reasoning_parser_cls
            self.check_reasoning_constraint(cls(text), params)

            def make_reasoning() -> ReasoningParser:
                return cls(text)

        sub = await self.prepare_prompt(text, params, rename, chat=True)
        reservation = self.check_capacity(1)
        rec = self.new_record(
            "chatcmpl", params.n, [sub], lora, params=params, headers=raw_request.headers, tenant=req.user
        )
        if self.request_logger.log_prompts:
            rec.prompts = [text]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            raw_request,
            bool(req.stream),
            lambda: self._stream(
                req, params, sub, rec, priority, include_usage, reservation, plan, make_reasoning
            ),
            lambda: self._full(req, params, sub, rec, priority, reservation, plan, make_reasoning),
            rec,
            reservation,
        )

    def check_reasoning_constraint(self, parser: ReasoningParser, params: SamplingParams) -> None:
        """Refuse an output constraint the reasoning would break: a constraint applies from the
        first generated token, so it would forbid the thinking the reasoning parser expects.
        Allowed when the prompt already ended the reasoning (thinking turned off by the
        template, e.g. ``chat_template_kwargs: {"enable_thinking": false}`` on Qwen3).

        Raises:
            APIError: 400 naming the constraint's field (``response_format``,
                ``structured_outputs``, ``tool_choice``, ...).
        """
        so = params.structured_outputs
        if so is None or parser.output_is_content():
            return
        param = "tool_choice" if so.origin == "tools" else so.origin.split(".")[0]
        raise APIError(
            f"{param} constrains the output from its first token, which would forbid the reasoning "
            f"that this server's --reasoning-parser {parser.name} reads. Turn thinking off for the "
            "request so the prompt closes the reasoning block (e.g. chat_template_kwargs "
            '{"enable_thinking": false} when the chat template reads it), or leave out ' + f"{param}.",
            400,
            param=param,
            code="unsupported",
        )

    def _reader(self, plan: ToolPlan, make_reasoning: Callable[[], ReasoningParser] | None) -> ChoiceReader:
        tools = ChoiceToolCalls(plan.make_parser(), plan.max_calls) if plan.make_parser is not None else None
        return ChoiceReader(make_reasoning() if make_reasoning is not None else None, tools)

    async def _full(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        sub: SubRequest,
        rec: RequestRecord,
        priority: int,
        reservation: Reservation,
        plan: ToolPlan,
        make_reasoning: Callable[[], ReasoningParser] | None = None,
    ) -> dict:
        try:
            async for idx, out in self.generate_all(
                [sub], params, priority, reservation, lora_request=rec.lora_request, tenant=req.user
            ):
                rec.observe(idx, out)
                if out.finished and out.outcome in ("rejected", "failed"):
                    raise self.rejected_error(out, "messages")
        except APIError:
            raise
        except Exception as e:
            raise self.engine_error(e, {"prompt": "messages"}) from None
        out = rec.latest[0]
        choices = []
        for c in out.outputs:
            message = ChatResponseMessage(role="assistant", content=c.text)
            reason = c.finish_reason
            if plan.make_parser is not None or make_reasoning is not None:
                reader = self._reader(plan, make_reasoning)
                reasoning, message.content, message.tool_calls = reader.whole(c.text)
                message.reasoning_content = message.reasoning = reasoning
                reason = finish_reason(c.finish_reason, reader.calls)
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0)
                    if req.logprobs
                    else None,
                    finish_reason=reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=rec.request_id,
            model=self.response_model(rec),
            choices=choices,
            usage=rec.usage(),
            prompt_logprobs=self.prompt_logprobs_json(out.prompt_logprobs),
        ).model_dump()

    def _stream(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        sub: SubRequest,
        rec: RequestRecord,
        priority: int,
        include_usage: bool,
        reservation: Reservation,
        plan: ToolPlan,
        make_reasoning: Callable[[], ReasoningParser] | None = None,
    ):
        created = int(time.time())
        readers: dict[int, ChoiceReader] = {}
        if plan.make_parser is not None or make_reasoning is not None:
            readers = {i: self._reader(plan, make_reasoning) for i in range(params.n)}
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        roled: set[int] = set()  # choices whose first chunk (the one with the role) went out
        done = set()

        def role(i: int) -> str | None:
            """The role for choice ``i``'s chunk about to be sent: only on its first one."""
            if i in roled:
                return None
            roled.add(i)
            return "assistant"

        def chunk(choices, usage=None) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=rec.request_id,
                    created=created,
                    model=self.response_model(rec),
                    choices=choices,
                    usage=usage,
                )
            )

        async def events():
            async for idx, out in self.generate_all(
                [sub], params, priority, reservation, lora_request=rec.lora_request, tenant=req.user
            ):
                rec.observe(idx, out)
                if out.finished and out.outcome in ("rejected", "failed"):
                    raise self.rejected_error(out, "messages")
                for c in stream_outputs(out, params.n):
                    i = c.index
                    if i in done:
                        continue
                    start_chars, start_toks = sent_chars.get(i, 0), sent_tokens.get(i, 0)
                    tool_deltas = None
                    thought = ""
                    reason = c.finish_reason
                    if i in readers:
                        thought, delta, tool_deltas = readers[i].update(c.text, c.finish_reason is not None)
                        reason = finish_reason(c.finish_reason, readers[i].calls)
                    else:
                        delta = c.text[start_chars:]
                    want_lp = bool(req.logprobs) and len(c.token_ids) > start_toks
                    if thought or delta or tool_deltas or want_lp:
                        lp = (
                            self._logprobs(c, start_toks, len(c.token_ids), req.top_logprobs or 0)
                            if req.logprobs
                            else None
                        )
                        sent_chars[i] = max(start_chars, len(c.text))
                        sent_tokens[i] = len(c.token_ids)
                        yield chunk(
                            [
                                ChatCompletionStreamChoice(
                                    index=i,
                                    delta=DeltaMessage(
                                        role=role(i),
                                        content=delta if delta or not (tool_deltas or thought) else None,
                                        reasoning_content=thought or None,
                                        reasoning=thought or None,
                                        tool_calls=tool_deltas or None,
                                    ),
                                    logprobs=lp,
                                )
                            ]
                        )
                    if c.finish_reason is not None:
                        done.add(i)
                        # a choice with no chunk yet (no visible output) still gets its role
                        first = role(i)
                        yield chunk(
                            [
                                ChatCompletionStreamChoice(
                                    index=i,
                                    delta=DeltaMessage(role=first, content=""),
                                    finish_reason=reason,
                                    stop_reason=c.stop_reason,
                                )
                            ]
                        )

        usage = (lambda: chunk([], usage=rec.usage())) if include_usage else None
        return self.sse_frame(events(), rec, usage, done, params.n, {"prompt": "messages"})

    def _logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> ChatChoiceLogprobs:
        """Chat logprobs of tokens ``[start, end)``: each token with its ``top_n`` alternatives."""
        content = []
        entries = c.logprobs or []
        for tid, top in zip(c.token_ids[start:end], entries[start:end]):
            s = self.token_str(tid)
            own = (top or {}).get(tid)
            lp = finite(None if own is None else own.logprob)
            alts = sorted((top or {}).items(), key=lambda kv: -kv[1].logprob)[:top_n]
            content.append(
                ChatLogprobToken(
                    token=s,
                    logprob=lp if lp is not None else -9999.0,
                    bytes=list(s.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=self.token_str(t),
                            logprob=finite(v.logprob),
                            bytes=list(self.token_str(t).encode("utf-8")),
                        )
                        for t, v in alts
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)
