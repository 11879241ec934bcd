"""Llama 3.x JSON tool calls (Llama 3.1 / 3.2 / 3.3 with their JSON tool-calling prompt):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The output *is* the call: a JSON object with ``name`` and ``parameters`` (or ``arguments``),
optionally after ``<|python_tag|>`` (kept only when special tokens are detokenized); several
calls are separated by ``;``. An output that does not start with ``{`` is plain content; an
object that turns out not to be a call (no string ``name``), and any text after the calls, is
given back as content, as written.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.json_call import call_in_object
from kvserve.entrypoints.openai.tool_parsers.partial_json import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` (``;``-separated) -> tool calls.

    While streaming, leading whitespace and a partial ``<|python_tag|>`` are held back, and an
    object shows nothing until its name is complete; then its ``parameters`` text streams.
    """

    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParsedOutput()  # whitespace or a partial tag: undecided
        if i >= len(text) or text[i] != "{":
            if not final and i >= len(text):
                return ParsedOutput()
            return ParsedOutput(text, [])
        calls: list[ToolCallSnapshot] = []
        rest = ""  # text after the calls, given back as content
        p = i
        while True:
            call, end = call_in_object(text, p)
            if call is None:
                if end is None and not final:
                    break  # an object whose name is not written yet
                rest = text[p:] if calls else text
                break
            calls.append(call)
            if end is None:
                break
            q = skip_ws(text, end)
            if q < len(text) and text[q] == ";":
                q = skip_ws(text, q + 1)
            if q >= len(text):
                break
            if text[q] != "{":
                rest = text[q:]
                break
            p = q
        return ParsedOutput(rest.rstrip() if calls or not final else rest, calls)
