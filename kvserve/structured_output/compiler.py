"""Constraint -> grammar matcher, compiled once per distinct constraint (llguidance).

llguidance (a Rust library with an abi3 wheel and no Python dependencies) turns a JSON schema,
regex, choice list or Lark/GBNF grammar into an Earley parser over a lexer, and computes the set
of tokens that keep the output a prefix of an accepted string (a bitmask, one bit per token).
Building its tokenizer view is the one slow part; ``GrammarCompiler.warm_up`` builds it on a
background thread when the engine starts (views are shared by compilers of the same tokenizer),
so the first constrained request does not stall the others. A compiled grammar is kept as a
*template* matcher per constraint (an LRU of ``cache_size`` entries); each sequence gets a
``deep_copy`` of it.

Compilation can never kill or hold the engine:

- ``limits.check_constraint`` first holds the constraint to ``GrammarLimits`` (size, nesting,
  definitions, ``$ref`` chains, required ``$ref`` cycles, alternatives, optional properties,
  repetition counts, rules, choices, int64 bounds):
  past one it is a ``ValueError`` naming the field and the limit, before llguidance runs.
- llguidance's compile recurses over the grammar; it runs on a thread of its own started with
  an explicit ``COMPILE_STACK_BYTES`` stack (``threading.stack_size`` set and restored under a
  lock), never on the caller's (a server worker, ``LLM.generate``'s), whose default stack a deep
  grammar overflows (a SIGSEGV: the whole process). llguidance's own ``ParserLimits`` bound its
  lexer and parser work, with ``verbose_errors`` off so no parser state reaches a message.
- The caller waits at most ``compile_timeout_s``; past it the constraint is a ``ValueError``
  and the compile finishes (or not) on its own thread, holding one of ``max_compiling`` slots.
- After compiling, the first token mask is computed: a constraint whose matcher is then in an
  error state, or allows no token while not accepting, can never be matched (a ``ValueError``
  naming the field), instead of failing its request in the middle of a step. A Lark / GBNF
  rule reachable from ``start`` that derives no finite string (``a: "x" a``: the first mask
  allows "x") is found by ``limits.rules_that_never_end`` and refused the same way.
- llguidance's parser limits (items in one Earley row, items per step) are only hit when a
  token is consumed: the first ``FIRST_TOKENS_PROBED`` allowed tokens are consumed on copies
  (``_check_first_tokens``), and a matcher that errs on one is a ``ValueError`` naming the field.
  The pre-checks bound the shapes known to do this deeper in the output (optional properties
  per object, alternatives per rule).

A thread, not a worker process: the pre-checks bound every input shape known to recurse deeply,
and the stack is many times what the deepest accepted shape needs, so the remaining risk a process
would cover is an unknown crash in llguidance. A process would pay for that with a tokenizer
view per worker, a second compile in the engine (a matcher cannot cross processes), and a
process start or pool to keep alive; the thread costs one thread start per cache miss.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.limits import (
    DEFAULT_LIMITS,
    GrammarLimits,
    check_constraint,
    check_nesting,
    grammar_expansion,
    parse_json_schema,
    rules_that_never_end,
)

if TYPE_CHECKING:  # llguidance is imported lazily at run time
    from llguidance._lib import JsonCompileOptions

#: Stack of a compile thread (virtual memory: only the pages a compile touches are used).
COMPILE_STACK_BYTES = 256 * 1024 * 1024
#: Seconds a caller waits for one compile (first mask included) before the constraint is a 400.
COMPILE_TIMEOUT_S = 10.0
#: Compiles running at once (one past its timeout keeps its slot until it ends).
MAX_COMPILING = 4

_stack_lock = threading.Lock()
# (tokenizer name, its length, vocab_size, eos id) -> (llguidance tokenizer view, the name of the
# thread that built it); a view is immutable and shared by every compiler of that tokenizer
_views: dict[tuple, Any] = {}
_views_lock = threading.Lock()


def start_large_stack_thread(target, name: str, stack_bytes: int = COMPILE_STACK_BYTES) -> threading.Thread:
    """Start a daemon thread running ``target()`` with a ``stack_bytes`` stack.

    ``threading.stack_size`` is process-wide: it is set, the thread started, and the previous
    size restored, under a lock, so no other thread of this module sees the large size (a
    thread started elsewhere in that instant gets a larger stack, which is harmless).
    """
    with _stack_lock:
        old = threading.stack_size(stack_bytes)
        try:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    return t


#: Whitespace allowed between JSON tokens unless ``whitespace_pattern`` says otherwise: any JSON
#: whitespace, at most 24 characters (pretty-printing to depth 5 fits). Unbounded whitespace
#: lets a model that favours it loop on blanks until ``max_tokens``.
DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


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
        options: JsonCompileOptions = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_JSON_WHITESPACE
        try:
            return LLMatcher.grammar_from_json_schema(
                json.dumps(parse_json_schema(params)), overrides=options or None
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
    thread only finds the result in the cache. Every compile itself runs on a dedicated
    large-stack thread (see the module docstring).

    Args:
        tokenizer: the engine's transformers fast tokenizer.
        vocab_size: the model's vocabulary (rows of the logits; may exceed the tokenizer's).
        eos_token_id: the model's EOS id: allowed exactly where the grammar accepts.
        cache_size: how many compiled constraints to keep (least recently used dropped).
        limits: the pre-checks' bounds (``GrammarLimits``).
        compile_timeout_s: seconds a caller waits for one compile before it is a ValueError.
        max_compiling: compiles running at once; a caller waits for a slot within its timeout.

    Attributes:
        tokenizer_thread: the name of the thread that built the tokenizer view (None until
            built; a view shared from another compiler keeps its builder's name).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = 256,
        limits: GrammarLimits = DEFAULT_LIMITS,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_compiling: int = MAX_COMPILING,
    ):
        self._hf_tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self.limits = limits
        self.compile_timeout_s = float(compile_timeout_s)
        self._slots = threading.BoundedSemaphore(max_compiling)
        self._ll_tokenizer: Any = None
        self.tokenizer_thread: str | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_limits: Any = None
        self.num_compiled = 0  # cache misses (tests and metrics)

    def _view_key(self) -> tuple:
        tok = self._hf_tokenizer
        return (getattr(tok, "name_or_path", id(tok)), len(tok), self.vocab_size, self.eos_token_id)

    def _tokenizer(self):
        """llguidance's view of the tokenizer (built once per tokenizer, process-wide)."""
        if self._ll_tokenizer is not None:
            return self._ll_tokenizer
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                key = self._view_key()
                with _views_lock:
                    view = _views.get(key)
                if view is None:
                    import llguidance.hf

                    built = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                    )
                    with _views_lock:
                        view = _views.setdefault(key, (built, threading.current_thread().name))
                self._ll_tokenizer, self.tokenizer_thread = view
        return self._ll_tokenizer

    def warm_up(self) -> threading.Thread:
        """Build the tokenizer view on a background thread (``kvserve-grammar-warmup``) and
        return it; a constraint compiled meanwhile waits for it. A failure is left for the
        first compile to raise."""

        def run() -> None:
            try:
                self._tokenizer()
            except Exception:  # raised again by the first compile
                pass

        # Not a daemon: a process that ends while the view is being built would otherwise
        # tear the interpreter down under the grammar engine's native code (SIGSEGV at exit).
        t = threading.Thread(target=run, name="kvserve-grammar-warmup", daemon=False)
        t.start()
        return t

    def check(self, params: StructuredOutputsParams) -> None:
        """The pre-checks alone (``limits.check_constraint``): no grammar engine runs.

        Raises:
            ValueError: naming ``params.field_name`` and the limit it is past.
        """
        check_constraint(params, self.limits)

    def compile(self, params: StructuredOutputsParams):
        """The template matcher of ``params`` (compiled now, or from the cache).

        Raises:
            ValueError: naming ``params.field_name``: past a ``GrammarLimits`` bound, does not
                compile (llguidance's message, without its parser state), can never be matched
                (no first token allowed), or took longer than ``compile_timeout_s``.
        """
        check_nesting(params, self.limits)  # before cache_key parses or serializes a schema
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        check_constraint(params, self.limits)
        matcher = self._compile_isolated(params)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _compile_isolated(self, params: StructuredOutputsParams):
        """``_compile_now`` on a new large-stack thread; waits at most ``compile_timeout_s``."""
        name = params.field_name
        timeout = self.compile_timeout_s
        if not self._slots.acquire(timeout=timeout):
            raise ValueError(f"{name}: the grammar compiler is busy with other constraints; try again later.")
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self._compile_now(params))
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)
            finally:
                self._slots.release()

        try:
            start_large_stack_thread(run, "kvserve-grammar-compile")
        except BaseException:
            self._slots.release()
            raise
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise ValueError(
                f"{name}: compiling the {params.kind} constraint took longer than {timeout:g} s (limit)."
            ) from None

    def _compile_now(self, params: StructuredOutputsParams):
        """Compile and check the first mask, on the calling thread (a large-stack one)."""
        from llguidance import LLMatcher, LLParserLimits

        tokenizer = self._tokenizer()
        text = grammar_text(params)
        if params.kind == "grammar":
            _check_rules_end(params, self.limits)
        if self._ll_limits is None:
            self._ll_limits = LLParserLimits(verbose_errors=False)
        # Compiling drops the GIL (llguidance); no lock is held, so one slow grammar does not
        # hold up another request's cached lookup.
        matcher = LLMatcher(tokenizer, text, log_level=0, limits=self._ll_limits)
        if matcher.is_error():
            raise ValueError(
                f"{params.field_name}: cannot compile the {params.kind} constraint: "
                f"{grammar_error_message(matcher.get_error())}"
            )
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        if probe.is_error() or (not any(mask) and not probe.is_accepting()):
            raise ValueError(
                f"{params.field_name}: the {params.kind} constraint can never be matched: no output "
                "satisfies it (an empty language, a rule or $ref that never ends, or past the grammar "
                "engine's limits)."
            )
        _check_first_tokens(params, probe, mask)
        return matcher

    def new_matcher(self, params: StructuredOutputsParams):
        """A fresh matcher (at the start of the grammar) for one sequence. Raises like
        ``compile``."""
        return self.compile(params).deep_copy()


