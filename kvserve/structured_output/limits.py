"""Size and shape limits of a structured-output constraint, checked before the grammar engine sees it.

llguidance compiles a grammar recursively (a chain of rules or ``$ref`` s deep enough overflows
a thread's stack and kills the process) and takes some inputs it cannot serve well (repetition
counts in the millions, thousands of alternatives in one Earley row, integer bounds outside
int64, which it silently clamps). ``check_constraint`` walks the constraint in pure Python,
iteratively (no recursion, so it cannot overflow either), and rejects what is past a
``GrammarLimits`` bound with a ``ValueError`` naming the field and the limit (an HTTP 400).

The checks are deliberately shape checks, not a second grammar engine: what passes them is
compiled by llguidance on a thread with a large stack, with its own resource limits
(``ParserLimits``), and its first token mask is computed before the constraint is accepted
(``GrammarCompiler``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from kvserve.field_limits import INT64_MAX, INT64_MIN
from kvserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds ``check_constraint`` holds a constraint to (defaults: ``DEFAULT_LIMITS``).

    Attributes:
        max_bytes: UTF-8 bytes of the constraint's text (a JSON schema as JSON text, a regex, a
            grammar, all choices together, a structural tag).
        max_json_depth: nesting of a JSON schema document (objects and arrays).
        max_defs: entries of ``$defs`` / ``definitions`` in one schema, all levels together.
        max_ref_chain: the longest chain of ``$ref`` s one schema can follow, each definition
            of a recursive group (definitions that reach each other) counted once.
        max_alternatives: entries of one ``anyOf`` / ``oneOf`` / ``allOf`` / ``enum`` list, and
            alternatives (``|``) of one grammar rule.
        max_repeat: a repetition count: ``{n,m}`` in a regex or grammar (counts of nested
            repetitions multiplied), the terminals of a grammar rule's fixed expansion
            (``grammar_expansion``: repetitions multiplied and sequences added across rules),
            and a schema's ``minLength`` / ``maxLength`` /
            ``minItems`` / ``maxItems`` / ``minProperties`` / ``maxProperties``.
        max_rules: rules of a Lark / GBNF grammar.
        max_optional_properties: ``properties`` of one object schema not in its ``required``
            (the grammar engine holds every optional property that may come next in one parser
            row, a few items each).
        max_choices: strings of a ``choice`` constraint.
        max_choice_chars: characters of one choice.
    """

    max_bytes: int = 256 * 1024
    max_json_depth: int = 128
    max_defs: int = 1000
    max_ref_chain: int = 128
    max_alternatives: int = 1000
    max_repeat: int = 10_000
    max_rules: int = 1000
    max_optional_properties: int = 400
    max_choices: int = 1000
    max_choice_chars: int = 1024


DEFAULT_LIMITS = GrammarLimits()

_COMBINATORS = ("anyOf", "oneOf", "allOf")
_DEFS_TABLES = ("$defs", "definitions")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# a JSON string (with escapes), removed before counting brackets
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
# a rule's head: Lark ``name:`` / ``?name:`` / ``NAME.2:`` or GBNF ``name ::=``, at a line start
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.M)
# a Lark repetition operator ``item{n}`` / ``item{n,m}``
_GRAMMAR_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _bad(field: str, message: str) -> ValueError:
    return ValueError(f"{field}: {message}")


def _check_bytes(field: str, text: str, limits: GrammarLimits, what: str) -> None:
    # characters bound bytes from below; encode only when it may matter
    if len(text) > limits.max_bytes or len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes:
        raise _bad(field, f"the {what} is longer than {limits.max_bytes} bytes (limit).")


def json_text_depth(text: str) -> int:
    """Nesting depth of JSON text (objects and arrays; brackets inside strings not counted),
    without parsing it (Python's parser raises RecursionError on deep text)."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(1 if c in "[{" else -1 for c in brackets))


def _object_depth(value: Any, limit: int) -> int:
    """Nesting depth of a Python JSON value, counted iteratively; stops past ``limit`` (a
    self-referencing dict then reads as too deep, not as a hang)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        children: Iterable[Any]
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


