"""Random constraints for the structured-output property tests.

``JSON_SCHEMAS``: JSON schemas drawn by hypothesis-jsonschema from a *schema of schemas*: a JSON
schema whose instances are themselves JSON schemas, in the subset llguidance supports (booleans,
null, bounded integers and strings, enums, consts, ``anyOf``, objects, arrays; nested to depth
3). Every size is bounded, so a random model always finishes an instance within a few dozen
tokens. Bounds are drawn independently, so some schemas are unsatisfiable (``minimum`` above
``maximum``, ``minLength`` above ``maxLength``, ``minItems`` above ``maxItems``, empty enums):
llguidance refuses those and the engine must say so (a ``ValueError`` naming the field).

``REGEXES``: random bounded regexes over ASCII (literals, classes, groups, alternation, bounded
repetition) in the syntax Rust's ``regex`` and Python's ``re`` read alike.
"""

from __future__ import annotations

import json
import re

from hypothesis import strategies as st
from hypothesis.internal.conjecture import utils as _cu
from hypothesis_jsonschema import from_schema


def _many_more(self) -> bool:
    """hypothesis-jsonschema 0.23 (its latest release) draws object properties with
    ``many.more()``, which Hypothesis replaced by ``with many(...) as e: for _ in e:``: the old
    call on top of the new protocol, so object schemas can be generated at all."""
    if self._depth is None:
        self.__enter__()
        self._compat_iter = iter(self)
    try:
        next(self._compat_iter)
        return True
    except StopIteration:
        self.__exit__(None)
        return False


if not hasattr(_cu.many, "more"):
    _cu.many.more = _many_more

_SCALAR = {
    "anyOf": [
        {"type": "string", "pattern": "^[a-z]{0,3}$"},
        {"type": "integer", "minimum": -99, "maximum": 99},
        {"type": "boolean"},
        {"type": "null"},
    ]
}


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


#: Leaf schemas (their instances: schemas without children).
_LEAF_SCHEMAS = [
    _obj({"type": {"const": "boolean"}}, ["type"]),
    _obj({"type": {"const": "null"}}, ["type"]),
    _obj(
        {
            "type": {"const": "integer"},
            "minimum": {"type": "integer", "minimum": -60, "maximum": 40},
            "maximum": {"type": "integer", "minimum": -40, "maximum": 60},
        },
        ["type", "minimum", "maximum"],  # an unbounded integer could run to max_tokens
    ),
    _obj(
        {
            "type": {"const": "string"},
            "minLength": {"type": "integer", "minimum": 0, "maximum": 3},
            "maxLength": {"type": "integer", "minimum": 0, "maximum": 6},
        },
        ["type", "maxLength"],
    ),
    _obj(
        {"enum": {"type": "array", "items": _SCALAR, "minItems": 0, "maxItems": 3, "uniqueItems": True}},
        ["enum"],
    ),
    _obj({"const": _SCALAR}, ["const"]),
]


def _level(children: dict) -> dict:
    """Schemas whose children are instances of ``children``."""
    return {
        "anyOf": [
            _obj(
                {
                    "type": {"const": "object"},
                    "properties": {
                        "type": "object",
                        "propertyNames": {"pattern": "^[a-z][a-z_]{0,3}$"},
                        "additionalProperties": children,
                        "minProperties": 1,
                        "maxProperties": 3,
                    },
                },
                ["type", "properties"],
            ),
            _obj(
                {
                    "type": {"const": "array"},
                    "items": children,
                    "minItems": {"type": "integer", "minimum": 0, "maximum": 2},
                    "maxItems": {"type": "integer", "minimum": 0, "maximum": 3},
                },
                ["type", "items", "maxItems"],
            ),
            _obj({"anyOf": {"type": "array", "items": children, "minItems": 1, "maxItems": 2}}, ["anyOf"]),
        ]
    }


