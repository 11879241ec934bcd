"""Pythonic tool calls (Llama 3.2 / 4 and other models prompted to call tools as Python):

    [get_weather(city="Paris", days=3), get_time(tz="CET")]

The output is a Python list of calls with keyword arguments only, optionally between
``<|python_start|>`` and ``<|python_end|>`` (Llama 4). It is parsed with Python's ``ast``, never
evaluated: every argument must be a literal (strings, numbers, ``True`` / ``False`` / ``None``
and JSON's ``true`` / ``false`` / ``null``, lists, tuples, dicts with string keys), turned into
JSON. The calls are reported once the list is closed (the arguments come in one piece each);
text after the list is content. An output that does not start with ``[``, or a list that is not
all such calls, is plain content, as written.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from kvserve.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallSnapshot, ToolParser
from kvserve.entrypoints.openai.tool_parsers.partial_json import skip_ws

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_NAMED = {"true": True, "false": False, "null": None}


class _NotACall(Exception):
    """The list parses as Python but is not a list of literal-argument calls."""


def _literal(node: ast.AST) -> Any:
    """The JSON value of a literal expression node.

    Raises:
        _NotACall: anything else (names, calls, operators, bytes, non-finite numbers, ...).
    """
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)) and math.isfinite(v):
            return v
        raise _NotACall(f"unsupported constant {v!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _NotACall("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, item in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotACall("dict keys must be strings")
            out[key] = _literal(item)
        return out
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    raise _NotACall(f"not a literal: {type(node).__name__}")


def parse_call_list(source: str) -> list[ToolCallSnapshot]:
    """The calls of ``source``, a Python list of ``name(key=literal, ...)`` calls.

    Raises:
        SyntaxError: ``source`` is not a (complete) Python expression.
        _NotACall: it is one, but not a list of such calls.
    """
    tree = ast.parse(source, mode="eval").body
    if not isinstance(tree, ast.List):
        raise _NotACall("not a list")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise _NotACall("not a call with keyword arguments")
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise _NotACall("**kwargs")
            args[kw.arg] = _literal(kw.value)
        calls.append(ToolCallSnapshot(node.func.id, json.dumps(args, ensure_ascii=False), True))
    if not calls:
        raise _NotACall("an empty list")
    return calls


class PythonicToolParser(ToolParser):
    """``[f(a=1), g(b="x")]`` -> tool calls (see the module docstring).

    While streaming, an output that starts with ``[`` is held back until the list closes
    (the first ``]`` after which the text parses as a whole list); it is then calls, or content
    if it is not all literal-argument calls.
    """

    name = "pythonic"

    def __init__(self) -> None:
        # where the search for the list's closing ``]`` resumes: the text only grows, so a
        # prefix that did not parse never will
        self._tried = 0

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_START, i):
            i = skip_ws(text, i + len(PYTHON_START))
        elif not final and PYTHON_START.startswith(text[i:]):
            return ParsedOutput()  # whitespace or a partial tag: undecided
        if i >= len(text) or text[i] != "[":
            if not final and i >= len(text):
                return ParsedOutput()
            return ParsedOutput(text, [])
        j = max(self._tried, i + 1)
        while True:
            close = text.find("]", j)
            if close < 0:
                break
            j = close + 1
            try:
                calls = parse_call_list(text[i:j])
            except _NotACall:
                return ParsedOutput(text, [])
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                if not final:
                    self._tried = j
                continue
            rest = text[skip_ws(text, j) :]
            if rest.startswith(PYTHON_END):
                rest = rest[len(PYTHON_END) :]
            elif not final and PYTHON_END.startswith(rest):
                rest = ""  # a partial end tag: undecided
            return ParsedOutput(rest.strip(), calls)
        return ParsedOutput(text if final else "", [])
