"""Reasoning parsers: split a reasoning model's output into ``reasoning_content`` and the answer,
chosen with ``kvserve serve --reasoning-parser NAME`` (off by default).

To add a format: a module here with a ``ReasoningParser`` subclass (``parse(text, final)``
returns the reasoning and content found so far; see ``base``), registered below.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.parser_registry import ParserRegistry
from kvserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser, ReasoningSnapshot
from kvserve.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

_REGISTRY: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning parser")

#: Make a class available by its ``name``.
register = _REGISTRY.register
#: The registered parser names, sorted.
reasoning_parser_names = _REGISTRY.names
#: The parser class called a name (ValueError listing the known names if unknown).
get_reasoning_parser = _REGISTRY.get


register(DeepSeekR1ReasoningParser)
register(Qwen3ReasoningParser)

__all__ = [
    "ReasoningParser",
    "ReasoningSnapshot",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register",
]
