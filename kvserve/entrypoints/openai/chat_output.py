"""One chat choice's text read into its message parts: reasoning (``--reasoning-parser``), then
tool calls (``tools.ChoiceToolCalls``) in the content after the reasoning, then the content
left. Whole (a finished output) or as stream deltas; the deltas concatenate to the whole
because both parsers return snapshots that only grow.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import DeltaToolCall, ToolCall
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from kvserve.entrypoints.openai.tools import ChoiceToolCalls


class ChoiceReader:
    """Reads one choice's output: ``reasoning`` (None: no reasoning parser) splits off the
    thinking, ``tools`` (None: no tool calls read) reads calls in what follows it."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ChoiceToolCalls | None):
        self.reasoning = reasoning
        self.tools = tools
        self.reasoning_sent = 0
        self.content_sent = 0
        self.reasoning_text = ""
        self.content = ""

    @property
    def calls(self) -> list:
        """The latest tool-call snapshots (empty without ``tools``)."""
        return self.tools.calls if self.tools is not None else []

    def update(self, text: str, final: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """(reasoning delta, content delta, tool-call deltas) of ``text``, the whole output so
        far; ``final``: the output has finished."""
        if self.reasoning is not None:
            snap = self.reasoning.parse(text, final)
            reasoning, answer = snap.reasoning, snap.content
        else:
            reasoning, answer = "", text
        r_delta = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.reasoning_text = reasoning
        tool_deltas: list[DeltaToolCall] = []
        if self.tools is not None:
            c_delta, tool_deltas = self.tools.update(answer, final)
            self.content = self.tools.content
        else:
            c_delta = answer[self.content_sent :]
            self.content_sent = max(self.content_sent, len(answer))
            self.content = answer
        return r_delta, c_delta, tool_deltas

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall] | None]:
        """(reasoning, content, tool_calls) of a finished output, None where there is none
        (content is None only when reasoning or tool calls stand in its place)."""
        snap = self.reasoning.parse(text, True) if self.reasoning is not None else None
        reasoning = snap.reasoning if snap is not None else ""
        answer = snap.content if snap is not None else text
        calls = None
        if self.tools is not None:
            content, calls = self.tools.whole(answer)
        else:
            content = answer
        if reasoning and not content:
            content = None
        return reasoning or None, content, calls
