"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import enum
import json
import operator
from dataclasses import dataclass, field
from typing import Any

from kvserve.field_limits import LIMITS, MAX_BAD_WORD_CHARS, MAX_STOP_CHARS, check_count

#: Temperatures below this are treated as greedy (argmax) decoding.
GREEDY_EPS = 1e-5


def _as_token_id(x) -> int:
    """A token id from an int (numpy ints too) or a decimal string (JSON object keys)."""
    if isinstance(x, bool):
        raise TypeError
    if isinstance(x, str):
        # digits only: int() would also take other scripts' digits ("٣" == 3), signs, spaces
        # and underscores ("1_0" == 10)
        if not (x.isascii() and x.isdigit()) or len(x) > 20:
            raise ValueError
        return int(x, 10)
    return operator.index(x)


#: The range ``torch.Generator.manual_seed`` accepts.
SEED_MIN, SEED_MAX = LIMITS["seed"].lo, LIMITS["seed"].hi

_NUMERIC_FIELDS = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "best_of",
    "truncate_prompt_tokens",
)
_OPTIONAL_FIELDS = {"max_tokens", "seed", "logprobs", "prompt_logprobs", "best_of", "truncate_prompt_tokens"}


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a streaming request carries (vLLM's ``RequestOutputKind``):

    - ``CUMULATIVE``: every output holds the whole completion so far (text, token ids,
      logprobs);
    - ``DELTA``: every output holds only what was added since the request's previous output;
    - ``FINAL_ONLY``: no output until the request finishes; that one holds the whole completion.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value that
      validates against it;
    - ``regex``: the output matches the regular expression as a whole (Rust ``regex`` syntax,
      which agrees with Python's ``re`` on the common subset);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar, Lark (``start: ...``) or EBNF/GBNF
      (``root ::= ...``);
    - ``json_object=True``: any JSON object;
    - ``structural_tag``: vLLM's structural tags (JSON text ``{"structures": [{"begin",
      "schema", "end"}], "triggers": [...]}``): free text in which every segment that starts
      with a trigger must be one of the structures (``begin``, a JSON value of ``schema``,
      ``end``).

    ``disable_any_whitespace`` (JSON kinds): no whitespace between tokens of the JSON;
    ``whitespace_pattern`` (JSON kinds): the regex of the whitespace allowed there.
    ``origin`` is not part of the constraint: the request field it came from (e.g.
    ``response_format``), used to name that field in errors.

    Raises:
        ValueError: naming the field, when none or more than one kind is set or a value has
            the wrong type. Whether the schema / regex / grammar compiles is checked by the
            engine at ``add_request`` (also a ValueError naming the field).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    origin: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"{self.origin} must set exactly one of {', '.join(_CONSTRAINT_KINDS)}; got "
                f"{', '.join(set_kinds) if set_kinds else 'none'}."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"{self.field_name}: a JSON schema must be an object or its JSON text.")
        if isinstance(self.json, bool) or (isinstance(self.json, str) and not self.json.strip()):
            raise ValueError(f"{self.field_name}: a JSON schema must be an object or its JSON text.")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{self.origin}.{name} must be a non-empty string, got {v!r}.")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"{self.field_name} must be a non-empty list of non-empty strings, got {self.choice!r}."
            )
        if self.json_object not in (None, True, False):
            raise ValueError(f"{self.origin}.json_object must be a boolean, got {self.json_object!r}.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"{self.origin}.disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}."
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``json``, ``regex``, ``choice``, ``grammar``,
        ``json_object``, ``structural_tag``."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The request field that carries the constraint, for error messages (e.g.
        ``structured_outputs.json`` offline, ``response_format`` on the server)."""
        if self.origin == "structured_outputs":
            return f"structured_outputs.{self.kind}"
        return self.origin

    def cache_key(self) -> tuple:
        """A hashable key that is equal for constraints that compile to the same grammar."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:  # the same schema as text or as a dict compiles once
                value = json.loads(value)
            except ValueError:
                pass
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace, self.whitespace_pattern)


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one request.

    Fields follow vLLM's ``SamplingParams`` and the OpenAI API:

    - ``n``: number of completions (int >= 1). The prompt is prefilled once and the
      sequences are forked (copy-on-write blocks).
    - ``max_tokens``: generated tokens per completion (int >= 1). ``None`` means
      "until ``max_model_len``" (the engine fills it in: ``max_model_len - prompt_len``).
    - ``min_tokens``: EOS and stop ids are suppressed until this many tokens exist.
    - ``temperature`` (>= 0; 0 = greedy), ``top_p`` in (0, 1], ``top_k`` (-1 = off, or >= 1),
      ``min_p`` in [0, 1].
    - ``repetition_penalty`` (> 0, 1 = off; CTRL paper, Keskar et al. 2019: logits of
      tokens seen in prompt or output are divided by it when positive, multiplied when
      negative), ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI API
      definition: ``logit -= presence * (count > 0) + frequency * count`` over output tokens).
    - ``seed``: per-request RNG seed (int) for reproducible random sampling.
    - ``stop``: strings that end the completion when they appear in the decoded text,
      anywhere (not only on token boundaries). ``include_stop_str_in_output`` keeps the
      match in the text.
    - ``stop_token_ids``: token ids that end the completion (the token is kept in
      ``token_ids``); ``ignore_eos``: do not stop at the model's EOS token.
    - ``logprobs``: number of top log-probabilities to return per generated token
      (``None`` = none; 0 = only the sampled token's).
    - ``prompt_logprobs``: number of top log-probabilities to return per *prompt* position
      (``None`` = none; 0 = only the prompt token's). ``RequestOutput.prompt_logprobs`` then
      holds ``None`` for the first prompt token and, per later position, ``{token_id:
      Logprob}`` with the top ``prompt_logprobs`` tokens plus the actual prompt token: the
      model's log-softmax at that position (no penalties, temperature 1). A request asking for
      them does not reuse prefix-cache blocks for the positions it still needs (their logits
      are computed; its own blocks are still cached for later requests).
    - ``logit_bias``: token id -> additive bias in [-100, 100].
    - ``cache_prefix``: the request's computed full KV blocks enter the prefix cache and it
      reuses cached ones even when the engine runs without ``enable_prefix_caching`` (with it,
      every request does). Beam search sets it: each step's beams are new one-token requests
      that continue their parents' blocks instead of prefilling prompt and beam again.
    - ``structured_outputs``: a ``StructuredOutputsParams`` constraint (JSON schema, regex,
      choice, grammar): every sampled token keeps the output a prefix of a string the
      constraint accepts, and EOS is allowed only where it accepts. Not combinable with
      ``min_tokens`` (the grammar decides where the output may end).
    - ``best_of``: sample this many completions (>= ``n``) and return the ``n`` with the
      highest ``cumulative_logprob`` (vLLM V0's semantics; None = ``n``). While a request
      streams, its outputs show the ``n`` best so far.
    - ``bad_words``: words never generated. Each word's token sequence, tokenized as given and
      with a leading space, is banned: its last token is masked whenever the output so far
      ends with the tokens before it (a one-token word is always masked).
    - ``allowed_token_ids``: only these token ids may be sampled (a non-empty list; ids must
      be in the model's vocabulary, checked at ``add_request``).
    - ``truncate_prompt_tokens``: keep only the last ``k`` prompt tokens (``k >= 1``, at most
      ``max_model_len``; -1 = ``max_model_len``).
    - ``detokenize``: False skips detokenization: outputs carry token ids, their text stays
      ``""`` (and logprobs have no ``decoded_token``); ``stop`` strings then cannot be
      matched, so they are refused.
    - ``output_kind``: a ``RequestOutputKind`` (streaming shape of the outputs; ``LLM.generate``
      returns finished requests whatever it is).

    Every numeric field also has an upper bound the engine can represent (int64 for ints that
    become tensors, finite float32 for floats): ``kvserve.field_limits.LIMITS``, the same
    limits the HTTP schema enforces.

    Raises:
        ValueError: naming the field and the allowed range, for any invalid value.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    cache_prefix: bool = False
    best_of: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: ``bad_words`` as token sequences (``engine.input_processor.bad_words_token_ids``), set by
    #: the engine when it validates the request with its tokenizer; None until then.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, compare=False, repr=False)
    #: Per-request tensors the sampler derives once from the fields above (masks), by key.
    sampler_cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}."
            )
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}."
            )
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if isinstance(self.bad_words, str):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}.")
            if value is not None:
                setattr(self, name, list(value))
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except (ValueError, TypeError):
                raise ValueError(
                    "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                    f"got {self.output_kind!r}."
                ) from None
        self._verify()

    @staticmethod
    def _normalize_logit_bias(bias) -> dict:
        """``{token id: bias}`` with int keys; string keys (JSON) must be decimal integers."""
        if not isinstance(bias, dict):
            raise ValueError(
                f"logit_bias must be a map of token id -> number in [-100, 100], got {type(bias).__name__}."
            )
        out = {}
        keys: dict[int, Any] = {}
        for k, v in bias.items():
            try:
                t = _as_token_id(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}.") from None
            if t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}.")
            if t in out:
                # "5" and "05" (or 5 and "5") name one token: which bias would win is arbitrary
                raise ValueError(f"logit_bias names token {t} twice (keys {keys[t]!r} and {k!r}).")
            out[t] = v
            keys[t] = k
        return out

    def _verify(self) -> None:
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "cache_prefix",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        # Every numeric field against its one limit (``field_limits.LIMITS``, shared with the
        # HTTP schema): right kind, within a range the engine can represent.
        for name in _NUMERIC_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if not LIMITS[name].ok(value):
                optional = " (or None)" if name in _OPTIONAL_FIELDS else ""
                raise ValueError(f"{name} must be {LIMITS[name].rule()}{optional}, got {value!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}."
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}.")
        if self.best_of is not None and self.best_of > self.n and self.temperature < GREEDY_EPS:
            raise ValueError(
                f"best_of ({self.best_of}) > n ({self.n}) needs sampling (temperature > 0): greedy "
                "completions are all the same, so there is nothing to choose from."
            )
        # lists since __post_init__
        stop = self.stop or []
        stop_token_ids = self.stop_token_ids or []
        check_count("stop", len(stop))
        check_count("stop_token_ids", len(stop_token_ids))
        if self.logit_bias:
            check_count("logit_bias", len(self.logit_bias))
        if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters each.")
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}."
            )
        token_id = LIMITS["token_id"]
        if not all(token_id.ok(t) for t in stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be token ids ({token_id.rule()}), got {self.stop_token_ids!r}."
            )
        if not self.detokenize and stop:
            raise ValueError(
                "stop strings need detokenize=True (they are matched in the decoded text); use "
                "stop_token_ids, or leave detokenize on."
            )
        self._verify_token_lists(token_id)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}."
                )
            if self.min_tokens > 0:
                raise ValueError(
                    f"min_tokens must be 0 with {self.structured_outputs.origin} (the grammar decides "
                    f"where the output may end), got {self.min_tokens}."
                )
        if self.logit_bias:
            bias = LIMITS["logit_bias"]
            for k, v in self.logit_bias.items():
                if not token_id.ok(k):
                    raise ValueError(f"logit_bias keys must be token ids ({token_id.rule()}), got {k!r}.")
                if not bias.ok(v):
                    raise ValueError(f"logit_bias values must be {bias.rule()}, got {v!r} for token {k!r}.")

    def _verify_token_lists(self, token_id) -> None:
        """``bad_words`` and ``allowed_token_ids`` (vocabulary bounds: ``validate_request``)."""
        if self.bad_words is not None:
            check_count("bad_words", len(self.bad_words))
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must be non-empty strings, got {w!r}.")
                if len(w) > MAX_BAD_WORD_CHARS:
                    raise ValueError(f"bad_words must be at most {MAX_BAD_WORD_CHARS} characters each.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token).")
            check_count("allowed_token_ids", len(self.allowed_token_ids))
            bad = [t for t in self.allowed_token_ids if not token_id.ok(t)]
            if bad:
                raise ValueError(f"allowed_token_ids must be token ids ({token_id.rule()}), got {bad[:5]!r}.")

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else max(self.n, self.best_of)

    @property
    def needs_token_masks(self) -> bool:
        """True when ``bad_words`` or ``allowed_token_ids`` restrict the tokens."""
        return bool(self.bad_words) or self.allowed_token_ids is not None

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class BeamSearchParams:
    """Settings of ``LLM.beam_search`` (vLLM's names).

    - ``beam_width``: beams kept per step (1..10: each step asks for ``2 * beam_width`` logprobs,
      at most 20).
    - ``max_tokens``: most generated tokens per beam (>= 1).
    - ``length_penalty``: exponent of the generated length that divides a finished hypothesis's
      cumulative logprob (1.0 = average per token; 0 = raw sum; > 0 favours longer outputs).
    - ``ignore_eos``: EOS does not end a beam.
    - ``early_stopping``: ``False`` (transformers' default heuristic), ``True`` (stop once
      ``beam_width`` hypotheses are finished) or ``"never"``.

    Raises:
        ValueError: naming the field and the allowed range.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens", "length_penalty"):
            LIMITS[name].check(name, getattr(self, name))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}.")
        if not (
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"
        ):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.")
