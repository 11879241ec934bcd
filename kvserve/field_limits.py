"""The allowed range of every numeric request field, defined once.

``SamplingParams`` (offline API) checks its fields against ``LIMITS``; the HTTP schema
(``entrypoints/openai/protocol.py``) builds its pydantic constraints (``Field(ge=..., le=...)``)
and the rule texts of its 400s from the same entries, so both name the same limits. Every bound
is one the engine can represent: integers that become int64 tensors fit int64 (``seed`` takes
what ``torch.Generator.manual_seed`` takes), floats are finite and within float32 (the sampler's
dtype). Limits that depend on the engine (``n`` vs ``max_num_seqs``, ``top_k`` and token ids vs
the vocabulary, ``max_tokens`` and ``min_tokens`` vs ``max_model_len``) are checked by
``LLMEngine.validate`` / ``validate_request``.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
#: The largest finite float32 (the sampler computes in float32).
FLOAT32_MAX = 3.4028234663852886e38
#: Most top log-probabilities a request may ask for per token.
MAX_LOGPROBS = 20

#: Smallest repetition_penalty (see LIMITS).
MIN_REPETITION_PENALTY = 1e-6
#: Most entries of the list-valued fields. Each is scanned per step or per token for every
#: sequence of the request, so an unbounded list slows every request in the batch; past these
#: it is a 400.
#: ``prompt``: prompts of one /v1/completions request (each becomes an engine request).
#: ``allowed_token_ids`` becomes a mask once per request (not scanned per step): a vocabulary's worth.
MAX_ITEMS = {
    "stop": 64,
    "stop_token_ids": 1024,
    "logit_bias": 1024,
    "prompt": 1024,
    "bad_words": 256,
    "allowed_token_ids": 262_144,
}
#: Longest ``bad_words`` entry, in characters.
MAX_BAD_WORD_CHARS = 1024
#: Longest stop string, in characters (a stream holds back that many characters).
MAX_STOP_CHARS = 1024
#: Longest tenant name (the OpenAI ``user`` field), in characters: the ``fair`` policy keeps a
#: counter per tenant name and /metrics may show it as a label.
MAX_TENANT_CHARS = 256

_NAMED: dict[float, str] = {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1", UINT64_MAX: "2**64 - 1"}


def _fmt(v: float) -> str:
    return _NAMED.get(v, repr(v))


@dataclass(frozen=True)
class Limit:
    """A closed or half-open range for one numeric field.

    Attributes:
        integer: True for an int field (bools never count as numbers), False for a finite real.
        lo / hi: the bounds; ``lo_open``: ``lo`` itself excluded.
        special: values allowed outside the range (``top_k = -1``: disabled), with ``meaning``.
    """

    integer: bool
    lo: float
    hi: float
    lo_open: bool = False
    special: tuple[int, ...] = ()
    meaning: str = ""

    def rule(self) -> str:
        """``"an integer in [1, 2**63 - 1]"``, ``"a finite number in (0, 1]"``, ..."""
        kind = "an integer" if self.integer else "a finite number"
        text = f"{kind} in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}]"
        if self.special:
            text = " or ".join(f"{s} ({self.meaning})" for s in self.special) + " or " + text
        return text

    def ok(self, value) -> bool:
        """Whether ``value`` is of the right kind and within the range (or special)."""
        if isinstance(value, bool):
            return False
        if self.integer:
            if not isinstance(value, int):
                return False
            if value in self.special:
                return True
        elif not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above_lo = value > self.lo if self.lo_open else value >= self.lo
        return above_lo and value <= self.hi

    def check(self, name: str, value) -> None:
        """Raises ValueError ``"<name> must be <rule>, got <value>."`` unless ``ok(value)``."""
        if not self.ok(value):
            raise ValueError(f"{name} must be {self.rule()}, got {value!r}.")

    def pydantic_bounds(self) -> dict:
        """``Field`` keyword arguments: the range widened to the special values (pydantic
        checks the representable range; the gap, e.g. ``top_k = 0``, is SamplingParams')."""
        lo = min([self.lo, *self.special])
        lower = {"gt": lo} if self.lo_open and not self.special else {"ge": lo}
        return {**lower, "le": self.hi}


_COUNT = Limit(True, 1, INT64_MAX)
_TOKEN_ID = Limit(True, 0, INT64_MAX)

#: Field name -> its limit. ``token_id``: one token id (``stop_token_ids`` items,
#: ``logit_bias`` keys, prompt ids); ``logit_bias``: one bias value.
LIMITS: dict[str, Limit] = {
    "n": _COUNT,
    "best_of": _COUNT,
    "max_tokens": _COUNT,
    "max_completion_tokens": _COUNT,
    "min_tokens": Limit(True, 0, INT64_MAX),
    "top_k": Limit(True, 1, INT64_MAX, special=(-1,), meaning="disable"),
    # the engine holds it to max_model_len
    "truncate_prompt_tokens": Limit(True, 1, INT64_MAX, special=(-1,), meaning="max_model_len"),
    "seed": Limit(True, INT64_MIN, UINT64_MAX),
    "priority": Limit(True, INT64_MIN, INT64_MAX),
    "logprobs": Limit(True, 0, MAX_LOGPROBS),
    "top_logprobs": Limit(True, 0, MAX_LOGPROBS),
    "prompt_logprobs": Limit(True, 0, MAX_LOGPROBS),
    "beam_width": Limit(True, 1, MAX_LOGPROBS // 2),
    "length_penalty": Limit(False, -FLOAT32_MAX, FLOAT32_MAX),
    "temperature": Limit(False, 0.0, FLOAT32_MAX),
    "top_p": Limit(False, 0.0, 1.0, lo_open=True),
    "min_p": Limit(False, 0.0, 1.0),
    # below ~1e-30 the float32 sampler divides logits to inf (NaN after softmax); 1e-6 keeps a
    # wide margin and is already "always repeat"
    "repetition_penalty": Limit(False, MIN_REPETITION_PENALTY, FLOAT32_MAX),
    "presence_penalty": Limit(False, -2.0, 2.0),
    "frequency_penalty": Limit(False, -2.0, 2.0),
    "logit_bias": Limit(False, -100.0, 100.0),
    "token_id": _TOKEN_ID,
}


def tenant_name_problem(name: str, tenant: str) -> str | None:
    """Why the tenant name ``tenant`` is refused (a message naming ``name``), or None.

    At most ``MAX_TENANT_CHARS`` characters, none of them a control character (Unicode
    category Cc: C0, DEL, C1) or a lone surrogate: the name becomes a Prometheus label value
    and a field of the request log, where such characters would break a line or the encoding.
    The message gives the first bad character's position and code point, never the name.
    """
    if len(tenant) > MAX_TENANT_CHARS:
        return f"{name} must be at most {MAX_TENANT_CHARS} characters, got {len(tenant)}."
    for i, ch in enumerate(tenant):
        if unicodedata.category(ch) in ("Cc", "Cs"):
            what = "a lone surrogate" if unicodedata.category(ch) == "Cs" else "a control character"
            return (
                f"{name} must not contain control characters or lone surrogates; "
                f"got {what} (U+{ord(ch):04X}) at index {i}."
            )
    return None


def check_tenant(name: str, tenant: object) -> None:
    """Raises ValueError naming ``name`` unless ``tenant`` is None or a string that
    ``tenant_name_problem`` accepts (at most ``MAX_TENANT_CHARS`` characters, no control
    characters or lone surrogates)."""
    if tenant is None:
        return
    if not isinstance(tenant, str):
        raise ValueError(f"{name} must be a string or None, got {type(tenant).__name__}.")
    problem = tenant_name_problem(name, tenant)
    if problem is not None:
        raise ValueError(problem)


def check_count(name: str, n: int) -> None:
    """Raises ValueError ``"<name> must have at most <limit> entries, got <n>."`` past
    ``MAX_ITEMS[name]``."""
    if n > MAX_ITEMS[name]:
        raise ValueError(f"{name} must have at most {MAX_ITEMS[name]} entries, got {n}.")


# Size caps of one request: an HTTP request with all of its prompts, an offline engine request
# (``LLM.generate`` queues one per prompt), or one ``LLM.beam_search`` call. Each bounds work
# that grows with a product of fields that are each within their own limit.
#: Most sequences one request runs: prompts x ``n`` (each sample decodes every step and holds
#: its own KV blocks), and prompts x ``best_of`` for beam search (every beam is a sequence).
MAX_REQUEST_SEQUENCES = 1024
#: Most prompt-logprob entries one request asks for: over its prompts, the positions that score
#: a next prompt token (prompt tokens - 1) x (``prompt_logprobs`` + 1: the top ones plus the
#: prompt token). 2**18 holds prompt_logprobs 20 on an 8,192-token prompt (172,032) or on a dozen
#: 1,000-token prompts; each entry is a Python object and ~50 bytes of JSON in the response.
MAX_PROMPT_LOGPROB_ENTRIES = 2**18
#: Modelled cost of one prompt-logprob position, in prefill tokens: its row of the LM head
#: (vocabulary x hidden multiply-adds, a quarter to a half of a small model's per-token work) and
#: the log-softmax, rank and top-k passes over the vocabulary; 1 rounds that up.
PROMPT_LOGPROB_ROW_COST = 1
#: Most modelled prefill work one request may queue, in prefill-token equivalents
#: (``prefill_cost``): the requests queued behind it wait for at most this much prefill of it
#: (at a prefill rate of R tokens/s, 2**17 / R seconds). 2**17 holds 1,024 prompts of 128
#: tokens, 16 prompts of 8,192, or one prompt of 65,536 tokens with prompt logprobs (131,072
#: without); a larger batch is split into several requests.
MAX_REQUEST_PREFILL_COST = 2**17


def prompt_logprob_entries(prompt_lens: list[int], prompt_logprobs: int | None) -> int:
    """Prompt-logprob entries of a request (see ``MAX_PROMPT_LOGPROB_ENTRIES``); 0 without
    ``prompt_logprobs``."""
    if prompt_logprobs is None:
        return 0
    return sum(max(0, n - 1) for n in prompt_lens) * (prompt_logprobs + 1)


def prefill_cost(prompt_lens: list[int], prompt_logprobs: int | None) -> int:
    """Modelled prefill work of a request, in prefill-token equivalents: its prompt tokens,
    plus ``PROMPT_LOGPROB_ROW_COST`` per prompt-logprob position. ``n`` does not multiply it
    (a prompt is prefilled once and its samples fork its blocks)."""
    rows = 0 if prompt_logprobs is None else sum(max(0, n - 1) for n in prompt_lens)
    return sum(prompt_lens) + rows * PROMPT_LOGPROB_ROW_COST


def check_request_size(
    prompt_lens: list[int], n: int = 1, prompt_logprobs: int | None = None, best_of: int | None = None
) -> None:
    """Holds one request to ``MAX_REQUEST_SEQUENCES``, ``MAX_PROMPT_LOGPROB_ENTRIES`` and
    ``MAX_REQUEST_PREFILL_COST``.

    Args:
        prompt_lens: the token count of each of its prompts.
        n: samples per prompt; best_of: beams per prompt (beam search), or None.
        prompt_logprobs: the request's ``prompt_logprobs`` (None: none asked for).

    Raises:
        ValueError: whose message starts with the field (``n``, ``best_of``, ``prompt_logprobs``
            or ``prompt``) and names the limit and the request's value.
    """
    prompts = len(prompt_lens)
    for name, width in (("n", n), ("best_of", best_of)):
        if width is not None and prompts * width > MAX_REQUEST_SEQUENCES:
            raise ValueError(
                f"{name} x prompts must be at most {MAX_REQUEST_SEQUENCES} sequences per request, got "
                f"{name}={width} x {prompts} prompt(s) = {prompts * width}."
            )
    entries = prompt_logprob_entries(prompt_lens, prompt_logprobs)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(
            f"prompt_logprobs must ask for at most {MAX_PROMPT_LOGPROB_ENTRIES} entries per request "
            f"((prompt tokens - 1) x (prompt_logprobs + 1), over its prompts), got {entries} "
            f"(prompt_logprobs={prompt_logprobs}, {sum(prompt_lens)} prompt tokens)."
        )
    cost = prefill_cost(prompt_lens, prompt_logprobs)
    if cost > MAX_REQUEST_PREFILL_COST:
        raise ValueError(
            f"prompt must be at most {MAX_REQUEST_PREFILL_COST} prefill tokens per request (prompt "
            f"tokens over its prompts, plus {PROMPT_LOGPROB_ROW_COST} per prompt-logprob position), "
            f"got {cost}; split the prompts over several requests."
        )


#: Longest LoRA adapter name, in characters.
MAX_LORA_NAME_CHARS = 128
#: The rule of a LoRA adapter name, as error messages state it.
LORA_NAME_RULE = (
    f"1 to {MAX_LORA_NAME_CHARS} characters of A-Z, a-z, 0-9, '.', '_', ':', '/' or '-', "
    "with no '..' path segment"
)
# A name is a model id clients send and logs print: a small character set keeps it free of
# control characters (log lines forged with newlines), NUL and whitespace, and without ".."
# segments it can never be read as a path out of a directory.
_LORA_NAME = re.compile(rf"[A-Za-z0-9._:/-]{{1,{MAX_LORA_NAME_CHARS}}}")


def lora_name_ok(name) -> bool:
    """Whether ``name`` is a valid LoRA adapter name (``LORA_NAME_RULE``)."""
    return isinstance(name, str) and _LORA_NAME.fullmatch(name) is not None and ".." not in name.split("/")


def check_lora_name(field: str, name) -> None:
    """Raises ValueError ``"<field> must be <LORA_NAME_RULE>, got <name>."`` (the name quoted
    and cut to 64 characters) unless ``lora_name_ok(name)``."""
    if not lora_name_ok(name):
        shown = (
            repr(name)
            if not isinstance(name, str) or len(name) <= 64
            else f"{name[:64]!r}... ({len(name)} characters)"
        )
        raise ValueError(f"{field} must be {LORA_NAME_RULE}, got {shown}.")
