"""The OpenAI-compatible HTTP server: ``kvserve serve [--host] [--port] [--api-key] [engine flags]``.

``build_app(async_engine, served_model_name, ...)`` makes the FastAPI app (usable with any ASGI
server, and in tests); ``main(argv)`` loads the engine and runs it under uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(``/v1/models/{id}``), ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``,
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``, and with
``--enable-sleep-mode`` ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``. Errors use the OpenAI body
``{"error": {"message", "type", "param", "code"}}``: 400 invalid input (naming the field and the
limit), 401 missing/wrong API key (``/v1/*``, ``/tokenize``, ``/detokenize`` when ``--api-key``
is set), 404 unknown model or route, 413 body over ``--max-body-bytes``, 503 + ``Retry-After``
when the waiting queue is at ``--max-waiting``, the engine is asleep or the server is shutting down.

Shutdown (SIGTERM / SIGINT): stop accepting (the listening socket closes, new requests on open
connections get 503), let in-flight requests finish for up to ``--shutdown-grace-s``, then
cancel (= abort) the rest, stop the engine thread and exit 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import kvserve
from kvserve import envs
from kvserve.entrypoints.chat_template import check_chat_template, check_template_kwargs, load_chat_template
from kvserve.entrypoints.openai.errors import error_type
from kvserve.entrypoints.openai.http_protocol import (
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
    DEFAULT_RESPONSE_WRITE_TIMEOUT_S,
    READ_TIMED_OUT,
    ConnectionLimits,
    make_protocol_class,
)
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.entrypoints.openai.offload import OffloadPool
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from kvserve.entrypoints.openai.reasoning_parsers import reasoning_parser_names
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat, chat_template_ids, render_messages
from kvserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvserve.entrypoints.openai.serving_engine import (
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    ClientDisconnected,
    PendingCounter,
    RequestLogger,
    decode_ids,
    encode_text,
    read_json_body,
)
from kvserve.entrypoints.openai.serving_models import (
    LoRAModulePath,
    OpenAIServingModels,
    parse_lora_module,
)
from kvserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from kvserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvserve.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, tool_parser_names
from kvserve.entrypoints.openai.tracing import RequestTracer
from kvserve.transformers_utils.tokenizer_bounds import token_text_bound

logger = logging.getLogger("kvserve.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_KNOWN_PATHS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/responses",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/health",
    "/ping",
    "/version",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/v1/embeddings",
    "/pooling",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
}


@dataclass
class ServerState:
    """Server-wide state. ``draining``: shutting down, new requests get 503. ``inflight``:
    engine request ids of the HTTP requests now generating; ``pending``: admitted requests not
    yet in the engine's queue (both maintained by the handlers)."""

    draining: bool = False
    inflight: set[str] = field(default_factory=set)
    pending: PendingCounter = field(default_factory=PendingCounter)

    def abort_all(self, async_engine) -> int:
        """Abort every in-flight request (their streams end with ``finish_reason="abort"``)."""
        ids = list(self.inflight)
        for rid in ids:
            async_engine.abort(rid)
        if ids:
            logger.warning("shutdown grace period over: aborted %d in-flight request(s)", len(ids))
        return len(ids)


def log_unexpected(exc: BaseException, method: str, path: str) -> None:
    """One ERROR line for an exception no handler expected (its type, where, and the start of
    its message); the traceback only at DEBUG level."""
    logger.error("unhandled %s on %s %s: %.200s", type(exc).__name__, method, path, exc)
    logger.debug("traceback of the unhandled error", exc_info=exc)


def internal_error_response(exc: BaseException) -> JSONResponse:
    """The client's 500 for an unexpected exception: its type only (details stay in the log)."""
    return APIError(
        f"Internal server error ({type(exc).__name__}); the server log has the details.",
        500,
        type="internal_server_error",
        code="internal_error",
    ).to_response()


def _is_protected(path: str) -> bool:
    return (
        path.startswith("/v1/")
        or path == "/v1"
        or path
        in (
            "/tokenize",
            "/detokenize",
            "/reset_prefix_cache",
            "/sleep",
            "/wake_up",
            "/pooling",
            "/score",
            "/rerank",
        )
    )