def regex_repeat(pattern: str) -> int:
    """The largest repetition count of a regex, counts of nested groups multiplied:
    ``(a{10}){20}`` -> 200; ``{n,}`` counts ``n``. ``*``, ``+`` and ``?`` count 1 (they add no
    states). Character classes and escapes are skipped; the regex is not validated here."""
    # one entry per open group: the largest count inside it so far
    stack = [1]
    last = 1  # the count of the atom just closed (a group's inner count, else 1)
    worst = 1
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            last = 1
            continue
        if c == "(":
            stack.append(1)
            i += 1
            continue
        if c == ")":
            last = stack.pop() if len(stack) > 1 else 1
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        if c == "{":
            m = re.match(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", pattern[i:])
            if m is not None:
                hi = m.group(2)
                count = int(hi) if hi else int(m.group(1))
                total = count * last
                worst = max(worst, total)
                stack[-1] = max(stack[-1], total)
                i += m.end()
                last = 1
                continue
        last = 1
        i += 1
    return max(worst, *stack)


def _check_regex(field: str, pattern: str, limits: GrammarLimits, what: str = "regex") -> None:
    count = regex_repeat(pattern)
    if count > limits.max_repeat:
        raise _bad(field, f"the {what} repeats {count} times, more than {limits.max_repeat} (limit).")


def _ref_target(ref: Any, defs: dict[str, str]) -> str | None:
    """The definition (its JSON pointer) a ``$ref`` lands in, or "#" for the root; None for a
    reference that is not local (the grammar engine rejects those itself)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    for pointer in defs:
        if ref == pointer or ref.startswith(pointer + "/"):
            return pointer
    return "#"


def _longest_ref_chain(edges: dict[str, set[str]]) -> int:
    """The longest path through the ``$ref`` graph, each strongly connected group (recursion)
    weighted by its size: an upper bound of how deep a depth-first compile can nest. Tarjan's
    algorithm, iteratively, then a longest path over the groups (which form a DAG)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comp: dict[str, int] = {}
    sizes: list[int] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                size = 0
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp[w] = len(sizes)
                    size += 1
                    if w == v:
                        break
                sizes.append(size)
    # Tarjan numbers the groups in reverse topological order: successors come first.
    succ: list[set[int]] = [set() for _ in sizes]
    for v, ws in edges.items():
        for w in ws:
            if comp[v] != comp[w]:
                succ[comp[v]].add(comp[w])
    longest = [0] * len(sizes)
    for c in range(len(sizes)):
        longest[c] = sizes[c] + max((longest[s] for s in succ[c]), default=0)
    return max(longest, default=0)


def definitions_that_never_end(schema: Any, defs: dict[str, str]) -> list[str]:
    """Pointers (``#`` for the root) of a schema's root and definitions that no finite JSON value
    matches because each of their values must contain another of them: a ``$ref`` cycle where
    every step is required (a ``$ref``, an ``allOf`` entry, a ``required`` property, ``items`` /
    the first ``prefixItems`` under ``minItems`` >= 1, every ``anyOf`` / ``oneOf`` alternative),
    e.g. ``{"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}``.
    ``defs`` maps each definition's pointer to itself (``check_json_schema``'s pass 1). Only
    the root and definitions reachable from it by ``$ref`` are reported, sorted.

    Each schema object is an AND of what it requires (an ``anyOf`` / ``oneOf`` an OR of its
    alternatives); which can end is found by unit propagation over these gates (linear in the
    schema's size, no recursion). Anything else (``not``, ``if``, a reference into the middle
    of a definition, a remote one) is taken to be able to end.
    """
    need: list[int] = []  # per gate: inputs still unsatisfied (AND) or 1 (OR)
    parents: list[list[int]] = []  # per gate: the gates it is an input of
    gate_of: dict[str, int] = {}  # pointer -> gate of the schema object there
    # (gate, the root or definition it requires, the root or definition the gate lies in)
    refs: list[tuple[int, str, str]] = []

    def new_gate() -> int:
        need.append(0)
        parents.append([])
        return len(need) - 1

    def wire(child: int, parent: int) -> None:
        parents[child].append(parent)
        need[parent] += 1

    root = new_gate()
    stack: list[tuple[Any, str, int, str]] = [(schema, "#", root, "#")]
    while stack:
        node, path, gate, owner = stack.pop()
        gate_of[path] = gate
        for key, value in node.items():
            sub = f"{path}/{key}"
            if key in _DEFS_TABLES and isinstance(value, dict):
                for name, d in value.items():
                    if isinstance(d, dict):
                        stack.append((d, f"{sub}/{name}", new_gate(), f"{sub}/{name}"))
            elif key == "properties" and isinstance(value, dict):
                required = node.get("required")
                required = set(required) if isinstance(required, list) else set()
                for name, p in value.items():
                    if isinstance(p, dict):
                        child = new_gate()
                        if name in required:
                            wire(child, gate)
                        stack.append((p, f"{sub}/{name}", child, owner))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref in defs):
            refs.append((gate, ref, owner))
            need[gate] += 1
        for key in ("allOf", "anyOf", "oneOf"):
            alts = node.get(key)
            if not isinstance(alts, list):
                continue
            if key != "allOf" and not all(isinstance(x, dict) for x in alts):
                alts = [x for x in alts if isinstance(x, dict)]
                # a boolean alternative: the OR is met; the rest are walked as optional
                for i, x in enumerate(alts):
                    stack.append((x, f"{path}/alt/{i}", new_gate(), owner))
                continue
            input_of = gate  # the gate the alternatives feed
            if key != "allOf" and alts:
                input_of = new_gate()  # an OR: satisfied by its first satisfied alternative
                wire(input_of, gate)
                need[input_of] = 1
            for i, a in enumerate(alts):
                if isinstance(a, dict):
                    child = new_gate()
                    parents[child].append(input_of)
                    if key == "allOf":
                        need[gate] += 1
                    stack.append((a, f"{path}/{key}/{i}", child, owner))
        min_items = node.get("minItems")
        min_items = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = node.get("items")
        for i, p in enumerate(prefix):
            if isinstance(p, dict):
                child = new_gate()
                if i < min_items:
                    wire(child, gate)
                stack.append((p, f"{path}/prefixItems/{i}", child, owner))
        if isinstance(items, dict):
            child = new_gate()
            if min_items > len(prefix):
                wire(child, gate)
            stack.append((items, f"{path}/items", child, owner))
    for gate, target, _ in refs:
        if target in gate_of:
            parents[gate_of[target]].append(gate)
        else:  # a definition under a keyword not walked here (say, in "not"): assumed to end
            need[gate] -= 1
    done = [False] * len(need)
    queue = [g for g, n in enumerate(need) if n == 0]
    while queue:
        g = queue.pop()
        if done[g]:
            continue
        done[g] = True
        for p in parents[g]:
            need[p] -= 1
            if need[p] <= 0 and not done[p]:
                queue.append(p)
    # the root and the definitions it reaches by $ref
    ref_from: dict[str, set[str]] = {}
    for _, target, owner in refs:
        ref_from.setdefault(owner, set()).add(target)
    reached, todo = {"#"}, ["#"]
    while todo:
        for t in ref_from.get(todo.pop(), ()):
            if t not in reached:
                reached.add(t)
                todo.append(t)
    return sorted(p for p in reached if p in gate_of and not done[gate_of[p]])


