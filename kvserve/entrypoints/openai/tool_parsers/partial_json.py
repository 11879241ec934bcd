"""Spans of a JSON text that may still be growing (a model's output mid-generation).

Only the structure is scanned (strings, escapes, brackets); values are never converted, so the
raw text of a value (e.g. a tool call's ``arguments`` object) can be streamed as it grows and
its final text is exactly what the model wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``, or None while it is incomplete.

    A number or literal at the very end of ``text`` is incomplete (more digits may follow).
    Malformed text is not diagnosed: the scan stops at the first place the value could end.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        j = i + 1
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = value_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in _CLOSE:
                stack.append(_CLOSE[ch])
            elif ch in "}]":
                stack.pop()
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


@dataclass
class Member:
    """One ``"key": value`` of an object: the key, where its raw value starts, and where it
    ends (None while it is still being written)."""

    key: str
    start: int
    end: int | None


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the JSON object starting at ``text[i]`` (``{``) written so far, and the
    end (exclusive) of the object, None while it is open. A member appears once its key and the
    first character of its value are there."""
    members: list[Member] = []
    if i >= len(text) or text[i] != "{":
        return members, None
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return members, None  # malformed: stop here
        key_end = value_end(text, j)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return members, None
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return members, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end = value_end(text, j)
        members.append(Member(str(key), j, end))
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None


def array_items(text: str, i: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """The items of the JSON array starting at ``text[i]`` (``[``) written so far, as
    ``(start, end or None)``, and the end of the array (None while it is open)."""
    items: list[tuple[int, int | None]] = []
    if i >= len(text) or text[i] != "[":
        return items, None
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return items, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        end = value_end(text, j)
        items.append((j, end))
        if end is None:
            return items, None
        j = skip_ws(text, end)
    return items, None
