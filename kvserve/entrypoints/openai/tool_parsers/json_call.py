"""A tool call written as a JSON object ``{"name": ..., "arguments": {...}}`` (Hermes, Llama 3
JSON, Mistral): read while it is still being written.

``arguments`` may also be spelled ``parameters``, or be a JSON string holding the object; it is
reported as the raw JSON text the model wrote, so it can stream as it grows.
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.tool_parsers.base import ToolCallSnapshot
from kvserve.entrypoints.openai.tool_parsers.partial_json import object_members


def partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text that
    may become the tag as more is generated)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_in_object(body: str, j: int) -> tuple[ToolCallSnapshot | None, int | None]:
    """The call in the JSON object at ``body[j]`` (None until its name is known, or when the
    name is not a non-empty string) and the end of the object (None while open)."""
    members, end = object_members(body, j)
    by_key = {m.key: m for m in members}
    name_m = by_key.get("name")
    if name_m is None or name_m.end is None:
        return None, end
    try:
        name = json.loads(body[name_m.start : name_m.end])
    except ValueError:
        return None, end
    if not isinstance(name, str) or not name:
        return None, end
    args_m = by_key.get("arguments") or by_key.get("parameters")
    if args_m is None:
        # no arguments written (yet): an object that is closed has none
        return ToolCallSnapshot(name, "{}" if end is not None else "", end is not None), end
    first = body[args_m.start]
    if first in "{[":
        stop = args_m.end if args_m.end is not None else len(body)
        return ToolCallSnapshot(name, body[args_m.start : stop], args_m.end is not None), end
    if args_m.end is None:  # a string (or literal) is reported once whole
        return ToolCallSnapshot(name, "", False), end
    raw = body[args_m.start : args_m.end]
    try:
        value = json.loads(raw)
    except ValueError:
        return ToolCallSnapshot(name, raw, True), end
    return ToolCallSnapshot(name, value if isinstance(value, str) else raw, True), end
