"""Parsers of output constrained by ``tool_choice`` (``required`` or a named function).

The constraint (``tools.forced_tool_constraint``) makes the output one of:

- named function: the arguments object itself;
- ``required``: ``[{"name": ..., "parameters": {...}}, ...]``, one or more calls.

so these parsers never see anything else (except an output cut short by ``max_tokens``).
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.partial_json import (
    array_items,
    object_members,
    skip_ws,
    value_end,
)


class NamedFunctionParser(ToolParser):
    """The whole output is the arguments of the function ``function_name``."""

    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        j = skip_ws(text, 0)
        end = value_end(text, j) if j < len(text) else None
        args = text[j:end] if end is not None else text[j:].rstrip() if final else text[j:]
        return ParsedOutput("", [ToolCallSnapshot(self.function_name, args, end is not None)])


class RequiredToolsParser(ToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects, one per call."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ToolCallSnapshot] = []
        items, _ = array_items(text, skip_ws(text, 0))
        for start, _end in items:
            members, _obj_end = object_members(text, start)
            by_key = {m.key: m for m in members}
            name_m, args_m = by_key.get("name"), by_key.get("parameters")
            if name_m is None or name_m.end is None:
                break
            try:
                name = json.loads(text[name_m.start : name_m.end])
            except ValueError:
                break
            if args_m is None:
                calls.append(ToolCallSnapshot(str(name), "", False))
                break
            stop = args_m.end if args_m.end is not None else len(text)
            calls.append(ToolCallSnapshot(str(name), text[args_m.start : stop], args_m.end is not None))
        return ParsedOutput("", calls)
