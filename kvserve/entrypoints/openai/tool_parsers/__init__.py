"""Tool-call parsers: one module per model family's format, chosen with
``kvserve serve --tool-call-parser NAME`` (default ``hermes``) for ``tool_choice: "auto"``.

To add a format: a module here with a ``ToolParser`` subclass (``parse(text, final)`` returns
the content and the calls found so far; see ``base``), registered below.
"""

from __future__ import annotations

from kvserve.entrypoints.openai.parser_registry import ParserRegistry
from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kvserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from kvserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

_REGISTRY: ParserRegistry[ToolParser] = ParserRegistry("tool-call parser")

DEFAULT_TOOL_PARSER = "hermes"

#: Make a class available by its ``name``.
register = _REGISTRY.register
#: The registered format names, sorted.
tool_parser_names = _REGISTRY.names
#: The parser class of a format name (ValueError listing the known names if unknown).
get_tool_parser = _REGISTRY.get


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
