"""How many prompt tokens a step may carry beside running decodes, so that those decodes are
slowed by at most a set factor (``SchedulerConfig.max_decode_slowdown``).

With chunked prefill every step carries the running decodes plus chunks of prompts, and the
step lasts as long as all of it: a 2,048-token chunk beside eight decodes makes each of their
next tokens wait for the chunk (on a CPU, seconds). Sarathi-Serve (Agrawal et al., OSDI 2024)
sizes the step's token budget offline from a time-between-tokens SLO; here the budget follows
the host as measured, step by step:

- ``decode_s``: the time of a step with no prompt tokens, an exponential moving average over
  such steps (``alpha``);
- ``token_s``: the marginal time of one prompt token, ``(step time - decode_s) / prompt tokens``
  over steps that carried both: a higher sample replaces it at once (an underestimate is paid
  by the decodes), a lower one is averaged in;
- the cap: ``(max_slowdown - 1) * decode_s / token_s`` prompt tokens, at least ``min_tokens``
  (a prompt always progresses) and at most twice the prompt tokens of the last mixed step
  measured (a noisy estimate grows the chunk step by step, each step measured, instead of
  letting a whole budget through at once). Before a mixed step has been measured it is
  ``probe_tokens``.

Only steps that run decodes are capped; a step of prompts alone keeps the whole budget.
"""

from __future__ import annotations

import math


class PrefillCap:
    """Online estimate of the prompt tokens a step may add beside running decodes.

    Args:
        max_slowdown: the most a decode step may be slowed by the prompt tokens beside it
            (a factor > 1; 1.5 = a decode's time per token rises by at most half).
        min_tokens: the least cap (> 0), so a long prompt keeps progressing.
        probe_tokens: the cap before any mixed step has been measured (> 0).
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
        self._last_tokens = probe_tokens  # prompt tokens of the last mixed step measured

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, num_prompt_tokens: int, num_decode_seqs: int, seconds: float) -> None:
        """Fold in one step's measurement: ``num_prompt_tokens`` prompt tokens (prefill chunks)
        and ``num_decode_seqs`` decoding sequences took ``seconds`` (wall clock)."""
        if not seconds > 0 or num_decode_seqs <= 0:
            return  # a step of prompts alone says nothing about decodes
        if num_prompt_tokens == 0:
            self.decode_s = self._avg(self.decode_s, seconds)
        elif self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0) / num_prompt_tokens
            # a costlier token is believed at once (the decodes pay for an underestimate),
            # a cheaper one gradually
            self.token_s = (
                extra if self.token_s is None or extra > self.token_s else self._avg(self.token_s, extra)
            )
            self._last_tokens = num_prompt_tokens

    def cap(self) -> int | None:
        """Prompt tokens a step with decodes may carry now; None before any decode step has
        been measured (nothing to protect yet that is known)."""
        if self.decode_s is None:
            return None
        if self.token_s is None:
            return self.probe_tokens
        grow = 2 * max(self._last_tokens, self.min_tokens)
        if self.token_s <= 0:
            return grow  # prompt tokens measured free so far: grow, and measure again
        room = (self.max_slowdown - 1.0) * self.decode_s / self.token_s
        return max(self.min_tokens, min(int(room), grow))
