"""Hermes-style tool calls (Hermes 2/3, Qwen2/2.5, and the many models trained on the format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each block is one call; text outside the blocks is the message content. ``arguments`` may also
be spelled ``parameters``, or be a JSON string holding the object. A block whose name never
appears (malformed JSON) is given back as content, as written.
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.partial_json import object_members, skip_ws

START = "<tool_call>"
END = "</tool_call>"


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_of(body: str, j: int) -> tuple[ToolCallSnapshot | None, int | None]:
    """The call in the JSON object at ``body[j]`` (None until its name is known) and the end of
    the object (None while open)."""
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


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks -> tool calls.

    While streaming, a suffix that may be the start of ``<tool_call>`` and trailing whitespace
    are held back, and an open block shows nothing until its function name is complete; then
    its ``arguments`` text streams as it is written.
    """

    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ToolCallSnapshot] = []
        pos = 0
        while True:
            k = text.find(START, pos)
            if k < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - _partial_prefix_len(tail, START)]
                content.append(tail)
                break
            content.append(text[pos:k])
            body_start = k + len(START)
            body = text[body_start:]
            j = skip_ws(body, 0)
            if j < len(body) and body[j] == "{":
                call, obj_end = _call_of(body, j)
            else:
                call, obj_end = None, None
            block_end = None  # index in text just past the block, once it is closed
            if obj_end is not None:
                after = skip_ws(body, obj_end)
                rest = body[after:]
                if rest.startswith(END):
                    block_end = body_start + after + len(END)
                elif final or not END.startswith(rest):
                    block_end = body_start + obj_end  # the closing tag is missing
            elif j < len(body) and body[j] == "{":
                # an open object: an END inside it is inside a string; wait for the object
                if final:
                    block_end = len(text)
            else:
                e = text.find(END, body_start)
                if e >= 0:
                    block_end = e + len(END)
                elif final:
                    block_end = len(text)
            if call is not None:
                calls.append(call)
            elif block_end is not None:
                content.append(text[k:block_end])  # not a call: keep it as written
            if block_end is None:
                break  # the block is still open
            pos = block_end
        joined = "".join(content)
        if calls or not final:
            joined = joined.rstrip()
        return ParsedOutput(joined, calls)
