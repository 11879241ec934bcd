"""What a tool parser returns, and the interface every parser implements.

A parser reads the *whole* text generated so far and returns a snapshot: the content safe to
show and the tool calls found. Snapshots only grow as the text grows (content and each call's
``arguments`` are extended, never rewritten; calls are only added), so a stream is the
difference between consecutive snapshots and a non-streamed answer is the final snapshot:
both always agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCallSnapshot:
    """One tool call found so far: its function name (known before it is reported), the raw
    JSON text of its arguments written so far, and whether that text is complete."""

    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """A snapshot of one choice's output: ``content`` (text outside tool calls, with any
    suffix that may still turn out to be a tool call held back) and the tool calls so far."""

    content: str = ""
    tool_calls: list[ToolCallSnapshot] = field(default_factory=list)


class ToolParser:
    """Turns generated text into content and tool calls (one instance per request).

    ``parse(text, final)`` is called with the whole text so far; ``final`` is True once the
    output has finished (then nothing is held back any more). Subclasses registered with
    ``tool_parsers.register`` read one model family's tool-call format.
    """

    #: the ``--tool-call-parser`` name of the format
    name = "?"
    #: whether the format's markers are special tokens that must stay in the detokenized text
    keeps_special_tokens = False

    def call_id(self) -> str:
        """A fresh id for a call found (OpenAI's shape: ``call_`` and 24 hex digits)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The snapshot of ``text`` (see the class docstring)."""
        raise NotImplementedError