def check_json_schema(field: str, schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Check a parsed JSON schema against ``limits`` (see ``GrammarLimits``) and that its
    numeric bounds are finite (integer ones within int64).

    Raises:
        ValueError: naming ``field`` and the limit.
    """
    depth = _object_depth(schema, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise _bad(field, f"the JSON schema nests deeper than {limits.max_json_depth} levels (limit).")
    # Pass 1: every definition's pointer (so refs can be resolved to the definition they land in).
    defs: dict[str, str] = {}
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                sub = f"{path}/{key}"
                if key in ("$defs", "definitions") and isinstance(value, dict):
                    for name in value:
                        defs[f"{sub}/{name}"] = f"{sub}/{name}"
                stack.append((value, sub))
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
    if len(defs) > limits.max_defs:
        raise _bad(
            field, f"the JSON schema has {len(defs)} definitions, more than {limits.max_defs} (limit)."
        )
    # Pass 2: the per-node checks and the $ref graph (definition -> definitions it references).
    edges: dict[str, set[str]] = {"#": set()}
    edges.update((d, set()) for d in defs)
    stack2: list[tuple[Any, str, str]] = [(schema, "#", "#")]
    while stack2:
        node, path, owner = stack2.pop()
        if isinstance(node, list):
            stack2.extend((v, f"{path}/{i}", owner) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if path in defs:
            owner = path
        ref = node.get("$ref")
        if ref is not None:
            target = _ref_target(ref, defs)
            if target is not None:
                edges[owner].add(target)
        for key in (*_COMBINATORS, "enum"):
            alts = node.get(key)
            if isinstance(alts, list) and len(alts) > limits.max_alternatives:
                raise _bad(
                    field,
                    f"{key} at {path} has {len(alts)} entries, more than {limits.max_alternatives} (limit).",
                )
        for key in _COUNT_KEYWORDS:
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limits.max_repeat:
                raise _bad(field, f"{key} at {path} is {v}, more than {limits.max_repeat} (limit).")
        types = node.get("type")
        integer = types == "integer" or (isinstance(types, list) and "integer" in types)
        for key in _BOUND_KEYWORDS:
            v = node.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise _bad(field, f"{key} at {path} is {v}, not a finite number.")
            if integer and key != "multipleOf" and not INT64_MIN <= v <= INT64_MAX:
                raise _bad(
                    field,
                    f"{key} at {path} is {v:g}, outside the 64-bit integer range "
                    f"[-2**63, 2**63 - 1] of an integer schema (limit).",
                )
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            required = (
                set(required)
                if isinstance(required, list) and all(isinstance(r, str) for r in required)
                else set()
            )
            optional = sum(1 for name in properties if name not in required)
            if optional > limits.max_optional_properties:
                raise _bad(
                    field,
                    f"properties at {path} has {optional} optional properties (not in required), more "
                    f"than {limits.max_optional_properties} (limit).",
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_regex(field, pattern, limits, f"pattern at {path}")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for p in props:
                _check_regex(field, p, limits, f"patternProperties key at {path}")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                stack2.append((value, f"{path}/{key}", owner))
    never = definitions_that_never_end(schema, defs)
    if never:
        shown = ", ".join(never[:5]) + (f" and {len(never) - 5} more" if len(never) > 5 else "")
        raise _bad(
            field,
            f"the JSON schema can never be matched: {shown} require(s) a value containing itself "
            "(a $ref cycle through required properties, items or allOf), so no finite JSON matches.",
        )
    chain = _longest_ref_chain(edges) - 1  # references between the definitions and the root
    if chain > limits.max_ref_chain:
        raise _bad(
            field,
            f"the JSON schema's $ref chains are {chain} references long, more than "
            f"{limits.max_ref_chain} (limit).",
        )


def parse_json_schema(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> Any:
    """The constraint's JSON schema as a Python value (``{"type": "object"}`` for
    ``json_object``), its size and nesting checked before it is parsed or serialized.

    Raises:
        ValueError: naming ``params.field_name``: too long, too deep, not JSON, not an object.
    """
    field = params.field_name
    if params.json_object:
        return {"type": "object"}
    schema = params.json
    if isinstance(schema, str):
        _check_bytes(field, schema, limits, "JSON schema")
        if json_text_depth(schema) > limits.max_json_depth:
            raise _bad(field, f"the JSON schema nests deeper than {limits.max_json_depth} levels (limit).")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _bad(field, f"the JSON schema is not valid JSON: {e}") from None
    elif _object_depth(schema, limits.max_json_depth) > limits.max_json_depth:
        raise _bad(field, f"the JSON schema nests deeper than {limits.max_json_depth} levels (limit).")
    else:
        try:
            _check_bytes(field, json.dumps(schema), limits, "JSON schema")
        except (TypeError, ValueError) as e:
            if str(e).startswith(field):
                raise
            raise _bad(field, f"the JSON schema is not JSON data: {e}") from None
    if not isinstance(schema, dict):
        raise _bad(field, f"a JSON schema must be an object, got {type(schema).__name__}.")
    return schema


def _check_grammar(field: str, text: str, limits: GrammarLimits) -> None:
    _check_bytes(field, text, limits, "grammar")
    rules = len(_RULE_HEAD.findall(text))
    if rules > limits.max_rules:
        raise _bad(field, f"the grammar has {rules} rules, more than {limits.max_rules} (limit).")
    # quoted literals are text, not operators: "{99999}" in a string repeats nothing
    unquoted = re.sub(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'""", '""', text)
    heads = list(_RULE_HEAD.finditer(unquoted))
    for i, head in enumerate(heads):
        body = unquoted[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(unquoted)]
        # regexes may hold "|" of their own
        alternatives = re.sub(r"/(?:[^/\\\n]|\\.)+/", "", body).count("|") + 1
        if alternatives > limits.max_alternatives:
            name = head.group(0).strip().rstrip(":=").strip()
            raise _bad(
                field,
                f"grammar rule {name} has {alternatives} alternatives, more than "
                f"{limits.max_alternatives} (limit).",
            )
    for m in _GRAMMAR_REPEAT.finditer(unquoted):
        count = int(m.group(2) or m.group(1))
        if count > limits.max_repeat:
            raise _bad(field, f"the grammar repeats {count} times, more than {limits.max_repeat} (limit).")
    for m in re.finditer(r"/((?:[^/\\\n]|\\.)+)/", text):
        _check_regex(field, m.group(1), limits, "grammar's regex")


