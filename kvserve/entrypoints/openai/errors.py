"""The server's error type and the helpers that build its messages from client input (shared
by every route module, so it sits below them all)."""

from __future__ import annotations

from typing import Any

import pydantic_core
from starlette.responses import JSONResponse

from kvserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

#: Deepest JSON nesting accepted, in the body and in JSON given as text inside a field (the
#: fixed recursion limit of pydantic-core's parser, which reads both).
MAX_JSON_DEPTH = 200
#: Longest piece of a client's value quoted back in an error message (characters).
MAX_QUOTED_CHARS = 128
#: ``error.type`` by status, as vLLM's server names them (the ``openai`` client's exception
#: classes), so a client written against vLLM reads the same type; other statuses keep the
#: OpenAI API's ``invalid_request_error``.
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError"}


def error_type(status: int) -> str:
    """The default ``error.type`` of an error answered with HTTP ``status`` (``ERROR_TYPES``)."""
    return ERROR_TYPES.get(status, "invalid_request_error")


class APIError(Exception):
    """An error answered in the OpenAI shape ``{"error": {message, type, param, code}}``;
    ``type`` left out: ``error_type(status)``."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type or error_type(status)
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        """The JSON body."""
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()

    def to_response(self) -> JSONResponse:
        """A ``JSONResponse`` with the status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def quoted(value: Any, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters (``...`` and the full length appended), so an
    error message never echoes a client's megabytes back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def parse_json_text(text: str, param: str, what: str | None = None) -> Any:
    """A field's JSON given as text (a schema in ``guided_json``, a tool call's ``arguments``),
    parsed with the body's parser (pydantic-core) and so with the body's depth limit.

    Raises:
        APIError: 400 naming ``param`` (``what``: the path in the message) when the text is
            nested deeper than ``MAX_JSON_DEPTH``.
        ValueError: the text is not JSON (the caller decides whether that is an error).
    """
    try:
        return pydantic_core.from_json(text)
    except ValueError as e:
        if "recursion limit exceeded" in str(e):
            raise APIError(
                f"Invalid value for '{what or param}': JSON nested more than {MAX_JSON_DEPTH} levels deep.",
                400,
                param=param,
                code="invalid_value",
            ) from None
        raise
