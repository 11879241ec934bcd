"""Reasoning parsers: split a reasoning model's output into ``reasoning_content`` and the answer,
chosen with ``kvserve serve --reasoning-parser NAME`` (off by default).

To add a format: a module here with a ``ReasoningParser`` subclass (``parse(text, final)``
returns the reasoning and content found so far; see ``base``), registered below.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser, ReasoningSnapshot
from kvserve.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

_REGISTRY: dict[str, type[ReasoningParser]] = {}


def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Make ``cls`` available as ``get_reasoning_parser(cls.name)``."""
    _REGISTRY[cls.name] = cls
    return cls


def reasoning_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_REGISTRY)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}."
        ) from None


register(DeepSeekR1ReasoningParser)
register(Qwen3ReasoningParser)

__all__ = [
    "ReasoningParser",
    "ReasoningSnapshot",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register",
]
