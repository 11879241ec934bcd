"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked and turned into a plan (what the chat template sees, the output
constraint, the parser), and the tool calls of a choice built from its text, whole or streamed.

- ``none``: tools are shown to the template; the output is plain content.
- ``auto`` (the default with tools): the model's text is read by the ``--tool-call-parser``
  format (``tool_parsers``); calls found become ``tool_calls``, the rest stays content.
- ``required`` / a named function: the output is constrained (structured outputs) to a JSON
  array of ``{"name", "parameters"}`` calls (exactly one with ``parallel_tool_calls: false``),
  or to the named function's ``parameters`` schema; so the calls always parse and validate
  against the schemas, whatever the model. The JSON is compact (no whitespace between tokens):
  ``arguments`` read as OpenAI's do, and no model can spend its tokens on blanks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.entrypoints.openai.errors import APIError, parse_json_text
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvserve.entrypoints.openai.tool_parsers import ToolParser
from kvserve.entrypoints.openai.tool_parsers.forced import NamedFunctionParser, RequiredToolsParser
from kvserve.sampling_params import StructuredOutputsParams

#: OpenAI's rule for function names
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: the schema of a function declared without ``parameters``: no arguments
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param, code="invalid_value")


@dataclass
class ToolPlan:
    """How one chat request uses tools.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        template_tools: the ``tools`` passed to the chat template (None: no tools).
        constraint: the output constraint of ``required`` / ``named`` (None otherwise).
        schema_check: a constraint over every tool's schema, compiled only to check them
            (a schema that does not compile is a 400 naming ``tools``).
        make_parser: a new parser per choice (None: no tool calls are read).
        max_calls: the most calls returned per choice (1 with ``parallel_tool_calls: false``).
    """

    mode: str
    template_tools: list[dict] | None = None
    constraint: StructuredOutputsParams | None = None
    schema_check: StructuredOutputsParams | None = None
    make_parser: Callable[[], ToolParser] | None = None
    max_calls: int = 1 << 30


def _parameters(fn) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else _NO_PARAMETERS


_DEFS_KEYS = ("$defs", "definitions")