#: Allowed first tokens consumed by the compile-time check (the lowest ids: the check is bounded).
FIRST_TOKENS_PROBED = 32


def _check_first_tokens(params: StructuredOutputsParams, matcher: Any, mask: bytes) -> None:
    """Consume each of the first ``FIRST_TOKENS_PROBED`` allowed tokens on a copy of ``matcher``.

    llguidance's ``ParserLimits`` (items in one Earley row, items per step) are hit when the
    first token is consumed, not when the first mask is computed: an object of many optional
    properties, thousands of alternatives in one rule, or a forced expansion too long to
    fast-forward. Such a constraint would otherwise fail its request one step after it was
    accepted.

    Raises:
        ValueError: naming ``params.field_name``, when a first token puts the matcher in its
            error state.
    """
    words = memoryview(mask).cast("I")
    probed = 0
    for w, word in enumerate(words):
        while word and probed < FIRST_TOKENS_PROBED:
            low = word & -word
            word ^= low
            probed += 1
            copy = matcher.deep_copy()
            if not copy.consume_token(w * 32 + low.bit_length() - 1) or copy.is_error():
                raise ValueError(
                    f"{params.field_name}: the {params.kind} constraint is past the grammar engine's "
                    f"limits at its first token ({grammar_error_message(copy.get_error())}); use fewer "
                    "optional properties per object, fewer alternatives per rule, or shorter fixed "
                    "expansions."
                )
        if probed >= FIRST_TOKENS_PROBED:
            return


