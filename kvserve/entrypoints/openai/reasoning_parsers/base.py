"""What a reasoning parser returns, and the interface every parser implements.

A parser reads the *whole* text generated so far and returns a snapshot: the reasoning and the
answer (content) found so far. Snapshots only grow as the text grows (each of ``reasoning`` and
``content`` is extended, never rewritten), so a stream is the difference between consecutive
snapshots and a non-streamed answer is the final snapshot: both always agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningSnapshot:
    """One choice's output split in two: ``reasoning`` (the model's thinking, tags removed) and
    ``content`` (the answer after it: what tool-call parsing reads). Text that may still turn
    out to be a tag is held back from both until it is decided."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits generated text into reasoning and content (one instance per choice).

    ``prompt`` is the rendered chat prompt the output continues: a template may open the
    reasoning block itself (the output then starts inside it) or close it already (thinking
    disabled: the output is all content). ``parse(text, final)`` is called with the whole text
    so far; ``final`` is True once the output has finished (nothing is held back any more).
    """

    #: the ``--reasoning-parser`` name
    name = "?"

    def __init__(self, prompt: str = ""):
        self.prompt = prompt

    def parse(self, text: str, final: bool) -> ReasoningSnapshot:
        """The snapshot of ``text`` (see the class docstring)."""
        raise NotImplementedError

    def output_is_content(self) -> bool:
        """Whether the prompt already ended the reasoning, so every generated token is content
        (an output constraint may then apply from the first token)."""
        return False