def check_nesting(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """The cheap part of ``check_constraint``: a JSON schema's (or structural tag's) size and
    nesting, so that parsing or serializing it (``cache_key``) cannot recurse too deep.

    Raises:
        ValueError: naming ``params.field_name`` and the limit it is past.
    """
    if params.kind == "json":
        parse_json_schema(params, limits)
    elif params.kind == "structural_tag":
        text = params.structural_tag or ""
        _check_bytes(params.field_name, text, limits, "structural tag")
        if json_text_depth(text) > limits.max_json_depth:
            raise _bad(
                params.field_name,
                f"the structural tag nests deeper than {limits.max_json_depth} levels (limit).",
            )


def check_constraint(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Hold a constraint to ``limits`` (see ``GrammarLimits``); pure Python, no grammar engine
    (safe in any process and on any thread).

    Raises:
        ValueError: naming ``params.field_name`` and the limit it is past.
    """
    field = params.field_name
    kind = params.kind
    if params.whitespace_pattern is not None:
        _check_bytes(field, params.whitespace_pattern, limits, "whitespace_pattern")
        _check_regex(field, params.whitespace_pattern, limits, "whitespace_pattern")
    if kind in ("json", "json_object"):
        check_json_schema(field, parse_json_schema(params, limits), limits)
    elif kind == "regex":
        _check_bytes(field, params.regex or "", limits, "regex")
        _check_regex(field, params.regex or "", limits)
    elif kind == "choice":
        choices = params.choice or []
        if len(choices) > limits.max_choices:
            raise _bad(field, f"{len(choices)} choices, more than {limits.max_choices} (limit).")
        longest = max(len(c) for c in choices)
        if longest > limits.max_choice_chars:
            raise _bad(
                field, f"a choice has {longest} characters, more than {limits.max_choice_chars} (limit)."
            )
        _check_bytes(field, "".join(choices), limits, "choice list")
    elif kind == "grammar":
        _check_grammar(field, params.grammar or "", limits)
    else:  # structural_tag
        text = params.structural_tag or ""
        _check_bytes(field, text, limits, "structural tag")
        if json_text_depth(text) > limits.max_json_depth:
            raise _bad(field, f"the structural tag nests deeper than {limits.max_json_depth} levels (limit).")
        try:
            spec = json.loads(text)
        except ValueError:
            return  # named by the compiler
        structures = spec.get("structures") if isinstance(spec, dict) else None
        if isinstance(structures, list):
            for i, s in enumerate(structures):
                if isinstance(s, dict) and isinstance(s.get("schema"), dict):
                    check_json_schema(f"{field}.structures[{i}].schema", s["schema"], limits)


# ---------------------------------------------------------------- rules that never end (Lark)
_LARK_TOKEN = re.compile(
    r"""\s+|(?P<str>"(?:[^"\\]|\\.)*"i?|'(?:[^'\\]|\\.)*'i?)|(?P<re>/(?:[^/\\\n]|\\.)+/[imsxlu]*)"""
    r"""|(?P<rep>\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<range>\d+(?:\.\.\d+)?)|(?P<name>[A-Za-z_]\w*)"""
    r"""|(?P<op>[|()\[\]?*+~])"""
)
_LARK_HEAD = re.compile(r"[?!]?(?P<name>[A-Za-z_]\w*)(?:\.-?\d+)?\s*:(?P<body>.*)", re.S)
#: Deepest parenthesis nesting the analysis follows (deeper: it assumes the rule can end).
_MAX_GROUP_NESTING = 64