def _pointer_segment(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~")


def _map_refs(value: Any, rewrite: Callable[[str], str]) -> Any:
    """A copy of ``value`` with every string ``$ref`` passed through ``rewrite`` (the depth is
    bounded by the request body's nesting limit)."""
    if isinstance(value, dict):
        return {
            k: rewrite(v) if k == "$ref" and isinstance(v, str) else _map_refs(v, rewrite)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_map_refs(v, rewrite) for v in value]
    return value


def _has_local_ref(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _embedded(name: str, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (tool ``name``'s parameters) made to work nested inside another schema: its
    root ``$defs`` / ``definitions`` move into ``defs`` (the wrapper's root ``$defs``) as
    ``<name>.<n>``, and a reference to anything else of the tool (``#``, ``#/properties/...``)
    goes to the tool's root, itself kept in ``defs`` as ``<name>``. Tool names hold no ``.``,
    so no two tools' definitions can clash. A schema without local references is returned as
    is."""
    if not _has_local_ref(schema):
        return schema
    renamed: dict[tuple[str, str], str] = {}
    for key in _DEFS_KEYS:
        table = schema.get(key)
        if isinstance(table, dict):
            for def_name in table:
                renamed[(key, def_name)] = f"{name}.{len(renamed)}"
    used_root = False

    def rewrite(ref: str) -> str:
        nonlocal used_root
        if not ref.startswith("#"):
            return ref
        parts = ref[1:].split("/")
        if len(parts) >= 3 and parts[0] == "" and parts[1] in _DEFS_KEYS:
            new = renamed.get((parts[1], _pointer_segment(parts[2])))
            if new is not None:
                return "/".join(["#", "$defs", new, *parts[3:]])
        used_root = True
        return f"#/$defs/{name}{ref[1:]}"

    body = _map_refs(
        {k: v for k, v in schema.items() if not (k in _DEFS_KEYS and isinstance(v, dict))}, rewrite
    )
    for (key, def_name), new in renamed.items():
        defs[new] = _map_refs(schema[key][def_name], rewrite)
    if not used_root:
        return body
    defs[name] = body
    return {"$ref": f"#/$defs/{name}"}


def required_schema(tools: list, parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: an array of one or more (exactly one
    unless ``parallel``) ``{"name": <a tool's name>, "parameters": <that tool's schema>}``.
    Each tool's ``$defs`` / ``definitions`` move to the root ``$defs`` (``_embedded``), so its
    ``$ref`` s still resolve inside the wrapper."""
    defs: dict[str, Any] = {}
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": _embedded(t.function.name, _parameters(t.function), defs),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def plan_tools(req: ChatCompletionRequest, parser_cls: type[ToolParser]) -> ToolPlan:
    """Check the request's tool fields and plan its tool use (``parser_cls``: the server's
    ``--tool-call-parser`` for ``auto``).

    Raises:
        APIError: 400 naming ``tools`` (a bad or repeated name, parameters that are not an
            object schema), ``tool_choice`` (``required`` / a function without tools, an
            unknown function) or ``parallel_tool_calls`` (set without tools).
    """
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice other than 'none' requires tools.", "tool_choice")
        if req.parallel_tool_calls is not None:
            raise _bad("parallel_tool_calls is only allowed when tools are given.", "parallel_tool_calls")
        return ToolPlan("none")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not _NAME_RE.fullmatch(name):
            raise _bad(
                f"tools[{i}].function.name must be 1 to 64 characters of a-z, A-Z, 0-9, '_' or '-', "
                f"got {name!r}.",
                "tools",
            )
        if name in seen:
            raise _bad(f"tools[{i}].function.name {name!r} is repeated; tool names must be unique.", "tools")
        seen.add(name)
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise _bad(
                f"tools[{i}].function.parameters must be a JSON schema of an object, got type "
                f"{params.get('type')!r}.",
                "tools",
            )
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    check = StructuredOutputsParams(json=required_schema(tools, True), origin="tools")
    max_calls = (1 << 30) if parallel else 1
    if choice is None or choice == "auto":
        return ToolPlan("auto", template_tools, None, check, parser_cls, max_calls)
    if choice == "none":
        return ToolPlan("none", template_tools, None, check)
    if choice == "required":
        constraint = StructuredOutputsParams(
            json=required_schema(tools, parallel), disable_any_whitespace=True, origin="tools"
        )
        return ToolPlan("required", template_tools, constraint, check, RequiredToolsParser, max_calls)
    wanted = choice.function.name
    fn = next((t.function for t in tools if t.function.name == wanted), None)
    if fn is None:
        raise _bad(
            f"tool_choice names the function {wanted!r}, which is not in tools ({', '.join(sorted(seen))}).",
            "tool_choice",
        )
    constraint = StructuredOutputsParams(json=_parameters(fn), disable_any_whitespace=True, origin="tools")
    return ToolPlan("named", template_tools, constraint, check, lambda: NamedFunctionParser(wanted), 1)


def template_message(m, index: int = 0) -> dict[str, Any]:
    """The chat template's view of message ``index``'s tool fields: ``tool_calls`` with
    ``arguments`` decoded from JSON (templates write them with ``tojson``; text that is not JSON
    stays text), ``tool_call_id``, ``name``.

    Raises:
        APIError: 400 naming ``messages`` when an ``arguments`` text is JSON nested deeper than
            the body may be (``serving_engine.MAX_JSON_DEPTH``).
    """
    out: dict[str, Any] = {}
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args: Any = parse_json_text(
                    c.function.arguments, "messages", f"messages[{index}].tool_calls[{j}].function.arguments"
                )
            except ValueError:
                args = c.function.arguments
            calls.append(
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
            )
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def finish_reason(engine_reason: str | None, calls: list) -> str | None:
    """``tool_calls`` when the output stopped normally with every call complete, else the
    engine's reason (``length``: a call may be cut short)."""
    if engine_reason == "stop" and calls and all(c.complete for c in calls):
        return "tool_calls"
    return engine_reason


class ChoiceToolCalls:
    """The tool calls of one choice, from its text: whole (``final``) or as stream deltas.

    ``update(text, final)`` returns the content and tool-call deltas since the last call, in
    OpenAI's stream format: a call's first delta has its ``index``, ``id``, ``type`` and
    ``function.name``; then ``function.arguments`` pieces follow.
    """

    def __init__(self, parser: ToolParser, max_calls: int):
        self.parser = parser
        self.max_calls = max_calls
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self.calls: list = []  # the latest snapshots
        self.content = ""

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) of ``text`` (the whole output so far)."""
        snap = self.parser.parse(text, final)
        self.calls = snap.tool_calls[: self.max_calls]
        self.content = snap.content
        content = snap.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(snap.content))
        deltas: list[DeltaToolCall] = []
        for i, c in enumerate(self.calls):
            new_args = c.arguments[self.args_sent[i] :] if i < len(self.ids) else c.arguments
            if i >= len(self.ids):
                self.ids.append(self.parser.call_id())
                self.args_sent.append(len(c.arguments))
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=self.ids[i],
                        type="function",
                        function=DeltaFunctionCall(name=c.name, arguments=new_args),
                    )
                )
            elif new_args:
                self.args_sent[i] = len(c.arguments)
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new_args)))
        return content, deltas

    def whole(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """(content or None, tool_calls or None) of a finished output."""
        self.update(text, True)
        snap_content = self.content
        calls = [
            ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in zip(self.ids, self.calls)
        ]
        if not calls:
            return snap_content, None
        return (snap_content or None), calls