class _EdgeMiddleware:
    """Pure-ASGI middleware (it does not touch ``receive``, so disconnects still reach the
    handlers): API-key check, response counting for ``/metrics``, and the shutdown drain (a
    request arriving while ``state.draining`` gets 503 ``shutting_down``, except ``/health``
    and ``/metrics``; every response then carries ``Connection: close``)."""

    def __init__(
        self, app, api_key: str | None, metrics: ServerMetrics, state: ServerState, retry_after_s: int
    ):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.state = state
        self.retry_after_s = retry_after_s

    @staticmethod
    def _authorized(scope, api_key: str) -> bool:
        """Whether the request carries ``api_key`` as ``Authorization: Bearer`` or
        ``X-Api-Key`` (compared in constant time)."""
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(token.strip().encode(), api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = (
            path
            if path in _KNOWN_PATHS
            else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        )

        draining = self.state.draining

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_response(endpoint, message["status"])
                if draining or self.state.draining:  # the connection closes after this answer
                    message = dict(message)
                    message["headers"] = [
                        (k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"
                    ] + [(b"connection", b"close")]
            await send(message)

        if draining and path not in ("/health", "/metrics"):
            err = APIError(
                "The server is shutting down.",
                503,
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": str(self.retry_after_s)},
            )
            return await err.to_response()(scope, receive, counting_send)

        if self.api_key and _is_protected(path) and not self._authorized(scope, self.api_key):
            err = APIError(
                "Missing or invalid API key; send 'Authorization: Bearer <key>'.",
                401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await err.to_response()(scope, receive, counting_send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await counting_send(message)

        try:
            return await self.app(scope, receive, tracking_send)
        except Exception as exc:
            # Caught here, not by Starlette's outermost handler (which answers and then
            # re-raises, so uvicorn logged a full traceback per request): one log line, a
            # clean 500 when nothing was sent yet, else the connection ends the response.
            log_unexpected(exc, scope.get("method", "?"), path)
            if not started:
                await internal_error_response(exc)(scope, receive, counting_send)


def build_app(
    async_engine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    extra_model_names: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_requests: bool = True,
    log_prompts: bool = False,
    retry_after_s: int = 1,
    shutdown_grace_s: float = 30.0,
    tool_call_parser: str = DEFAULT_TOOL_PARSER,
    lora_modules: Sequence[LoRAModulePath] = (),
    allowed_lora_root: str | None = None,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    reasoning_parser: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    request_tracer: RequestTracer | None = None,
) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (an ``AsyncLLMEngine``).

    The engine's loop thread is started in the app's lifespan startup if it is not running
    yet (it must deliver outputs to the server's event loop); it is stopped at shutdown only if
    the app started it.

    Args:
        served_model_name: the name reported by ``/v1/models`` and accepted in ``model``.
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
            ``Authorization: Bearer <api_key>`` (401 otherwise); None: no authentication
            (an empty or unsendable key is a ValueError, ``check_api_key``).
        extra_model_names: other names accepted in ``model`` (e.g. the model path).
        max_body_bytes: larger bodies get 413.
        log_requests / log_prompts: the per-request JSON log line, and whether it has prompts.
        retry_after_s: ``Retry-After`` of 503 answers.
        shutdown_grace_s: at lifespan shutdown, how long to wait for in-flight requests before
            the engine thread is stopped.
        tool_call_parser: the ``tool_parsers`` format read for ``tool_choice: "auto"``
            (ValueError if unknown).
        lora_modules: LoRA adapters served from the start (``--lora-modules``), loaded and
            validated here, before the engine loop runs.
        allowed_lora_root: adapters loaded at run time must be directories under it (None:
            anywhere the server can read).
        chat_template: the Jinja2 template chats and ``/tokenize`` messages are rendered with
            (``--chat-template``, already loaded: ``chat_template.load_chat_template``); None:
            the tokenizer's own.
        trust_request_chat_template: whether a request may bring its own ``chat_template``.
        reasoning_parser: the ``reasoning_parsers`` format that splits each chat choice's
            reasoning off into ``reasoning_content`` (None: off).
        default_chat_template_kwargs: template variables every chat and ``/tokenize`` gets
            unless the request's ``chat_template_kwargs`` sets them.
        request_tracer: one OpenTelemetry span per finished generation request
            (``--otlp-traces-endpoint``), flushed at shutdown; None: no traces.

    Raises:
        ValueError: an unknown ``tool_call_parser`` or ``reasoning_parser``; a reserved key in
            ``default_chat_template_kwargs``; ``lora_modules`` while LoRA is off, or
            one that does not load (naming it, and the path or the limit); an invalid
            ``api_key``; an ``allowed_lora_root`` that is not a directory.
    """
    if api_key is not None:
        check_api_key(api_key)
    state = ServerState()
    names = [served_model_name] + [n for n in extra_model_names if n and n != served_model_name]
    req_logger = RequestLogger(enabled=log_requests, log_prompts=log_prompts, tracer=request_tracer)
    # Tokenization, templates and long decodes run off the event loop, on a small pool; a prompt
    # whose length alone proves it too long is refused before it is tokenized.
    pool = OffloadPool()
    text_bound = token_text_bound(async_engine.engine.tokenizer)
    models = OpenAIServingModels(
        async_engine,
        names,
        model_root=async_engine.engine.model_config.model,
        allowed_lora_root=allowed_lora_root,
    )
    if lora_modules:
        thread = getattr(async_engine, "_thread", None)
        if thread is not None and thread.is_alive():
            raise ValueError("lora_modules are loaded before the engine loop starts; build the app first.")
        models.load_startup(lora_modules)
    serving_kwargs: dict[str, Any] = dict(
        models=models,
        request_logger=req_logger,
        server_state=state,
        retry_after_s=retry_after_s,
        pool=pool,
        text_bound=text_bound,
    )
    completion = OpenAIServingCompletion(async_engine, names, **serving_kwargs)
    chat = OpenAIServingChat(
        async_engine,
        names,
        tool_call_parser=tool_call_parser,
        chat_template=None if chat_template is None else check_chat_template(chat_template, "chat_template"),
        trust_request_chat_template=trust_request_chat_template,
        reasoning_parser=reasoning_parser,
        default_chat_template_kwargs=default_chat_template_kwargs,
        **serving_kwargs,
    )
    engine = async_engine.engine
    # a data-parallel engine aggregates its replicas' metrics (kvserve.distributed)
    make_metrics = getattr(async_engine, "make_metrics", None)
    metrics = (
        make_metrics(served_model_name)
        if make_metrics
        else ServerMetrics(engine, served_model_name, num_lora_adapters=models.num_adapters)
    )
    started_here = {"value": False}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if getattr(async_engine, "_thread", None) is None:
            async_engine.start(asyncio.get_running_loop())
            started_here["value"] = True
        try:
            yield
        finally:
            state.draining = True
            loop = asyncio.get_running_loop()
            deadline = loop.time() + shutdown_grace_s
            while async_engine.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            metrics.close()
            pool.close()
            if request_tracer is not None:  # the spans still batched go out now
                await loop.run_in_executor(None, request_tracer.shutdown)
            if started_here["value"]:
                await loop.run_in_executor(None, async_engine.shutdown)

    app = FastAPI(
        title="kvserve OpenAI-compatible API",
        version=kvserve.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.server_state = state
    app.state.metrics = metrics
    app.state.async_engine = async_engine
    app.state.models = models

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = error_type(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        return APIError(
            message, exc.status_code, type=kind, headers=getattr(exc, "headers", None)
        ).to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return APIError(f"Invalid request: {exc.errors()}", 400).to_response()

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected):
        # an ordinary event, not an error: one line, no traceback (nobody reads the answer);
        # a body that timed out was already logged by the protocol
        if not request.scope.get(READ_TIMED_OUT):
            client = request.client
            logger.info(
                "client %s disconnected %s on %s %s",
                f"{client.host}:{client.port}" if client else "?",
                exc,
                request.method,
                request.url.path,
            )
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        # a backstop: _EdgeMiddleware answers the app's unexpected errors before they get here
        log_unexpected(exc, request.method, request.url.path)
        return internal_error_response(exc)

    # ------------------------------------------------------------------ generation
    def _require_generation() -> None:
        if getattr(engine, "runner", "generate") == "pooling":
            raise APIError(
                f"model {served_model_name!r} is a pooling model: it serves /v1/embeddings, /pooling, "
                "/score and /rerank, not text generation.",
                400,
                param="model",
                code="unsupported",
            )

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        """OpenAI completions (text, token ids, batches; streaming with SSE)."""
        _require_generation()
        req = await read_json_body(request, CompletionRequest, max_body_bytes)
        return await completion.create_completion(req, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        """OpenAI chat completions through the tokenizer's chat template."""
        _require_generation()
        req = await read_json_body(request, ChatCompletionRequest, max_body_bytes)
        return await chat.create_chat_completion(req, request)

    # ------------------------------------------------------------------ pooling
    pooling = OpenAIServingPooling(async_engine, names, **serving_kwargs)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request):
        """OpenAI embeddings (text, token ids, batches; float or base64)."""
        pooling.require_embedding()
        req = await read_json_body(request, EmbeddingRequest, max_body_bytes)
        return await pooling.create_embedding(req, request)

    @app.post("/pooling")
    async def create_pooling(request: Request):
        """vLLM's pooling route: the pooled vector of each input (in ``data``)."""
        pooling.require_embedding()
        req = await read_json_body(request, EmbeddingRequest, max_body_bytes)
        return await pooling.create_embedding(req, request, pooling=True)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: Request):
        """Each ``(text_1, text_2)`` pair's score (cosine of embeddings, or a cross-encoder's)."""
        pooling.require_pooling()
        req = await read_json_body(request, ScoreRequest, max_body_bytes)
        return await pooling.create_score(req, request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def create_rerank(request: Request):
        """``documents`` ordered by relevance to ``query`` (as ``/score`` scores them)."""
        pooling.require_pooling()
        req = await read_json_body(request, RerankRequest, max_body_bytes)
        return await pooling.create_rerank(req, request)

    responses = OpenAIServingResponses(chat)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """OpenAI's Responses API, run as a chat completion (``serving_responses``)."""
        _require_generation()
        req = await read_json_body(request, ResponsesRequest, max_body_bytes)
        return await responses.create_response(req, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        """A stored response (the last ``MAX_STORED_RESPONSES`` with ``store`` true)."""
        return JSONResponse(responses.retrieve(response_id))

    # ------------------------------------------------------------------ info

    def _task() -> str:
        # what /v1/models reports: generate, embed, or score (a cross-encoder)
        if getattr(engine, "runner", "generate") != "pooling":
            return "generate"
        return getattr(getattr(engine, "pooler_config", None), "task", "embed")

    def _card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            root=engine.model_config.model or name,
            max_model_len=engine.scheduler_config.max_model_len,
            generation_defaults=dict(getattr(engine, "generation_defaults", None) or {}),
            task=_task(),
        )

    def _lora_card(lora, parent: str) -> ModelCard:
        return ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=parent,
            max_model_len=engine.scheduler_config.max_model_len,
        )

    @app.get("/v1/models")
    async def list_models():
        """The served model, then one card per LoRA adapter (``parent``: its base model)."""
        cards = [_card(served_model_name)] + [_lora_card(r, p) for r, p in models.adapters()]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        """One model by name (404 if unknown)."""
        lora = models.resolve(model_id)
        if lora is None:
            return JSONResponse(_card(served_model_name).model_dump())
        parent = next(p for r, p in models.adapters() if r.lora_int_id == lora.lora_int_id)
        return JSONResponse(_lora_card(lora, parent).model_dump())

    # ------------------------------------------------------------------ LoRA adapters
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """Load a PEFT adapter and serve it under ``lora_name`` (400: LoRA off, name taken,
        invalid adapter)."""
        req = await read_json_body(request, LoadLoRAAdapterRequest, max_body_bytes)
        lora = await models.load_lora_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(
            f"Success: LoRA adapter '{lora.lora_name}' loaded (id {lora.lora_int_id}).", status_code=200
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """Stop serving ``lora_name`` (404 if not loaded); running requests finish with it."""
        req = await read_json_body(request, UnloadLoRAAdapterRequest, max_body_bytes)
        lora, running = await models.unload_lora_adapter(req.lora_name)
        text = f"Success: LoRA adapter '{lora.lora_name}' unloaded."
        if running:
            text += f" {running} running request(s) finish with it first."
        return PlainTextResponse(text, status_code=200)

    # ------------------------------------------------------------------ operators
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop every cached KV block no running request holds (e.g. after changing weights
        or to measure cold starts). ``{"reset": true}`` when no cached block is left,
        ``false`` when running requests still hold some (theirs stay until they end)."""
        try:
            reset = await async_engine.reset_prefix_cache()
        except Exception as e:
            raise completion.engine_error(e) from None
        return JSONResponse({"reset": bool(reset)})

    def _check_sleep_mode() -> None:
        if not getattr(engine, "enable_sleep_mode", False):
            raise APIError(
                "Sleep mode is off: start the server with --enable-sleep-mode.",
                400,
                code="sleep_mode_disabled",
            )

    @app.post("/sleep")
    async def sleep(request: Request):
        """Sleep mode (``--enable-sleep-mode``): free the KV cache and offload (``level=1``, the
        default; on CPU the weights stay in place) or drop (``level=2``) the weights. 409
        ``requests_in_flight`` while requests run; 400 when sleep mode is off, for a level
        other than 1 or 2 (or given twice), or when asleep already. Requests get 503 ``engine_sleeping`` until
        ``/wake_up``."""
        from kvserve.engine.llm_engine import RequestsInFlightError

        _check_sleep_mode()
        given = request.query_params.getlist("level")
        if len(given) > 1:  # which one was meant is unknown: never pick one silently
            raise APIError(
                f"level must be given once, got {len(given)} values.",
                400,
                param="level",
                code="invalid_value",
            )
        raw = given[0] if given else "1"
        try:
            level = int(raw)
        except ValueError:
            level = 0
        if level not in (1, 2):
            raise APIError(f"level must be 1 or 2, got {raw!r}.", 400, param="level", code="invalid_value")
        try:
            await async_engine.sleep(level)
        except RequestsInFlightError as e:
            raise APIError(str(e), 409, code="requests_in_flight") from None
        except ValueError as e:  # asleep already: the engine's message names its Python call
            msg = str(e).replace("wake_up() first", "POST /wake_up first")
            raise APIError(msg, 400, code="invalid_state") from None
        return JSONResponse({"is_sleeping": True, "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request):
        """Bring back what ``/sleep`` put away: ``tags`` (repeatable: ``weights``,
        ``kv_cache``; none: both); requests are taken again once both are back. 400 when sleep
        mode is off or for an unknown tag."""
        _check_sleep_mode()
        tags = request.query_params.getlist("tags") or None
        try:
            await async_engine.wake_up(tags)
        except ValueError as e:
            raise APIError(str(e), 400, param="tags", code="invalid_value") from None
        return JSONResponse({"is_sleeping": async_engine.is_sleeping})

    @app.get("/is_sleeping")
    async def is_sleeping():
        """``{"is_sleeping": bool}`` (always false without ``--enable-sleep-mode``)."""
        return JSONResponse({"is_sleeping": bool(getattr(engine, "is_sleeping", False))})

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def health():
        """200 while the engine loop is alive and the server is not draining, else 503 (also
        at ``/ping``, vLLM's name for it, GET or POST, and for HEAD requests). Data
        parallel: 200 while a replica is up, ``{"status": "degraded", "replicas": [...]}``
        (each ``up``, ``recovering`` or ``dead``) while some other one is not."""
        thread = getattr(async_engine, "_thread", None)
        replica_states = getattr(async_engine, "replica_states", None)
        states = replica_states() if replica_states is not None else None
        if async_engine.errored is not None or (thread is not None and not thread.is_alive()):
            message = "engine loop is not running"
            if states is not None:
                message = f"no data-parallel replica is up (replicas: {', '.join(states)})"
            return APIError(message, 503, type="service_unavailable", code="engine_dead").to_response()
        if state.draining:
            return APIError(
                "the server is shutting down", 503, type="service_unavailable", code="shutting_down"
            ).to_response()
        if states is not None and any(st != "up" for st in states):
            return JSONResponse({"status": "degraded", "replicas": states})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        """The kvserve version."""
        return JSONResponse({"version": kvserve.__version__})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics():
        """Prometheus text exposition."""
        refresh = getattr(metrics, "refresh", None)
        if refresh is not None:  # data parallel: fetch the replicas' families first
            await refresh()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """Token ids of a prompt (``prompt``) or a chat (``messages``, with the template)."""
        req = await read_json_body(request, TokenizeRequest, max_body_bytes)
        completion.check_model(req.model)
        tok = engine.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer", 400, code="no_tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(
                "give exactly one of 'prompt' or 'messages'.", 400, param="prompt", code="invalid_value"
            )
        if req.prompt is not None:
            ids = await completion.offload(
                len(req.prompt), encode_text, tok, req.prompt, req.add_special_tokens is not False
            )
        else:
            conv = render_messages(req.messages)
            template, template_kwargs = chat.template_for(req)
            size = sum(len(m["content"]) for m in conv)
            ids = await completion.offload(
                size,
                chat_template_ids,
                tok,
                conv,
                req.add_generation_prompt is not False,
                template,
                template_kwargs,
            )
        # a long prompt's response (hundreds of thousands of ids) is built and encoded on the
        # pool too: on the event loop it would hold every other connection meanwhile
        body = await completion.offload(len(ids), _tokenize_body, ids, engine.scheduler_config.max_model_len)
        return Response(content=body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """Text of a list of token ids."""
        req = await read_json_body(request, DetokenizeRequest, max_body_bytes)
        completion.check_model(req.model)
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(
                f"tokens must be token ids in [0, {vocab}); got {bad[:5]}.",
                400,
                param="tokens",
                code="invalid_value",
            )
        tok = engine.tokenizer
        text = (
            await completion.offload(len(req.tokens), decode_ids, tok, req.tokens) if tok is not None else ""
        )
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    app.add_middleware(
        _EdgeMiddleware, api_key=api_key, metrics=metrics, state=state, retry_after_s=retry_after_s
    )
    return app


# ---------------------------------------------------------------------- the process
def _tokenize_body(ids: list[int], max_model_len: int) -> bytes:
    """The JSON body of a ``/tokenize`` answer (``TokenizeResponse``) for token ids ``ids``."""
    return (
        TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_model_len).model_dump_json().encode()
    )


def check_api_key(key: str) -> str:
    """``key`` if a client can ever send it, else ValueError saying why: an empty key would
    turn authentication off without a word, and one with leading or trailing whitespace or
    characters outside printable ASCII can never match a header (HTTP headers are latin-1 and
    the token is stripped)."""
    if key == "":
        raise ValueError(
            "the API key is empty, which would leave the server open; give a key, or leave "
            "--api-key and $KVSERVE_API_KEY unset to serve without one."
        )
    if key != key.strip() or not all(" " <= ch <= "~" for ch in key):
        raise ValueError(
            "the API key must be printable ASCII without leading or trailing whitespace "
            "(no client could send any other key in a header)."
        )
    return key


def _api_key_arg(text: str) -> str:
    try:
        return check_api_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """``--default-chat-template-kwargs``: a JSON object of template variables, none reserved
    (``chat_template.check_template_kwargs``).

    Raises:
        argparse.ArgumentTypeError: not JSON, not an object, or a reserved key.
    """
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    try:
        return check_template_kwargs(value, "--default-chat-template-kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_arg_parser() -> argparse.ArgumentParser:
    """``kvserve serve`` flags: server flags plus every engine flag (``EngineArgs``), and
    vLLM's flags and positional MODEL (``vllm_compat``: hidden from ``--help``, acted on by
    ``vllm_compat.apply_vllm_flags`` after parsing)."""
    from kvserve.entrypoints.cli import add_engine_args
    from kvserve.entrypoints.vllm_compat import add_vllm_flags, server_log_level

    p = argparse.ArgumentParser(
        prog="kvserve serve",
        description="OpenAI-compatible HTTP server.",
        epilog="vLLM's flags are accepted too, each with the fate docs/coming_from_vllm.md gives it.",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (vLLM's `vllm serve MODEL`)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s; 0.0.0.0: all)"
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        type=_api_key_arg,  # argparse applies it to the environment default too
        default=envs.KVSERVE_API_KEY,
        help="require 'Authorization: Bearer KEY' (default: $KVSERVE_API_KEY, unset = open); "
        "printable ASCII without leading or trailing spaces, never empty",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help=f"model name(s) accepted, the first reported (default: the --model path or {DEFAULT_MODEL_NAME})",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted, in bytes (else 413; default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may run before they are aborted",
    )
    p.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of 503 answers")
    p.add_argument(
        "--request-read-timeout-s",
        type=float,
        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
        help="a request's headers and body must arrive within this many seconds (else 408 and close)",
    )
    p.add_argument(
        "--response-write-timeout-s",
        type=float,
        default=DEFAULT_RESPONSE_WRITE_TIMEOUT_S,
        help="abort a connection whose client takes none of a pending response for this many seconds",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="most open connections; past it a new connection gets 503 and is closed",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help="close a keep-alive connection idle for this many seconds",
    )
    p.add_argument(
        "--log-level",
        type=server_log_level,
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default: %(default)s; vLLM's DEBUG ... CRITICAL, NOTSET too)",
    )
    p.add_argument(
        "--request-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one JSON line per finished request",
    )
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in the request log")
    p.add_argument(
        "--tool-call-parser",
        default=DEFAULT_TOOL_PARSER,
        choices=tool_parser_names(),
        help="format of the model's tool calls, read for tool_choice 'auto' (default: %(default)s)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on (the model's calls "
        "are read with --tool-call-parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=reasoning_parser_names(),
        help="split the reasoning of thinking models off into reasoning_content on chat answers "
        "(default: off)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        type=parse_template_kwargs,
        metavar="JSON",
        help="template variables for every chat, as a JSON object (e.g. '{\"enable_thinking\": false}'); "
        "a request's chat_template_kwargs overrides them key by key",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="Jinja2 chat template for chats and /tokenize messages: a file, or the template inline "
        "(default: the model's own, from its tokenizer config or GGUF metadata)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (a template runs code on the server)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (needs --enable-lora): name=path, or JSON "
        '\'{"name": "sql", "path": "/p", "base_model_name": "..."}\'',
    )
    p.add_argument(
        "--allowed-lora-root",
        default=None,
        metavar="DIR",
        help="adapters loaded at run time (/v1/load_lora_adapter): their directory and both "
        "files must resolve (symlinks followed) under DIR; default: any the server can read",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send one OpenTelemetry span per request to this OTLP/HTTP collector "
        "(e.g. http://localhost:4318/v1/traces); needs the otel extra: pip install 'kvserve[otel]'",
    )
    add_engine_args(p)
    add_vllm_flags(p)
    return p


class GracefulServer:
    """A uvicorn server whose SIGTERM/SIGINT starts a graceful drain and then exits 0.

    On the first signal: ``state.draining`` is set (new requests get 503), uvicorn closes the
    listening socket and waits for open responses; after ``grace_s`` seconds ``on_grace_over``
    runs (it aborts what is still generating, so those streams end with
    ``finish_reason="abort"`` and a clean ``[DONE]``). uvicorn's own
    ``timeout_graceful_shutdown`` should be a little longer, as a backstop. (uvicorn re-raises
    the captured signal after shutting down, which would make the exit status 143/130; here the
    signal only starts the drain.)
    """

    def __init__(
        self,
        config,
        state: ServerState,
        grace_s: float = 30.0,
        on_grace_over: Callable[[], object] | None = None,
    ):
        import uvicorn

        self.state = state
        outer = self
        timer = {"set": False}

        def start_grace_timer() -> None:
            if timer["set"] or on_grace_over is None:
                return
            timer["set"] = True
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon_threadsafe(loop.call_later, grace_s, on_grace_over)

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                sigs = (signal.SIGINT, signal.SIGTERM)
                previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
                try:
                    yield
                finally:
                    for s, h in previous.items():
                        signal.signal(s, h)

            def handle_exit(self, sig, frame):
                if outer.state.draining and sig == signal.SIGINT:
                    self.force_exit = True
                outer.state.draining = True
                self.should_exit = True
                start_grace_timer()

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if sockets is not None and self.started:
                    # uvicorn names the address it listens on only for sockets it bound itself
                    self._log_started_message(sockets)

            async def shutdown(self, sockets=None):
                # however the exit was asked for (signal or should_exit): drain before uvicorn
                # asks the connections to shut down, so they answer 503 meanwhile
                outer.state.draining = True
                start_grace_timer()
                await super().shutdown(sockets=sockets)

        self.server = _Server(config)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until a signal (blocking); on ``sockets`` when given (already bound: see
        ``bind_socket``), else on the config's host and port."""
        self.server.run(sockets=sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a ``:``), for uvicorn to
    listen on. ``kvserve serve`` binds it before loading the model, so a port in use is an error
    at once instead of after the load.

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    limits: ConnectionLimits | None = None,
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    retry_after_s: int = 1,
    timeout_graceful_shutdown: float | None = None,
    log_level: str = "info",
):
    """The ``uvicorn.Config`` kvserve runs ``app`` with: the h11 protocol with read deadlines and
    a connection cap (``http_protocol``), the idle keep-alive timeout, no access log (the app
    logs one line per request)."""
    import uvicorn

    if not keep_alive_timeout_s > 0:
        raise ValueError(f"keep_alive_timeout_s must be > 0, got {keep_alive_timeout_s}.")
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=make_protocol_class(limits or ConnectionLimits(), retry_after_s=retry_after_s),
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=timeout_graceful_shutdown,  # type: ignore[arg-type]
        access_log=False,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvserve serve``; returns the exit status."""
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.cli import engine_args_from, flag_names
    from kvserve.entrypoints.vllm_compat import apply_vllm_flags, typed_flags

    parser = make_arg_parser()
    ns = parser.parse_args(argv)
    try:
        compat_lines = apply_vllm_flags(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.lora_modules and not ns.enable_lora:
        parser.error("--lora-modules needs --enable-lora (LoRA is off).")
    if ns.allowed_lora_root is not None:
        if not ns.enable_lora:
            parser.error("--allowed-lora-root needs --enable-lora (LoRA is off).")
        if not os.path.isdir(ns.allowed_lora_root):
            parser.error(f"--allowed-lora-root {ns.allowed_lora_root!r} is not a directory.")
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for line in compat_lines:  # an ignored flag is a warning; a mapped one, an accepted value: information
        logger.log(logging.WARNING if " ignored: " in line else logging.INFO, line)
    names = list(ns.served_model_name or [])
    name = names[0] if names else ns.model or DEFAULT_MODEL_NAME
    tracer = None
    if ns.otlp_traces_endpoint is not None:
        try:  # before the model loads: a missing package is said at once
            tracer = RequestTracer(ns.otlp_traces_endpoint)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        logger.info("OpenTelemetry: one span per request to %s", tracer.url)
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        print(
            f"error: --host {ns.host} --port {ns.port}: cannot listen there: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    try:
        chat_template = None if ns.chat_template is None else load_chat_template(ns.chat_template)
        engine_args = engine_args_from(ns)
        if engine_args.data_parallel_size > 1:
            # N replicas on Ray behind this one endpoint (Ray is imported only here)
            from kvserve.distributed import start_data_parallel_engine

            async_engine = start_data_parallel_engine(engine_args, name)
            engine = async_engine.engine
        else:
            engine = LLMEngine.from_engine_args(engine_args)
            async_engine = AsyncLLMEngine(engine)
    except ValueError as e:  # named as the flag the user typed
        print(f"error: {typed_flags(flag_names(str(e)), ns)}", file=sys.stderr)
        return 2
    aliases = names[1:] + ([ns.model] if ns.model else [])
    try:
        app = build_app(
            async_engine,
            name,
            ns.api_key,
            extra_model_names=aliases,
            max_body_bytes=ns.max_body_bytes,
            log_requests=ns.request_log,
            log_prompts=ns.log_prompts,
            retry_after_s=ns.retry_after_s,
            shutdown_grace_s=5.0,
            tool_call_parser=ns.tool_call_parser,
            lora_modules=ns.lora_modules or (),
            allowed_lora_root=ns.allowed_lora_root,
            chat_template=chat_template,
            trust_request_chat_template=ns.trust_request_chat_template,
            reasoning_parser=ns.reasoning_parser,
            default_chat_template_kwargs=ns.default_chat_template_kwargs,
            request_tracer=tracer,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = app.state.server_state
    grace = max(0.0, ns.shutdown_grace_s)
    try:
        limits = ConnectionLimits(
            request_read_timeout_s=ns.request_read_timeout_s,
            response_write_timeout_s=ns.response_write_timeout_s,
            max_connections=ns.max_connections,
        )
        config = uvicorn_config(
            app,
            ns.host,
            ns.port,
            limits=limits,
            keep_alive_timeout_s=ns.keep_alive_timeout_s,
            retry_after_s=ns.retry_after_s,
            timeout_graceful_shutdown=grace + 5.0,
            log_level=ns.log_level,
        )
    except ValueError as e:
        engine.shutdown()
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.info(
        "serving %s on http://%s:%d/v1 (max_model_len %d, %s%s)",
        name,
        ns.host,
        ns.port,
        engine.scheduler_config.max_model_len,
        f"{engine.cache_config.num_gpu_blocks} KV blocks"
        if engine.runner == "generate"
        else "pooling runner, no KV cache",
        f" per replica, {engine_args.data_parallel_size} replicas, router {engine_args.router}"
        if engine_args.data_parallel_size > 1
        else "",
    )
    try:
        GracefulServer(config, state, grace_s=grace, on_grace_over=lambda: state.abort_all(async_engine)).run(
            sockets=[sock]
        )
    finally:
        engine.shutdown()  # the tensor-parallel peer ranks, if any
    logger.info("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
