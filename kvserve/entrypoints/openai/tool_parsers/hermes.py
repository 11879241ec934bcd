"""Hermes-style tool calls (Hermes 2/3, Qwen2/2.5, and the many models trained on the format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each block is one call; text outside the blocks is the message content. ``arguments`` may also
be spelled ``parameters``, or be a JSON string holding the object. A block whose name never
appears (malformed JSON) is given back as content, as written.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.json_call import call_in_object, partial_prefix_len
from kvserve.entrypoints.openai.tool_parsers.partial_json import skip_ws

START = "<tool_call>"
END = "</tool_call>"


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
                    tail = tail[: len(tail) - partial_prefix_len(tail, START)]
                content.append(tail)
                break
            content.append(text[pos:k])
            body_start = k + len(START)
            body = text[body_start:]
            j = skip_ws(body, 0)
            if j < len(body) and body[j] == "{":
                call, obj_end = call_in_object(body, j)
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