_LEAF = {"anyOf": _LEAF_SCHEMAS}
_DEPTH2 = {"anyOf": [_LEAF, _level(_LEAF)]}
SCHEMA_OF_SCHEMAS = {"anyOf": [_LEAF, _level(_LEAF), _level(_DEPTH2)]}


def _close_objects(schema):
    """Every object schema requires all of its properties and no others (llguidance would let a
    random model add free-form properties without end otherwise)."""
    if isinstance(schema, dict):
        out = {k: _close_objects(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out["required"] = sorted(out["properties"])
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    return schema


#: (The values of ``const`` / ``enum`` are scalars, never dicts: ``_close_objects`` leaves them.)
JSON_SCHEMAS = from_schema(SCHEMA_OF_SCHEMAS).map(_close_objects)


def satisfiable(schema) -> bool:
    """False when some bound pair is inverted or an enum is empty somewhere *required* (every
    branch of an ``anyOf`` unsatisfiable, an unsatisfiable property, array items needed)."""
    if not isinstance(schema, dict):
        return True
    if "enum" in schema:
        return bool(schema["enum"])
    if "anyOf" in schema:
        return any(satisfiable(s) for s in schema["anyOf"])
    t = schema.get("type")
    if t == "integer":
        return schema.get("minimum", -(10**9)) <= schema.get("maximum", 10**9)
    if t == "string":
        return schema.get("minLength", 0) <= schema.get("maxLength", 10**9)
    if t == "object":
        return all(satisfiable(s) for s in schema["properties"].values())
    if t == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 10**9)
        return lo <= hi and (lo == 0 or satisfiable(schema["items"]))
    return True


def max_tokens_for(schema) -> int:
    """An upper bound on the tokens of any compact instance of ``schema`` (no free whitespace):
    every token the grammar allows adds at least one byte, and one string character takes at most
    6 bytes (``\\u0000``), so a bound on the bytes bounds the tokens; +1 for EOS."""

    def size(s) -> int:
        if "enum" in s:
            return max((len(json.dumps(v, separators=(",", ":"))) for v in s["enum"]), default=0)
        if "const" in s:
            return len(json.dumps(s["const"], separators=(",", ":")))
        if "anyOf" in s:
            return max(size(b) for b in s["anyOf"])
        t = s.get("type")
        if t == "boolean":
            return 5
        if t == "null":
            return 4
        if t == "integer":
            return max(len(str(s["minimum"])), len(str(s["maximum"])))
        if t == "string":
            return 2 + 6 * s["maxLength"]
        if t == "object":
            return 1 + sum(len(json.dumps(k)) + 2 + size(v) for k, v in s["properties"].items())
        if t == "array":
            return 2 + s["maxItems"] * (size(s["items"]) + 1)
        raise AssertionError(f"unexpected schema {s}")

    return size(schema) + 1


# --------------------------------------------------------------------------- regexes
_ATOMS = st.one_of(
    st.sampled_from(list("abcxyz019-_")),
    st.sampled_from(["[a-c]", "[0-9]", "[xyz]", "[a-f0-5]", "[A-Z]"]),
)


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def wrap(atom: str, q: tuple[int, int] | str) -> str:
        atom = atom if re.fullmatch(r".|\[[^\]]*\]", atom) else f"({atom})"
        if isinstance(q, str):
            return atom + q
        lo, hi = q
        return f"{atom}{{{lo},{max(lo, hi)}}}"

    return st.builds(
        wrap, inner, st.one_of(st.just(""), st.just("?"), st.tuples(st.integers(0, 3), st.integers(1, 4)))
    )


def _regex(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    seq = st.lists(_quantified(children), min_size=1, max_size=4).map("".join)
    alt = st.lists(seq, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")")
    return st.one_of(seq, alt)


#: Bounded regexes (no ``*`` / ``+``: every match is short, so a random model finishes it).
REGEXES = st.recursive(_quantified(_ATOMS), _regex, max_leaves=6)