def _check_rules_end(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raises ValueError naming the field when a rule of the grammar reachable from ``start``
    can never end (``limits.rules_that_never_end``; GBNF is read as llguidance's Lark form), or
    a rule's fixed expansion holds more than ``limits.max_repeat`` terminals
    (``limits.grammar_expansion``)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(params.grammar or "")
    except Exception:  # malformed GBNF: grammar_text has named it already
        return
    expansion = grammar_expansion(lark)
    if expansion > limits.max_repeat:
        shown = f"{expansion}" if expansion < 1 << 62 else "more than 2**62"
        raise ValueError(
            f"{params.field_name}: the grammar repeats {shown} times across its rules (counts of "
            f"referenced rules multiplied, sequences added), more than {limits.max_repeat} (limit)."
        )
    never = rules_that_never_end(lark)
    if never:
        shown = ", ".join(never[:5]) + (f" and {len(never) - 5} more" if len(never) > 5 else "")
        raise ValueError(
            f"{params.field_name}: the grammar can never be matched: rule(s) {shown} never end "
            "(every expansion needs the rule again)."
        )


def grammar_error_message(error: str) -> str:
    """llguidance's error as one line: its caret lines and any parser-state block dropped."""
    lines = []
    for line in error.splitlines():
        line = line.strip()
        if line.startswith("<"):
            break  # "<state>" / "<non-verbose/>": internals, never shown
        if line.strip("^ \t"):
            lines.append(line)
    return " ".join(lines)[:400] or "the grammar engine rejected it"