class _Unsure(Exception):
    """Syntax the analysis does not model: every rule is then taken to be able to end."""


def _lark_expr(tokens: list[tuple[str, str]], pos: int, depth: int, close: str | None):
    """Parse ``alt ('|' alt)*`` from ``tokens[pos:]`` up to ``close``; returns (expr, pos).
    An expr is ``("or", [alts])``, an alt ``("and", [items])``, an item ``("name", n)``,
    ``("end",)`` (a terminal string or regex), ``("opt", expr)`` (may be empty),
    ``("rep", count, expr)`` (at most ``count`` times) or a nested expr."""
    if depth > _MAX_GROUP_NESTING:
        raise _Unsure
    alts: list = []
    items: list = []
    while True:
        if pos == len(tokens):
            if close is not None:
                raise _Unsure
            break
        kind, text = tokens[pos]
        if kind == "op" and text == close:
            pos += 1
            break
        if kind == "op" and text == "|":
            alts.append(("and", items))
            items = []
            pos += 1
            continue
        if kind in ("str", "re"):
            atom: Any = ("end",)
            pos += 1
        elif kind == "name":
            atom = ("name", text)
            pos += 1
        elif kind == "op" and text in "([":
            inner, pos = _lark_expr(tokens, pos + 1, depth + 1, ")" if text == "(" else "]")
            atom = ("opt", inner) if text == "[" else inner
        else:
            raise _Unsure
        # a quantifier that allows zero repetitions makes the item able to end
        if pos < len(tokens):
            k, t = tokens[pos]
            if k == "op" and t in "?*+":
                pos += 1
                if t != "+":
                    atom = ("opt", atom)
            elif k == "rep":
                pos += 1
                counts = [int(x) for x in re.findall(r"\d+", t)]
                atom = ("rep", max(counts), atom)
                if counts[0] == 0:
                    atom = ("opt", atom)
            elif k == "op" and t == "~":
                if pos + 1 >= len(tokens) or tokens[pos + 1][0] != "range":
                    raise _Unsure
                counts = [int(x) for x in tokens[pos + 1][1].split("..")]
                atom = ("rep", max(counts), atom)
                if counts[0] == 0:
                    atom = ("opt", atom)
                pos += 2
        items.append(atom)
    alts.append(("and", items))
    return ("or", alts), pos


