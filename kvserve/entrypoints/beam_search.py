"""Beam search at the API layer, on top of the engine.

Each step, every live beam of every prompt is submitted as its own request (prompt + the beam's
tokens, ``max_tokens=1``, greedy, ``logprobs = 2 * beam_width``): the engine returns the top
``2 * beam_width`` next-token log-probabilities of each beam. The requests set
``SamplingParams.cache_prefix``, so (whether or not the engine runs with
``enable_prefix_caching``) a beam's re-submission finds its earlier blocks in the prefix cache
(the blocks its parent filled) and a step computes, per beam, only the tokens past its last
cached full block (at most ``block_size``) instead of prompt and beam again.

The selection rule is Hugging Face transformers' beam search (``generate(num_beams=B,
do_sample=False)``), which this module re-states:

* candidates: the ``2B`` best ``(beam, token)`` continuations by cumulative log-probability;
* a candidate that ends (EOS, unless ``ignore_eos``; or the ``max_tokens``-th token) is
  *finished* when it ranks among the first ``B`` candidates, scored
  ``cum_logprob / generated_len ** length_penalty`` (``generated_len`` counts the EOS token),
  and enters the pool of the ``B`` best finished hypotheses, unless the search already knows
  it cannot improve (below);
* the ``B`` best candidates that do not end are the next step's beams;
* the search stops when all candidates end, when ``early_stopping is True`` and the pool holds
  ``B`` hypotheses, or when the best live beam cannot beat the pool's worst: its score
  ``cum / L ** length_penalty`` with ``L`` the current length (``early_stopping`` False) or
  ``max_tokens`` (``"never"`` with a positive ``length_penalty``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import BeamSearchParams, SamplingParams
from kvserve.sequence import Logprob


def length_penalized(cum_logprob: float, length: int, length_penalty: float) -> tuple[float, float]:
    """The score ``cum_logprob / length ** length_penalty`` of a hypothesis (Hugging Face
    transformers' and vLLM's), and its rank key.

    The score is computed as transformers does wherever that is finite and nonzero (so scores
    and ties are the same); where ``length ** length_penalty`` or the quotient over- or
    underflows (``|length_penalty|`` up to float32's largest, the field's allowed range) it
    saturates to ``-0.0`` / ``-inf`` instead of raising ``OverflowError`` /
    ``ZeroDivisionError``. The key is ``(score, tie-break)``: for a saturated score the
    tie-break is ``length_penalty * ln(length) - ln(-cum_logprob)``, a strictly increasing
    function of the true score that float64 holds for every allowed value, so hypotheses whose
    scores saturated to the same value still rank as their true scores do; ``cum_logprob = 0``
    (score exactly 0, the best possible) gets ``+inf``; any other score gets 0.

    Args:
        cum_logprob: summed log-probability of the generated tokens (<= 0, may be ``-inf``).
        length: generated tokens (>= 1).
        length_penalty: the exponent (finite).

    Returns:
        The rank key ``(score, tie-break)``: its first member is the score; a larger key is a
        better hypothesis.
    """
    try:
        denom = float(length) ** length_penalty
    except OverflowError:
        denom = math.inf
    if cum_logprob == 0.0:
        score = 0.0
    elif denom == 0.0 or cum_logprob == -math.inf:  # (-inf / inf would be NaN)
        score = -math.inf
    else:
        score = cum_logprob / denom
    if cum_logprob == 0.0:
        tie_break = math.inf
    elif score == 0.0 or score == -math.inf:
        tie_break = length_penalty * math.log(length) - math.log(-cum_logprob)
    else:
        tie_break = 0.0
    return score, tie_break


@dataclass
class BeamSearchSequence:
    """One finished hypothesis: ``tokens`` = prompt + generated ids (vLLM's shape),
    ``output_token_ids`` the generated ones, ``cum_logprob`` their summed logprob, ``score``
    the length-penalised one, ``text`` the generated text, ``finish_reason`` ``stop`` (EOS)
    or ``length``; ``logprobs`` per generated token, the ``{token_id: Logprob}`` of the
    ``2 * beam_width`` candidates its step weighed; ``orig_prompt`` the prompt as given.
    ``stop_reason`` and ``lora_request`` are None (vLLM's fields: beam search has no stop
    strings or adapters here)."""

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    orig_prompt: Any = None
    stop_reason: None = None
    lora_request: None = None


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt, best first (``beam_width`` of them, fewer only when the
    search could not fill its pool)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    tokens: list[int]  # generated
    cum: float
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token


@dataclass
class BeamSearch:
    """The search state of one prompt; drive it with ``pending()`` / ``advance()``.

    Args:
        prompt_token_ids: the prompt.
        params: the search settings.
        eos_token_id: the model's EOS (None: only ``max_tokens`` ends a beam).
        max_tokens: the effective limit (``params.max_tokens`` capped by the model length).
    """

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_id: int | None
    max_tokens: int
    beams: list[_Beam] = field(default_factory=list)
    #: ``(rank key, score, beam, finish reason)``, best first (``length_penalized``)
    finished: list[tuple[tuple[float, float], float, _Beam, str]] = field(default_factory=list)
    done: bool = False
    _improvable: bool = True

    def __post_init__(self) -> None:
        self.beams = [_Beam([], 0.0)]

    def pending(self) -> list[list[int]]:
        """Token ids to submit this step: one sequence per live beam (empty when done)."""
        return [] if self.done else [self.prompt_token_ids + b.tokens for b in self.beams]

    def sampling_params(self) -> SamplingParams:
        """What each beam's one-token request asks the engine for (``cache_prefix``: it reuses
        the blocks of its parent's request)."""
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            logprobs=2 * self.params.beam_width,
            cache_prefix=True,
        )

    def advance(self, top_logprobs: list[dict[int, Logprob]]) -> None:
        """One step: ``top_logprobs[i]`` are beam ``i``'s next-token logprobs (the top
        ``2 * beam_width`` at least, as a step's ``CompletionOutput.logprobs[0]``)."""
        B = self.params.beam_width
        lp = self.params.length_penalty
        cands = sorted(
            (
                (beam.cum + v.logprob, i, t)
                for i, (beam, top) in enumerate(zip(self.beams, top_logprobs))
                for t, v in top.items()
            ),
            key=lambda c: -c[0],
        )[: 2 * B]
        new_len = len(self.beams[0].tokens) + 1
        at_limit = new_len >= self.max_tokens
        pool_full = len(self.finished) >= B
        live: list[_Beam] = []
        for rank, (cum, i, t) in enumerate(cands):
            ends = at_limit or (t == self.eos_token_id and not self.params.ignore_eos)
            parent = self.beams[i]
            beam = _Beam(parent.tokens + [t], cum, parent.logprobs + [top_logprobs[i]])
            if not ends:
                if len(live) < B:
                    live.append(beam)
                continue
            if rank >= B or not self._improvable or (pool_full and self.params.early_stopping is True):
                continue
            reason = "stop" if (t == self.eos_token_id and not self.params.ignore_eos) else "length"
            key = length_penalized(cum, new_len, lp)
            self.finished.append((key, key[0], beam, reason))
        self.finished.sort(key=lambda f: f[0], reverse=True)
        del self.finished[B:]
        self.beams = live
        if not live:
            self.done = True
            return
        # Can a live beam still beat the pool's worst hypothesis?
        if len(self.finished) >= B:
            if self.params.early_stopping == "never" and lp > 0:
                best_len = self.max_tokens
            else:
                best_len = new_len
            best_possible = length_penalized(live[0].cum, best_len, lp)
            self._improvable = self._improvable and best_possible > self.finished[-1][0]
        if not self._improvable or (self.params.early_stopping is True and len(self.finished) >= B):
            self.done = True

    def output(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The finished hypotheses, best first."""
        seqs = [
            BeamSearchSequence(
                tokens=self.prompt_token_ids + b.tokens,
                output_token_ids=list(b.tokens),
                cum_logprob=b.cum,
                score=score,
                finish_reason=reason,
                text=decode(b.tokens) if decode is not None else "",
                logprobs=b.logprobs,
            )
            for _, score, b, reason in self.finished
        ]
        return BeamSearchOutput(seqs)
