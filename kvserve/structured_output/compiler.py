"""Constraint -> grammar matcher, compiled once per distinct constraint (llguidance).

llguidance (a Rust library with an abi3 wheel and no Python dependencies) turns a JSON schema,
regex, choice list or Lark/GBNF grammar into an Earley parser over a lexer, and computes the set
of tokens that keep the output a prefix of an accepted string (a bitmask, one bit per token).
Building its tokenizer view is the one slow part (~1 s for a 49k vocabulary); it is done once,
on the first constrained request. A compiled grammar is kept as a *template* matcher per
constraint (an LRU of ``cache_size`` entries); each sequence gets a ``deep_copy`` of it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams

#: Whitespace allowed between JSON tokens unless ``whitespace_pattern`` says otherwise: any JSON
#: whitespace, at most 24 characters (pretty-printing to depth 5 fits). Unbounded whitespace
#: lets a model that favours it loop on blanks until ``max_tokens``.
DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


def _json_schema(params: StructuredOutputsParams) -> Any:
    if params.json_object:
        return {"type": "object"}
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{params.field_name}: the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"{params.field_name}: a JSON schema must be an object, got {type(schema).__name__}."
        )
    return schema


def _structural_tag_grammar(params: StructuredOutputsParams) -> str:
    """vLLM's structural-tag JSON -> a Lark grammar of free text with tagged JSON segments."""
    from llguidance import StructTag

    name = params.field_name
    try:
        spec = json.loads(params.structural_tag or "")
    except ValueError as e:
        raise ValueError(f"{name}: not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{name}: must be a JSON object with 'structures' and 'triggers'.")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}.structures must be a non-empty list of {{begin, schema, end}}.")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings.")
    tags = []
    for i, s in enumerate(structures):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("begin"), str)
            or not isinstance(s.get("end"), str)
        ):
            raise ValueError(f"{name}.structures[{i}] must have string 'begin' and 'end' and a 'schema'.")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{name}.structures[{i}].begin {s['begin']!r} starts with none of the triggers.")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"{name}.structures[{i}].schema must be a JSON schema object.")
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint.

    Raises:
        ValueError: naming ``params.field_name``, for a schema that is not JSON or not an object,
            or a malformed structural tag. (Whether the grammar itself is valid is only known
            when it is compiled: ``GrammarCompiler.compile``.)
    """
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_JSON_WHITESPACE
        try:
            return LLMatcher.grammar_from_json_schema(
                json.dumps(_json_schema(params)), overrides=options or None
            )
        except ValueError as e:
            raise ValueError(f"{params.field_name}: invalid JSON schema: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
    if kind == "grammar":
        try:
            return grammar_from("grammar", params.grammar or "")
        except ValueError as e:
            raise ValueError(f"{params.field_name}: invalid grammar: {e}") from None
    return LLMatcher.grammar_from_lark(_structural_tag_grammar(params))


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into llguidance matchers for one tokenizer.

    Thread-safe: the server compiles on a worker thread before queueing a request, so the engine
    thread only finds the result in the cache.

    Args:
        tokenizer: the engine's transformers fast tokenizer.
        vocab_size: the model's vocabulary (rows of the logits; may exceed the tokenizer's).
        eos_token_id: the model's EOS id: allowed exactly where the grammar accepts.
        cache_size: how many compiled constraints to keep (least recently used dropped).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = 256):
        self._hf_tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses (tests and metrics)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The template matcher of ``params`` (compiled now, or from the cache).

        Raises:
            ValueError: naming ``params.field_name`` and llguidance's message, when the schema,
                regex or grammar does not compile.
        """
        from llguidance import LLMatcher

        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tokenizer = self._tokenizer()
        text = grammar_text(params)
        # Compiling drops the GIL (llguidance); done outside the lock so one slow grammar does
        # not hold up another request's cached lookup.
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            # llguidance's message spans lines (with a caret under the position): one line here.
            message = " ".join(x.strip() for x in matcher.get_error().splitlines() if x.strip("^ \t"))[:400]
            raise ValueError(f"{params.field_name}: cannot compile the {params.kind} constraint: {message}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, params: StructuredOutputsParams):
        """A fresh matcher (at the start of the grammar) for one sequence. Raises like
        ``compile``."""
        return self.compile(params).deep_copy()
