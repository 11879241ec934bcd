"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

#: Temperatures below this are treated as greedy (argmax) decoding.
GREEDY_EPS = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite real number (int or float; never a bool, NaN or infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_token_id(x) -> int:
    """A token id from an int (numpy ints too) or a decimal string (JSON object keys)."""
    if isinstance(x, bool):
        raise TypeError
    if isinstance(x, str):
        if not x.isascii():  # int() would take other scripts' digits ("٣" == 3)
            raise ValueError
        return int(x.strip(), 10)
    return operator.index(x)


#: The range ``torch.Generator.manual_seed`` accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


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
    - ``logit_bias``: token id -> additive bias in [-100, 100].

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
    logit_bias: dict | None = None
    skip_special_tokens: bool = True

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
        self._verify()

    @staticmethod
    def _normalize_logit_bias(bias) -> dict:
        """``{token id: bias}`` with int keys; string keys (JSON) must be decimal integers."""
        if not isinstance(bias, dict):
            raise ValueError(
                f"logit_bias must be a map of token id -> number in [-100, 100], got {type(bias).__name__}."
            )
        out = {}
        for k, v in bias.items():
            try:
                t = _as_token_id(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}.") from None
            if t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}.")
            out[t] = v
        return out

    def _verify(self) -> None:
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}."
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or an integer >= 1, got {self.top_k!r}.")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}."
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}.")
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if not _is_number(v) or not -100 <= v <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k!r}.")

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
