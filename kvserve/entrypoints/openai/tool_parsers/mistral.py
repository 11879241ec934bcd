"""Mistral tool calls (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small / Large with the v3
tokenizer):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

Text before ``[TOOL_CALLS]`` is content; the JSON list after it holds the calls (a single
object is read as a list of one). ``[TOOL_CALLS]`` is a control token: with this parser the
server keeps special tokens in the text of ``tool_choice: "auto"`` answers unless the request
sets ``skip_special_tokens``. A block that is not a list of calls is given back as content, as
written. Call ids are 9 letters and digits, the only ids Mistral's chat templates accept.
"""

from __future__ import annotations

import secrets
import string

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.json_call import call_in_object, partial_prefix_len
from kvserve.entrypoints.openai.tool_parsers.partial_json import array_items, skip_ws, value_end

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects -> tool calls.

    While streaming, a partial ``[TOOL_CALLS]`` and trailing whitespace are held back, and an
    item shows nothing until its name is complete; then its ``arguments`` text streams.
    """

    name = "mistral"
    keeps_special_tokens = True

    def call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        k = text.find(TOOL_CALLS)
        if k < 0:
            if final:
                return ParsedOutput(text, [])
            held = text[: len(text) - partial_prefix_len(text, TOOL_CALLS)]
            return ParsedOutput(held.rstrip(), [])
        parts = [text[:k]]
        calls: list[ToolCallSnapshot] = []
        b = skip_ws(text, k + len(TOOL_CALLS))
        if b >= len(text):
            if final:
                parts.append(text[k:])
        elif text[b] not in "[{":
            parts.append(text[k:])
        else:
            if text[b] == "[":
                items, block_end = array_items(text, b)
            else:
                block_end = value_end(text, b)
                items = [(b, block_end)]
            for s, e in items:
                call, _ = call_in_object(text, s) if text[s] == "{" else (None, None)
                if call is None:
                    if e is None and not final:
                        break  # an item whose name is not written yet
                    parts.append(text[s:] if calls else text[k:])
                    block_end = None
                    break
                calls.append(call)
                if e is None:
                    break
            else:
                if block_end is None and final and not calls:
                    parts.append(text[k:])  # an open list without a single call
            if block_end is not None:
                parts.append(text[block_end:])
        joined = "".join(parts)
        return ParsedOutput(joined.rstrip() if calls or not final else joined, calls)
