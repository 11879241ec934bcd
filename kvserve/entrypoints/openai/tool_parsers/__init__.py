"""Tool-call parsers: one module per model family's format, chosen with
``kvserve serve --tool-call-parser NAME`` (default ``hermes``) for ``tool_choice: "auto"``.

To add a format: a module here with a ``ToolParser`` subclass (``parse(text, final)`` returns
the content and the calls found so far; see ``base``), registered below.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from kvserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

_REGISTRY: dict[str, type[ToolParser]] = {}

DEFAULT_TOOL_PARSER = "hermes"


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Make ``cls`` available as ``get_tool_parser(cls.name)``."""
    _REGISTRY[cls.name] = cls
    return cls


def tool_parser_names() -> list[str]:
    """The registered format names, sorted."""
    return sorted(_REGISTRY)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of format ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the known names).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(tool_parser_names())}."
        ) from None


register(HermesToolParser)
register(Llama3JsonToolParser)
register(MistralToolParser)
register(PythonicToolParser)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "ParsedOutput",
    "ToolCallSnapshot",
    "ToolParser",
    "get_tool_parser",
    "register",
    "tool_parser_names",
]
