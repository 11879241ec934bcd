"""Reasoning in ``<think> ... </think>`` blocks (DeepSeek-R1 and its distills, QwQ, Qwen3).

- ``deepseek_r1``: the output is reasoning until ``</think>``; an opening ``<think>`` is optional
  (R1's template writes it into the prompt). An output that never closes the block is all
  reasoning.
- ``qwen3``: the output has reasoning only when it opens with ``<think>`` (Qwen3 writes the tag
  itself; with ``enable_thinking: false`` the template closes an empty block in the prompt and
  the output is plain content).

Both read the rendered prompt first: when it ends inside an open block (``<think>`` and only
whitespace after it) the output starts in the reasoning; when it ends right after ``</think>``
the output is all content. Reasoning is given without surrounding whitespace, content without
the whitespace that follows ``</think>``.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser, ReasoningSnapshot

START = "<think>"
END = "</think>"


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text that
    may become the tag as more is generated)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_state(prompt: str) -> str | None:
    """``"open"`` when ``prompt`` ends inside a think block, ``"closed"`` when it ends right
    after one (trailing whitespace aside), else None."""
    tail = prompt.rstrip()
    if tail.endswith(END):
        return "closed"
    if tail.endswith(START):
        return "open"
    return None


class ThinkReasoningParser(ReasoningParser):
    """``<think>`` blocks; ``implicit_start``: whether output without an opening tag starts in
    the reasoning (``deepseek_r1``) or is plain content (``qwen3``)."""

    implicit_start = True

    def __init__(self, prompt: str = ""):
        super().__init__(prompt)
        self.state = prompt_state(prompt)

    def output_is_content(self) -> bool:
        return self.state == "closed"

    def parse(self, text: str, final: bool) -> ReasoningSnapshot:
        if self.state == "closed":
            return ReasoningSnapshot("", text)
        i = len(text) - len(text.lstrip())
        head = text[i:]
        if head.startswith(START):
            start = i + len(START)
        elif not final and START.startswith(head):
            return ReasoningSnapshot()  # whitespace or a partial opening tag: undecided
        elif self.implicit_start or self.state == "open":
            start = 0
        else:
            return ReasoningSnapshot("", text)
        e = text.find(END, start)
        if e < 0:
            body = text[start:]
            if not final:
                body = body[: len(body) - partial_suffix_len(body, END)]
            return ReasoningSnapshot(body.strip(), "")
        return ReasoningSnapshot(text[start:e].strip(), text[e + len(END) :].lstrip())


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 style: reasoning until ``</think>``, opening tag optional."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 style: reasoning only inside a ``<think>`` block that opens the output (or that the
    prompt opened)."""

    name = "qwen3"
    implicit_start = False
