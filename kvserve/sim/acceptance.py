"""How many drafts a simulated verification accepts (speculative decoding in ``kvserve
simulate``).

The simulator has no model to verify with, so the ``speculative_config`` of a simulation
carries an acceptance model instead, in one of two forms (keys of the same JSON object,
removed before the rest becomes the engine's ``SpeculativeConfig``):

- ``"acceptance_rate"``: per-position acceptance, as the engine's metrics report it: entry
  ``i`` is the fraction of verifications in which draft ``i+1`` was accepted (so together
  with all drafts before it: non-increasing, each in [0, 1]); a list of
  ``num_speculative_tokens`` numbers (a shorter list means 0 after it). A single number
  ``a`` means every draft is accepted with probability ``a`` given that the ones before it
  were (Leviathan et al. 2023's i.i.d. ``alpha``): entry ``i`` is ``a ** (i + 1)``.
- ``"mean_accepted_len"``: tokens emitted per verification, the engine's *mean accepted
  length* (accepted drafts + the target's own token: 1 = nothing accepted, ``k + 1`` =
  everything), turned into the i.i.d. ``alpha`` with that mean.

``"draft_step_s"`` (optional, seconds, default 0) charges each step that speculates for the
proposer's forwards: ``m`` single-token draft steps (``m`` the most drafts of the step) cost
``m * draft_step_s`` (0 fits n-gram lookup; a draft model's measured step time otherwise).

A simulation drafts ``num_speculative_tokens`` every decode step (fixed k: the engine's
``dynamic`` lengths depend on measured step times, which the acceptance model does not give),
so ``"dynamic": true`` and the n-gram lookup sizes are refused rather than ignored; a
``draft_model``'s ``model`` is never loaded (``draft_step_s`` is its cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import json_object

#: The keys of ``speculative_config`` that belong to the simulator (not the engine).
SIM_KEYS = ("acceptance_rate", "mean_accepted_len", "draft_step_s")

_F = "speculative_config."


def _number(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
        raise ValueError(f"{_F}{name} must be a number in [{lo:g}, {hi:g}], got {v!r}.")
    return float(v)


def alpha_for_mean(mean_accepted_len: float, k: int) -> float:
    """The ``alpha`` in [0, 1] with ``1 + sum_{i=1..k} alpha**i == mean_accepted_len``
    (bisection; the sum grows with alpha)."""
    target = mean_accepted_len - 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class AcceptanceModel:
    """Per-position acceptance of a simulated verification.

    Attributes:
        rates: ``rates[i]`` = probability that drafts ``1 .. i+1`` are all accepted
            (non-increasing, in [0, 1]; ``len`` = ``num_speculative_tokens``).
        draft_step_s: seconds per draft forward (see the module docstring).
    """

    rates: list[float]
    draft_step_s: float = 0.0

    @classmethod
    def from_config(cls, cfg: dict[str, Any], k: int) -> AcceptanceModel:
        """Read ``acceptance_rate`` / ``mean_accepted_len`` (exactly one) and
        ``draft_step_s`` from ``cfg`` for ``k`` speculative tokens.

        Raises:
            ValueError: neither or both given, or a value out of range (naming the field).
        """
        has_rate, has_mean = "acceptance_rate" in cfg, "mean_accepted_len" in cfg
        if has_rate == has_mean:
            raise ValueError(
                f"a simulation with speculative decoding needs exactly one of {_F}acceptance_rate "
                f"(per-position acceptance) or {_F}mean_accepted_len (tokens per verification)."
            )
        draft_step_s = _number("draft_step_s", cfg.get("draft_step_s", 0.0), 0.0, 3600.0)
        if has_mean:
            mean = _number("mean_accepted_len", cfg["mean_accepted_len"], 1.0, k + 1.0)
            a = alpha_for_mean(mean, k)
            return cls([a ** (i + 1) for i in range(k)], draft_step_s)
        rate = cfg["acceptance_rate"]
        if isinstance(rate, (int, float)) and not isinstance(rate, bool):
            a = _number("acceptance_rate", rate, 0.0, 1.0)
            return cls([a ** (i + 1) for i in range(k)], draft_step_s)
        if not isinstance(rate, list) or not rate or len(rate) > k:
            raise ValueError(
                f"{_F}acceptance_rate must be a number or a list of 1..num_speculative_tokens ({k}) "
                f"numbers, got {rate!r}."
            )
        rates = [_number(f"acceptance_rate[{i}]", r, 0.0, 1.0) for i, r in enumerate(rate)]
        for i in range(1, len(rates)):
            if rates[i] > rates[i - 1]:
                raise ValueError(
                    f"{_F}acceptance_rate must not increase (draft {i + 1} is accepted only with all "
                    f"before it): [{i - 1}]={rates[i - 1]} < [{i}]={rates[i]}."
                )
        return cls(rates + [0.0] * (k - len(rates)), draft_step_s)

    @property
    def mean_accepted_len(self) -> float:
        """Expected tokens per verification of all ``k`` drafts: ``1 + sum(rates)``."""
        return 1.0 + sum(self.rates)

    def num_accepted(self, u: float, num_drafts: int) -> int:
        """Accepted drafts of a verification of ``num_drafts`` drafts, given a uniform draw
        ``u`` in [0, 1): ``P(result >= i) = rates[i - 1]``."""
        n = 0
        for r in self.rates[:num_drafts]:
            if u >= r:
                break
            n += 1
        return n


def split_speculative_config(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Split a simulation's ``speculative_config`` (dict, JSON object string or None) into the
    engine's part and the simulator's (``SIM_KEYS``).

    Raises:
        ValueError: not a JSON object.
    """
    value = json_object(value)
    if value is None:
        return None, {}
    engine = {k: v for k, v in value.items() if k not in SIM_KEYS}
    sim = {k: v for k, v in value.items() if k in SIM_KEYS}
    # What the acceptance model stands for may not be given as well: it would be ignored.
    lookup = sorted(k for k in ("prompt_lookup_min", "prompt_lookup_max") if k in engine)
    if lookup:
        raise ValueError(
            f"{_F}{lookup[0]} does not apply to a simulation: no proposer runs, the acceptance model "
            "stands for it"
        )
    if engine.get("dynamic") is True:
        raise ValueError(
            f"{_F}dynamic does not apply to a simulation: it drafts num_speculative_tokens every "
            'decode step (fixed k; give "dynamic": false or leave it out)'
        )
    engine["dynamic"] = False
    return engine, sim
