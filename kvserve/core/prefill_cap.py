"""How many prompt tokens a step may carry beside running decodes, so that those decodes are
slowed by at most a set factor (``SchedulerConfig.max_decode_slowdown``).

With chunked prefill every step carries the running decodes plus chunks of prompts, and the
step lasts as long as all of it: a 2,048-token chunk beside eight decodes makes each of their
next tokens wait for the chunk (on a CPU, seconds). Sarathi-Serve (Agrawal et al., OSDI 2024)
sizes the step's token budget offline from a time-between-tokens SLO; here the budget follows
the host as measured, step by step, with a token bucket of time:

- ``decode_s``: the time of a step with no prompt tokens, an exponential moving average over
  such steps (``alpha``), each sample at most twice the estimate (a stall is not a reference);
- the bucket: every step with decodes earns ``(max_slowdown - 1) * decode_s`` seconds, and a
  step with prompt tokens spends what it took beyond ``decode_s``; it holds at most
  ``BUCKET_STEPS`` steps' earnings. Prompt tokens ride beside decodes only while it is
  positive, so over any run of steps the decodes' mean time per token stays within
  ``max_slowdown`` of a decode step (plus one bucket), whatever the estimates below get wrong:
  a step with prompt tokens has a cost of its own beyond its tokens (on CPU the decode-only
  step runs a fused path), which one step alone could not fit in the factor;
- ``token_s``: the time of one prompt token beside decodes, ``(step time - decode_s) / prompt
  tokens`` over steps that carried both (a higher sample replaces it at once, a lower one is
  averaged in), which sizes the chunk: ``bucket / token_s`` tokens, at least ``min_tokens``,
  at most twice the last chunk measured, ``probe_tokens`` before any was.

Only steps that run decodes are capped; a step of prompts alone keeps the whole budget.
"""

from __future__ import annotations

import math

#: The bucket holds at most this many steps' earnings: the longest a single step beside the
#: decodes may be is about that many times their allowed extra.
BUCKET_STEPS = 8


class PrefillCap:
    """Online estimate of the prompt tokens a step may add beside running decodes.

    Args:
        max_slowdown: the most the prompt tokens may slow the decodes beside them on average
            (a factor > 1; 1.5 = their mean time per token rises by at most half).
        min_tokens: the least chunk while the bucket is positive (> 0).
        probe_tokens: the chunk before any mixed step has been measured (> 0).
        alpha: weight of the newest sample in the moving averages, in (0, 1].

    Raises:
        ValueError: a value out of its range, naming it.
    """

    def __init__(
        self, max_slowdown: float, min_tokens: int = 16, probe_tokens: int = 64, alpha: float = 0.25
    ) -> None:
        if not isinstance(max_slowdown, (int, float)) or not 1.0 < max_slowdown < math.inf:
            raise ValueError(f"max_decode_slowdown must be a finite number > 1, got {max_slowdown!r}.")
        if min_tokens < 1 or probe_tokens < 1 or not 0.0 < alpha <= 1.0:
            raise ValueError("min_tokens and probe_tokens must be >= 1 and alpha in (0, 1].")
        self.max_slowdown = float(max_slowdown)
        self.min_tokens = min_tokens
        self.probe_tokens = probe_tokens
        self.alpha = alpha
        self.decode_s: float | None = None  # a step of decodes alone, seconds
        self.token_s: float | None = None  # one prompt token beside them, seconds
        self.bucket = 0.0  # seconds of slowdown the decodes may still take
        self._last_tokens = probe_tokens  # prompt tokens of the last mixed step measured

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, num_prompt_tokens: int, num_decode_seqs: int, seconds: float) -> None:
        """Fold in one step's measurement: ``num_prompt_tokens`` prompt tokens (prefill chunks)
        and ``num_decode_seqs`` decoding sequences took ``seconds`` (wall clock)."""
        if not seconds > 0 or num_decode_seqs <= 0:
            return  # a step of prompts alone says nothing about decodes
        if num_prompt_tokens == 0:
            # a stall (another process, a collection) would lift the reference every later
            # step is allowed against: a sample counts at most twice the current estimate
            sample = seconds if self.decode_s is None else min(seconds, 2 * self.decode_s)
            self.decode_s = self._avg(self.decode_s, sample)
        if self.decode_s is None:
            return
        earned = (self.max_slowdown - 1.0) * self.decode_s
        spent = 0.0
        if num_prompt_tokens:
            spent = max(seconds - self.decode_s, 0.0)
            per = spent / num_prompt_tokens
            # a costlier token is believed at once (the decodes pay for an underestimate),
            # a cheaper one gradually
            self.token_s = per if self.token_s is None or per > self.token_s else self._avg(self.token_s, per)
            self._last_tokens = num_prompt_tokens
        self.bucket = min(self.bucket + earned - spent, BUCKET_STEPS * earned)

    def cap(self) -> int | None:
        """Prompt tokens a step with decodes may carry now (0: none this step); None before
        any decode step has been measured (nothing known to protect yet)."""
        if self.decode_s is None:
            return None
        if self.bucket <= 0:
            return 0
        if self.token_s is None:
            return self.probe_tokens
        grow = 2 * max(self._last_tokens, self.min_tokens)
        if self.token_s <= 0:
            return grow  # prompt tokens measured free so far: grow, and measure again
        return max(self.min_tokens, int(min(self.bucket / self.token_s, grow)))
