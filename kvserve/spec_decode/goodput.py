"""Goodput-driven draft lengths: per step, how many of its lookahead slots each speculating
sequence fills (the idea of SmartSpec: Liu et al. 2024, "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput").

Three pieces, each pure Python and device-free:

- ``StepCostModel``: seconds of a target forward with ``R`` query rows, learned online from
  the step times the worker sees (an EMA per row-count bucket; between observed buckets linear
  interpolation; outside them a least-squares slope, or a prior slope relative to the cheapest
  observed step before there are two buckets).
- ``AcceptanceEstimator``: per sequence, the probability that each next draft is accepted
  given the ones before it were (a geometric model), from that sequence's decayed counts,
  shrunk towards a prior per proposer and per n-gram match length (itself learned online over
  all sequences: a longer match is likelier to be accepted).
- ``allocate_draft_lengths``: the ``k_i`` maximising expected tokens per second
  ``sum_i (1 + sum_{j<=k_i} p_i^j) / (cost(R0 + sum_i k_i) + depth_cost * max_i k_i)``:
  drafts are added in order of marginal gain ``p_i^(k_i+1)`` (the best first) and the best
  prefix of that order wins (robust to a cost curve that is not convex).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence

__all__ = [
    "AcceptanceEstimator",
    "DraftCandidate",
    "StepCostModel",
    "allocate_draft_lengths",
    "expected_tokens",
]


@dataclasses.dataclass(frozen=True)
class DraftCandidate:
    """One speculating sequence of a step, as the allocator sees it.

    Attributes:
        seq_id: the sequence.
        max_drafts: drafts it may get (``>= 0``): its lookahead slots, capped by the proposal's
            length (n-gram) and by ``max_tokens``.
        p_accept: probability each next draft is accepted given the previous ones were, in
            ``[0, 1]``.
    """

    seq_id: int
    max_drafts: int
    p_accept: float


def expected_tokens(p: float, k: int) -> float:
    """Tokens a verification of ``k`` drafts emits in expectation under a geometric acceptance
    of ``p`` per draft: ``1 + p + p^2 + .. + p^k`` (the ``1``: the target's own token)."""
    total, term = 1.0, 1.0
    for _ in range(max(0, k)):
        term *= p
        total += term
    return total


def allocate_draft_lengths(
    candidates: Sequence[DraftCandidate],
    base_rows: int,
    cost: Callable[[int], float],
    depth_cost: float = 0.0,
    max_total: int | None = None,
    explore_extra: int = 0,
) -> dict[int, int]:
    """Draft lengths maximising expected emitted tokens per second of the step.

    Args:
        candidates: the step's speculating sequences (at most one entry per ``seq_id``).
        base_rows: query rows of the step without any draft (prefill chunk tokens plus one
            per decode), ``>= 0``.
        cost: seconds of a forward with ``R`` rows (``R >= base_rows``); must be positive.
        depth_cost: seconds per draft position of a sequential proposer (a draft model runs
            ``max_i k_i`` forwards); 0 for n-gram lookup.
        max_total: most drafts in all (None: no cap beyond each ``max_drafts``).
        explore_extra: this many further drafts past the best prefix (the next in gain
            order), so the cost of more rows gets measured; 0 on ordinary steps.

    Returns:
        seq_id -> ``k_i`` with ``0 <= k_i <= max_drafts`` for every candidate (0 included).
        Deterministic: a pure function of the arguments (ties go to the earlier candidate).
    """
    ks = {c.seq_id: 0 for c in candidates}
    if not candidates:
        return ks
    # Every draft in order of marginal gain: the j-th draft of sequence i adds p_i^j; since
    # p^j falls with j, the order is consistent with each sequence's drafts in turn.
    steps: list[tuple[float, int, int]] = []  # (-gain, candidate index, j)
    for idx, c in enumerate(candidates):
        p = min(max(float(c.p_accept), 0.0), 1.0)
        g = 1.0
        for j in range(1, max(0, int(c.max_drafts)) + 1):
            g *= p
            steps.append((-g, idx, j))
    steps.sort()
    if max_total is not None:
        steps = steps[: max(0, int(max_total))]
    n_seq = len(candidates)
    tokens = float(n_seq)
    best_ratio = tokens / max(cost(base_rows), 1e-12)
    best_len = 0
    depth = 0
    per_idx = [0] * n_seq
    for n, (neg_g, idx, j) in enumerate(steps, start=1):
        tokens -= neg_g
        per_idx[idx] = j
        depth = max(depth, j)
        c = cost(base_rows + n) + depth_cost * depth
        ratio = tokens / max(c, 1e-12)
        if ratio > best_ratio * (1.0 + 1e-9):
            best_ratio, best_len = ratio, n
    for _, idx, j in steps[: best_len + max(0, int(explore_extra))]:
        sid = candidates[idx].seq_id
        ks[sid] = max(ks[sid], j)
    return ks


def _bucket(rows: int) -> int:
    """Row-count bucket key: exact up to 128 rows, then 16 buckets per doubling."""
    if rows <= 128:
        return rows
    shift = rows.bit_length() - 5
    return (rows >> shift) << shift


class StepCostModel:
    """Seconds of a target forward by query rows, learned online.

    Args:
        prior_base_s: seconds of a one-row step before anything is observed.
        prior_row_fraction: extra cost per row relative to the cheapest observed step, until
            two buckets give a slope (a memory-bound decode: a few percent per row).
        ema: weight of a new observation in its bucket (0 < ema <= 1).

    ``cost(R)`` is positive and non-decreasing in ``R`` (a noisy bucket never makes more rows
    look cheaper than fewer: the estimate is the running maximum over buckets at or below R).
    """

    def __init__(self, prior_base_s: float = 0.02, prior_row_fraction: float = 0.05, ema: float = 0.2):
        if not prior_base_s > 0 or not prior_row_fraction >= 0 or not 0 < ema <= 1:
            raise ValueError(
                f"need prior_base_s > 0, prior_row_fraction >= 0, 0 < ema <= 1; got "
                f"{prior_base_s}, {prior_row_fraction}, {ema}"
            )
        self.prior_base_s = prior_base_s
        self.prior_row_fraction = prior_row_fraction
        self.ema = ema
        self._keys: list[int] = []  # sorted bucket keys
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._slope: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        """Record a forward of ``rows`` query rows that took ``seconds`` (ignored unless both
        are positive and finite)."""
        if rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        key = _bucket(rows)
        if key not in self._mean:
            bisect.insort(self._keys, key)
            self._mean[key] = seconds
            self._count[key] = 1
        else:
            # The first few samples average plainly, later ones decay (the context grows). A
            # sample far above an established mean (a stall of a shared machine) is clipped.
            if self._count[key] >= 3:
                seconds = min(seconds, 2.0 * self._mean[key])
            n = self._count[key] + 1
            w = max(1.0 / n, self.ema)
            self._mean[key] += w * (seconds - self._mean[key])
            self._count[key] = n
        self._slope = None

    def num_buckets(self) -> int:
        """Distinct row-count buckets observed so far."""
        return len(self._keys)

    def is_observed(self, rows: int) -> bool:
        """Whether ``rows``'s bucket has a sample."""
        return _bucket(rows) in self._mean

    def slope(self) -> float:
        """Seconds per extra row: least squares over the bucket means (count-weighted), at
        least 0; before two buckets, ``prior_row_fraction`` times the cheapest step."""
        if self._slope is not None:
            return self._slope
        keys = self._keys
        if len(keys) < 2:
            base = self._mean[keys[0]] if keys else self.prior_base_s
            s = self.prior_row_fraction * base
        else:
            w = [float(self._count[k]) for k in keys]
            sw = sum(w)
            mx = sum(wi * k for wi, k in zip(w, keys)) / sw
            my = sum(wi * self._mean[k] for wi, k in zip(w, keys)) / sw
            sxx = sum(wi * (k - mx) ** 2 for wi, k in zip(w, keys))
            sxy = sum(wi * (k - mx) * (self._mean[k] - my) for wi, k in zip(w, keys))
            s = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
        self._slope = s
        return s

    def cost(self, rows: int) -> float:
        """Estimated seconds of a forward with ``rows`` query rows (``> 0``)."""
        rows = max(1, int(rows))
        keys = self._keys
        if not keys:
            return self.prior_base_s * (1.0 + self.prior_row_fraction * (rows - 1))
        key = _bucket(rows)
        i = bisect.bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            est = self._mean[key]
        elif i == 0:
            est = max(self._mean[keys[0]] - self.slope() * (keys[0] - rows), 1e-9)
        elif i == len(keys):
            lo = keys[-1]
            est = self._mean[lo] + self.slope() * (rows - lo)
        else:
            lo, hi = keys[i - 1], keys[i]
            t = (rows - lo) / (hi - lo)
            est = self._mean[lo] + t * (self._mean[hi] - self._mean[lo])
        # Monotone: never cheaper than a bucket with fewer rows.
        floor = max((self._mean[k] for k in keys[:i]), default=0.0)
        return max(est, floor, 1e-9)


#: Prior per-draft acceptance by n-gram match length (1, 2, 3, >= 4) and for a draft model.
NGRAM_PRIOR = (0.2, 0.45, 0.6, 0.7)
DRAFT_MODEL_PRIOR = 0.6


class AcceptanceEstimator:
    """Per-draft acceptance probability per sequence, shrunk towards a per-class prior.

    A verification of ``m`` drafts of which ``a`` were accepted is ``a`` accepted trials and,
    if ``a < m``, one rejected trial. A sequence keeps counts per class (a 1-gram match of a
    sequence that copies well is still a 1-gram match), decayed by ``decay`` per verification
    of that class (recent behaviour matters most); its estimate is
    ``(A + strength * prior) / (T + strength)`` with ``prior`` the class's pooled rate (class:
    the n-gram match length capped at 4, or 0 for a draft model), itself pooled over all
    sequences from a fixed prior of ``prior_weight`` trials. Capped to ``[0, max_p]``.
    """

    def __init__(
        self,
        class_priors: dict[int, float] | None = None,
        strength: float = 2.0,
        decay: float = 0.9,
        prior_weight: float = 16.0,
        max_p: float = 0.95,
    ):
        if class_priors is None:
            class_priors = {n + 1: p for n, p in enumerate(NGRAM_PRIOR)}
            class_priors[0] = DRAFT_MODEL_PRIOR
        self._class_prior = dict(class_priors)
        self.strength = strength
        self.decay = decay
        self.prior_weight = prior_weight
        self.max_p = max_p
        self._class_counts: dict[int, list[float]] = {}  # class -> [accepted, trials]
        self._seq: dict[tuple[int, int], list[float]] = {}  # (seq_id, class) -> [accepted, trials]

    @staticmethod
    def class_of(match_len: int | None) -> int:
        """The prior class of a proposal: its n-gram match length capped at 4; 0 (a draft
        model) when None."""
        return 0 if match_len is None else max(1, min(int(match_len), 4))

    def class_rate(self, cls: int) -> float:
        """Pooled per-draft acceptance of a class (its fixed prior blended with what was seen)."""
        p0 = self._class_prior.get(cls, DRAFT_MODEL_PRIOR)
        a, t = self._class_counts.get(cls, (0.0, 0.0))
        return (a + self.prior_weight * p0) / (t + self.prior_weight)

    def estimate(self, seq_id: int, match_len: int | None = None) -> float:
        """``seq_id``'s per-draft acceptance probability for a proposal of this class."""
        cls = self.class_of(match_len)
        prior = self.class_rate(cls)
        a, t = self._seq.get((seq_id, cls), (0.0, 0.0))
        return min(max((a + self.strength * prior) / (t + self.strength), 0.0), self.max_p)

    def observe(self, seq_id: int, match_len: int | None, num_drafts: int, num_accepted: int) -> None:
        """Record a verification of ``num_drafts`` drafts of which the first ``num_accepted``
        were accepted (ignored when ``num_drafts < 1``)."""
        if num_drafts < 1:
            return
        a = max(0, min(int(num_accepted), int(num_drafts)))
        trials = a + (1 if a < num_drafts else 0)
        cls = self.class_of(match_len)
        st = self._seq.setdefault((seq_id, cls), [0.0, 0.0])
        st[0] = st[0] * self.decay + a
        st[1] = st[1] * self.decay + trials
        cc = self._class_counts.setdefault(cls, [0.0, 0.0])
        cc[0] += a
        cc[1] += trials

    def free(self, seq_ids) -> None:
        """Forget ended sequences."""
        gone = set(seq_ids)
        if gone:
            for key in [key for key in self._seq if key[0] in gone]:
                del self._seq[key]