def _can_end(expr, done: set[str], defined: set[str]) -> bool:
    tag = expr[0]
    if tag in ("end", "opt"):
        return True
    if tag == "name":
        return expr[1] in done or expr[1] not in defined
    if tag == "rep":
        return _can_end(expr[2], done, defined)
    if tag == "and":
        return all(_can_end(x, done, defined) for x in expr[1])
    return any(_can_end(x, done, defined) for x in expr[1])


def _names(expr, out: set[str]) -> set[str]:
    stack = [expr]
    while stack:
        e = stack.pop()
        if e[0] == "name":
            out.add(e[1])
        elif e[0] in ("and", "or"):
            stack.extend(e[1])
        elif e[0] == "opt":
            stack.append(e[1])
        elif e[0] == "rep":
            stack.append(e[2])
    return out


def _parse_lark(lark: str) -> dict[str, Any] | None:
    """``{rule name: expr}`` of a Lark grammar (``_lark_expr``'s form), or None for syntax not
    modelled (see ``rules_that_never_end``)."""
    rules: dict[str, Any] = {}
    current: str | None = None
    bodies: dict[str, list[str]] = {}
    for line in lark.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%"):
            if stripped.startswith(("%import", "%ignore", "%llguidance")):
                current = None
                continue
            return None
        head = _LARK_HEAD.match(stripped) if not stripped.startswith("|") else None
        if head is not None:
            current = head.group("name")
            if current in bodies:
                return None  # redefinition (e.g. ``%override``): not modelled
            bodies[current] = [head.group("body")]
        elif current is not None:
            bodies[current].append(stripped)
        else:
            return None
    try:
        for name, parts in bodies.items():
            tokens = []
            text = " ".join(parts)
            pos = 0
            while pos < len(text):
                m = _LARK_TOKEN.match(text, pos)
                if m is None:
                    raise _Unsure
                pos = m.end()
                if m.lastgroup is not None:
                    tokens.append((m.lastgroup, m.group(m.lastgroup)))
            rules[name], _ = _lark_expr(tokens, 0, 0, None)
    except _Unsure:
        return None
    return rules


