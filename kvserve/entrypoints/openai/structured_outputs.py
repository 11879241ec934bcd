"""Request fields that constrain the output -> one ``StructuredOutputsParams``.

Accepted (one per request): OpenAI's ``response_format`` (``json_object``; ``json_schema``,
whose ``strict`` is always honoured: the output is constrained to the schema either way),
vLLM's ``structured_outputs`` object and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields (``guided_whitespace_pattern`` applies to the JSON
kinds). Each constraint remembers the field it came from, so a schema that does not compile is a
400 naming that field.

A field that the constraint would not read is a 400 naming it, never silently dropped:
``guided_whitespace_pattern`` without a JSON constraint (or next to
``structured_outputs.whitespace_pattern``), ``structured_outputs.whitespace_pattern`` /
``disable_any_whitespace`` with a kind other than ``json`` / ``json_object`` (or both at once),
and ``response_format.json_schema`` with a type other than ``json_schema``.
"""

from __future__ import annotations

import json

from kvserve.entrypoints.openai.errors import APIError, parse_json_text
from kvserve.sampling_params import StructuredOutputsParams


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param, code="invalid_value")


def structured_outputs_from_request(req) -> StructuredOutputsParams | None:
    """The constraint a completions or chat request asks for, or None.

    Raises:
        APIError: 400 naming the field when more than one constraint field is set, a
            ``json_schema`` format has no schema, or a constraint is malformed.
    """
    sources: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise _bad(
            f"response_format.json_schema is only read when response_format.type is 'json_schema', "
            f"got type {rf.type!r}.",
            "response_format",
        )
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise _bad(
                    "response_format.json_schema.schema is required when response_format.type is "
                    "'json_schema'.",
                    "response_format",
                )
            sources.append(("response_format", {"json": rf.json_schema.json_schema}))
    so = req.structured_outputs
    if so is not None:
        kw = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
            "structural_tag": json.dumps(so.structural_tag)
            if isinstance(so.structural_tag, dict)
            else so.structural_tag,
            "disable_any_whitespace": bool(so.disable_any_whitespace),
            "whitespace_pattern": so.whitespace_pattern,
        }
        kind = next(
            (k for k in ("json", "regex", "choice", "grammar", "structural_tag") if kw[k] is not None), None
        )
        sources.append((f"structured_outputs.{kind}" if kind else "structured_outputs", kw))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name, None)
        if value is not None:
            sources.append((name, {key: value}))
    wsp = req.guided_whitespace_pattern
    if not sources:
        if wsp is not None:
            raise _bad(
                "guided_whitespace_pattern applies to a JSON constraint (guided_json, response_format "
                "json_object / json_schema); none is set.",
                "guided_whitespace_pattern",
            )
        return None
    if len(sources) > 1:
        names = [n for n, _ in sources]
        raise _bad(f"only one output constraint may be set per request, got {', '.join(names)}.", names[1])
    origin, kw = sources[0]
    param = origin.split(".")[0] if origin.startswith("structured_outputs") else origin
    for key in ("json", "structural_tag"):
        if isinstance(kw.get(key), str):
            # JSON given as text gets the body's depth limit (deeper text made the compiler's
            # parser raise RecursionError); whether it is JSON at all is the compiler's to say
            try:
                parse_json_text(kw[key], param, origin)
            except ValueError:
                pass
    json_kind = kw.get("json") is not None or bool(kw.get("json_object"))
    if origin.startswith("structured_outputs"):
        for opt in ("whitespace_pattern", "disable_any_whitespace"):
            if kw.get(opt) and not json_kind:
                raise _bad(
                    f"structured_outputs.{opt} applies to the JSON kinds (json, json_object) only, "
                    f"not to {origin}.",
                    "structured_outputs",
                )
        if kw.get("whitespace_pattern") is not None and kw.get("disable_any_whitespace"):
            raise _bad(
                "structured_outputs.whitespace_pattern cannot be combined with "
                "structured_outputs.disable_any_whitespace=true (which allows no whitespace).",
                "structured_outputs",
            )
    if wsp is not None:
        if not json_kind:
            raise _bad(
                f"guided_whitespace_pattern applies to a JSON constraint only, not to {origin}.",
                "guided_whitespace_pattern",
            )
        if kw.get("whitespace_pattern") is not None or kw.get("disable_any_whitespace"):
            raise _bad(
                "guided_whitespace_pattern cannot be combined with structured_outputs' own "
                "whitespace_pattern / disable_any_whitespace.",
                "guided_whitespace_pattern",
            )
        kw["whitespace_pattern"] = wsp
    try:
        return StructuredOutputsParams(**kw, origin=origin)
    except ValueError as e:
        raise _bad(str(e), param) from None