#: ``grammar_expansion`` stops counting here (a doubling per rule grows without bound).
_EXPANSION_CAP = 1 << 62


def grammar_expansion(lark: str) -> int:
    """How many terminals the largest fixed expansion of a Lark grammar's rules holds, following
    rule references: a sequence adds its items, alternatives take the largest, a repetition
    multiplies by its largest count (``b: c{100}`` with ``c: "a"{100}`` is 10,000;
    ``r0: r1 r1``, ``r1: r2 r2``, ... doubles per rule). A reference back into a recursive
    group counts 1 (recursion is not a fixed expansion); ``*`` / ``+`` count 1. 0 for syntax
    not modelled (as ``rules_that_never_end``).

    The grammar engine forces (fast-forwards) a fixed expansion as a whole, and one past its
    per-step item limit fails the request at that point of its output.
    """
    rules = _parse_lark(lark)
    if not rules:
        return 0
    size: dict[str, int] = {}
    on_stack: set[str] = set()

    def measure(expr) -> int:
        tag = expr[0]
        if tag == "end":
            return 1
        if tag == "name":
            return size.get(expr[1], 1)  # a rule being measured (recursion) or not defined
        if tag == "opt":
            return measure(expr[1])
        if tag == "rep":
            return min(expr[1] * measure(expr[2]), _EXPANSION_CAP)
        parts = [measure(x) for x in expr[1]]
        return min(sum(parts), _EXPANSION_CAP) if tag == "and" else max(parts, default=0)

    # iterative post-order over the rule graph: a rule is measured after the rules it uses
    for root in rules:
        if root in size:
            continue
        work = [(root, iter(sorted(_names(rules[root], set()))))]
        on_stack.add(root)
        while work:
            name, it = work[-1]
            used = next(it, None)
            if used is not None:
                if used in rules and used not in size and used not in on_stack:
                    on_stack.add(used)
                    work.append((used, iter(sorted(_names(rules[used], set())))))
                continue
            work.pop()
            on_stack.discard(name)
            size[name] = measure(rules[name])
    return max(size.values(), default=0)


def rules_that_never_end(lark: str) -> list[str]:
    """Rules of a Lark grammar, reachable from ``start``, that derive no finite string (e.g.
    ``a: "x" a``): output that enters one can never be completed. Sorted by name.

    A conservative analysis of the common syntax (strings, regexes, rule and terminal names,
    groups, ``[...]``, ``? * + {n,m} ~ n..m``, ``|``): any other syntax (``%`` directives but
    ``%import`` / ``%ignore`` / ``%llguidance``, ``@`` sub-grammars, token ids) makes it report
    nothing.
    """
    rules = _parse_lark(lark)
    if rules is None or "start" not in rules:
        return []
    defined = set(rules)
    users: dict[str, set[str]] = {n: set() for n in rules}
    for n, e in rules.items():
        for used in _names(e, set()):
            if used in users:
                users[used].add(n)
    # worklist: a rule is re-examined when one it uses is found able to end
    done: set[str] = set()
    todo = list(rules)
    while todo:
        n = todo.pop()
        if n in done or not _can_end(rules[n], done, defined):
            continue
        done.add(n)
        todo.extend(u for u in users[n] if u not in done)
    reachable, stack = {"start"}, ["start"]
    while stack:
        for used in _names(rules[stack.pop()], set()):
            if used in rules and used not in reachable:
                reachable.add(used)
                stack.append(used)
    return sorted(reachable - done)
