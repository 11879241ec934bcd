"""Goodput-driven draft lengths: per step, how many of its lookahead slots each speculating
sequence fills (the idea of SmartSpec: Liu et al. 2024, "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput").

Three pieces, each pure Python and device-free:

- ``StepCostModel``: seconds of a target forward with ``R`` query rows, learned online from
  the step times the worker sees: decode-only steps and steps with a prompt chunk apart, one
  set per thread count; per row bucket the lower quartile of its recent samples, and over
  those a convex non-decreasing fit ``a + b R + c max(0, R - R0)`` (``fit_hinge``; with
  ``kink=True`` also a jump at the break, ``fit_kink``).
- ``AcceptanceEstimator``: per sequence, the probability that each next draft is accepted
  given the ones before it were (a geometric model), from that sequence's decayed counts,
  shrunk towards a prior per proposer and per n-gram match length (itself learned online over
  all sequences: a longer match is likelier to be accepted).
- ``allocate_draft_lengths``: the ``k_i`` maximising expected tokens per second
  ``(T + sum_i sum_{j<=k_i} p_i^j) / (cost(R0) + (1 + margin) (cost(R0 + sum_i k_i) -
  cost(R0)) + depth_cost * max_i k_i)`` (``T``: the step's tokens without drafts): drafts are
  added in order of marginal gain ``p_i^(k_i+1)`` (the best first) and the best prefix of that
  order wins (robust to a cost curve that is not convex).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

__all__ = [
    "AcceptanceEstimator",
    "DraftCandidate",
    "StepCostModel",
    "allocate_draft_lengths",
    "expected_tokens",
    "fit_hinge",
    "fit_kink",
    "step_goodput",
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
    margin: float = 0.0,
    base_tokens: float | None = None,
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
        margin: the drafts' extra cost ``cost(base + n) - cost(base)`` is counted
            ``1 + margin`` times (``>= 0``): a safety factor for the cost model's error, so
            drafts that only tie with none are not proposed (free rows stay free).
        base_tokens: tokens the step emits without drafts (every decoding sequence's one,
            those without a candidate too); None: one per candidate. Drafts pay when their
            expected tokens per extra second beat ``base_tokens / cost(base_rows)``, so
            leaving out the sequences without candidates would over-value drafts.

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
    tokens = float(n_seq) if base_tokens is None else max(float(base_tokens), 1e-12)
    base_cost = cost(base_rows)
    factor = 1.0 + max(0.0, float(margin))
    best_ratio = tokens / max(base_cost, 1e-12)
    best_len = 0
    depth = 0
    for n, (neg_g, _idx, j) in enumerate(steps, start=1):
        tokens -= neg_g
        depth = max(depth, j)
        step_cost = base_cost + factor * (cost(base_rows + n) - base_cost) + depth_cost * depth
        ratio = tokens / max(step_cost, 1e-12)
        if ratio > best_ratio * (1.0 + 1e-9):
            best_ratio, best_len = ratio, n
    for _, idx, j in steps[: best_len + max(0, int(explore_extra))]:
        sid = candidates[idx].seq_id
        ks[sid] = max(ks[sid], j)
    return ks


def step_goodput(
    candidates: Sequence[DraftCandidate],
    ks: dict[int, int],
    base_rows: int,
    cost: Callable[[int], float],
    depth_cost: float = 0.0,
    base_tokens: float | None = None,
) -> float:
    """Expected tokens per second of a step with draft lengths ``ks`` (the quantity
    ``allocate_draft_lengths`` maximises, without its margin)."""
    tokens = float(len(candidates)) if base_tokens is None else float(base_tokens)
    depth = 0
    rows = base_rows
    for c in candidates:
        kk = ks.get(c.seq_id, 0)
        tokens += expected_tokens(c.p_accept, kk) - 1.0
        depth = max(depth, kk)
        rows += kk
    return tokens / max(cost(rows) + depth_cost * depth, 1e-12)


def _bucket(rows: int) -> int:
    """Row-count bucket key: exact up to 128 rows, then 16 buckets per doubling."""
    if rows <= 128:
        return rows
    shift = rows.bit_length() - 5
    return (rows >> shift) << shift


#: Samples kept per bucket (the most recent): the bucket's level is their lower quartile.
WINDOW = 8


def fit_hinge(
    points: Sequence[tuple[float, float, float]], breaks: Sequence[float] | None = None
) -> tuple[float, float, float, float]:
    """Weighted least-squares fit of ``y ~ a + b * x + c * max(0, x - x0)`` with
    ``a, b, c >= 0`` (so the curve is positive-sloped, convex and non-decreasing), the
    break ``x0`` chosen among ``breaks`` (default: the points' ``x``) to minimise the error.

    Args:
        points: ``(x, y, weight)`` triples, weight ``> 0`` (for relative error: ``n / y^2``).
        breaks: candidate break points (at most 16 of them are tried, evenly spread).

    Returns:
        ``(a, b, c, x0)``; ``c == 0`` when no break helps (a line), ``b == c == 0`` for one
        distinct ``x``. Empty ``points``: ``(0, 0, 0, 0)``.
    """
    pts = [(float(x), float(y), float(w)) for x, y, w in points if w > 0]
    if not pts:
        return (0.0, 0.0, 0.0, 0.0)
    xs = sorted({p[0] for p in pts})
    cand = list(breaks) if breaks is not None else xs[1:-1]
    if len(cand) > 16:
        step = (len(cand) - 1) / 15
        cand = [cand[round(i * step)] for i in range(16)]
    sw = sum(w for _, _, w in pts)
    # Sums of the normal equations over the features (1, x, h = max(0, x - x0)); those
    # without h do not depend on the break.
    s00 = sw
    s01 = sum(w * x for x, _, w in pts)
    s11 = sum(w * x * x for x, _, w in pts)
    t0 = sum(w * y for _, y, w in pts)
    t1 = sum(w * x * y for x, y, w in pts)
    syy = sum(w * y * y for _, y, w in pts)
    best: tuple[float, tuple[float, float, float, float]] | None = None
    for x0 in [None, *cand]:
        s02 = s12 = s22 = t2 = 0.0
        if x0 is not None:
            for x, y, w in pts:
                if x > x0:
                    h = x - x0
                    wh = w * h
                    s02 += wh
                    s12 += wh * x
                    s22 += wh * h
                    t2 += wh * y
        s = ((s00, s01, s02), (s01, s11, s12), (s02, s12, s22))
        got = _nnls3(s, (t0, t1, t2), syy, _HINGE_SETS if x0 is not None else _LINE_SETS)
        if got is not None and (best is None or got[0] < best[0] - 1e-12 * syy):
            best = (got[0], (*got[1], 0.0 if x0 is None else float(x0)))
    return best[1] if best is not None else (0.0, 0.0, 0.0, 0.0)


def fit_kink(
    points: Sequence[tuple[float, float, float]], breaks: Sequence[float] | None = None
) -> tuple[float, float, float, float, float]:
    """``fit_hinge`` plus a jump at the break: ``y ~ a + b x + [x > x0] (d + c (x - x0))``
    with ``a, b, c, d >= 0`` (non-decreasing; convex only when ``d == 0``). A kernel that
    switches path past ``x0`` rows pays a step there: the CPU GEMM's one-block path (at
    most 8 rows, weights prefetched in software) gives way to its multi-block path at 9
    rows, which costs a jump and then a steady amount per row.

    Returns:
        ``(a, b, c, d, x0)``; ``(0, 0, 0, 0, 0)`` without points.
    """
    pts = [(float(x), float(y), float(w)) for x, y, w in points if w > 0]
    if not pts:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    xs = sorted({p[0] for p in pts})
    cand = list(breaks) if breaks is not None else xs[1:-1]
    if len(cand) > 16:
        step = (len(cand) - 1) / 15
        cand = [cand[round(i * step)] for i in range(16)]
    syy = sum(w * y * y for _, y, w in pts)
    best: tuple[float, tuple[float, float, float, float, float]] | None = None
    for x0 in [None, *cand]:
        feats = [
            (1.0, x, 0.0 if x0 is None or x <= x0 else x - x0, 0.0 if x0 is None or x <= x0 else 1.0)
            for x, _, _ in pts
        ]
        n = 4 if x0 is not None else 2
        s = [[sum(w * f[i] * f[j] for f, (_, _, w) in zip(feats, pts)) for j in range(n)] for i in range(n)]
        t = [sum(w * f[i] * y for f, (_, y, w) in zip(feats, pts)) for i in range(n)]
        for sub in _KINK_SETS if x0 is not None else _LINE_SETS:
            beta = _solve([[s[i][j] for j in sub] for i in sub], [t[i] for i in sub])
            if beta is None or any(v < 0 for v in beta):
                continue
            coef = [0.0] * 4
            for i, v in zip(sub, beta):
                coef[i] = v
            sse = syy - 2 * sum(coef[i] * t[i] for i in range(n))
            sse += sum(coef[i] * s[i][j] * coef[j] for i in range(n) for j in range(n))
            if best is None or sse < best[0] - 1e-12 * syy:
                best = (sse, (coef[0], coef[1], coef[2], coef[3], 0.0 if x0 is None else float(x0)))
    return best[1] if best is not None else (0.0, 0.0, 0.0, 0.0, 0.0)


#: Active sets of ``fit_kink`` (0 = intercept, 1 = x, 2 = hinge, 3 = jump): each keeps the
#: intercept or the slope.
_KINK_SETS = tuple(
    sub for r in range(4, 0, -1) for sub in itertools.combinations(range(4), r) if 0 in sub or 1 in sub
)


def hinge_error(
    points: Sequence[tuple[float, float, float]], fit: tuple[float, float, float, float]
) -> float:
    """Weighted squared error per unit weight of a ``fit_hinge`` result on ``points``."""
    a, b, c, x0 = fit
    sw = sum(w for _, _, w in points if w > 0)
    if sw <= 0:
        return math.inf
    err = sum(w * (y - (a + b * x + c * max(0.0, x - x0))) ** 2 for x, y, w in points if w > 0)
    return err / sw


#: Active sets tried by ``_nnls3`` (feature indices: 0 = intercept, 1 = x, 2 = h). A hinge
#: always keeps the intercept or the slope (a lone hinge would price small steps at 0).
_LINE_SETS = ((0, 1), (0,), (1,))
_HINGE_SETS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,))


def _nnls3(
    s: tuple[tuple[float, float, float], ...],
    t: tuple[float, float, float],
    syy: float,
    subsets: tuple[tuple[int, ...], ...],
) -> tuple[float, tuple[float, float, float]] | None:
    """Non-negative least squares over features ``(1, x, h)`` from the normal equations
    ``s`` (3x3), ``t`` and ``syy`` (sum of weighted squared targets): the best feasible
    unconstrained solution over the active sets ``subsets`` (with every subset: exact NNLS
    for 3 unknowns). Returns ``(sse, (a, b, c))`` or None."""
    best: tuple[float, tuple[float, float, float]] | None = None
    for sub in subsets:
        beta = _solve([[s[i][j] for j in sub] for i in sub], [t[i] for i in sub])
        if beta is None or any(v < 0 for v in beta):
            continue
        coef = [0.0, 0.0, 0.0]
        for i, v in zip(sub, beta):
            coef[i] = v
        # SSE = syy - 2 coef.t + coef.S.coef
        sse = syy - 2 * sum(coef[i] * t[i] for i in range(3))
        sse += sum(coef[i] * s[i][j] * coef[j] for i in range(3) for j in range(3))
        if best is None or sse < best[0] - 1e-12 * syy:
            best = (sse, (coef[0], coef[1], coef[2]))
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0.0:
        return None
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= 1e-12 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    out = [0.0] * n
    for c in range(n - 1, -1, -1):
        out[c] = (m[c][n] - sum(m[c][j] * out[j] for j in range(c + 1, n))) / m[c][c]
    return out


class _Curve:
    """The samples of one step class (decode-only, or with a prompt chunk) under one thread
    regime: a window of recent samples per bucket and the fit over the bucket levels."""

    __slots__ = ("keys", "window", "count", "fit", "stale")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.window: dict[int, list[float]] = {}
        self.count: dict[int, int] = {}
        self.fit: tuple[float, float, float, float, float] | None = None
        self.stale = 0  # observations since the last fit

    def add(self, key: int, seconds: float) -> None:
        win = self.window.get(key)
        if win is None:
            bisect.insort(self.keys, key)
            self.window[key] = [seconds]
            self.count[key] = 1
            self.fit = None  # a new row count: refit at once
            return
        win.append(seconds)
        if len(win) > WINDOW:
            del win[0]
        self.count[key] += 1
        self.stale += 1
        if self.stale >= WINDOW:
            self.fit = None

    def level(self, key: int) -> float:
        win = sorted(self.window[key])
        return win[(len(win) - 1) // 4]

    def params(self, kink: bool) -> tuple[float, float, float, float, float]:
        """``(a, b, c, d, R0)`` of the fit over the bucket levels (``d == 0`` without
        ``kink``: the convex hinge)."""
        if self.fit is None:
            pts = []
            for k in self.keys:
                y = self.level(k)
                pts.append((float(k), y, min(self.count[k], WINDOW) / (y * y)))
            if kink:
                self.fit = fit_kink(pts)
            else:
                a, b, c, x0 = fit_hinge(pts)
                self.fit = (a, b, c, 0.0, x0)
            self.stale = 0
        return self.fit


def _eval_fit(fit: tuple[float, float, float, float, float], rows: int) -> float:
    a, b, c, d, x0 = fit
    past = rows > x0 and (c > 0 or d > 0)
    return a + b * rows + ((d + c * (rows - x0)) if past else 0.0)


class StepCostModel:
    """Seconds of a target forward by query rows, learned online.

    Two step classes are kept apart: decode-only steps (plain decodes and verify chunks: on
    CPU the native decode path, a few rows, weight-bound then compute-bound) and steps with a
    prompt chunk (hundreds of rows on the prefill path, cheaper per row). Interpolating
    between the two made 9-40-row bfloat16 verify steps look cheap. Each class
    keeps, per row bucket, its last ``WINDOW`` samples; the bucket's level is their lower
    quartile (noise on a shared machine only ever adds time), and the cost is a fit of
    ``a + b R + c max(0, R - R0)`` (``fit_hinge``: convex, non-decreasing; ``kink=True``:
    ``fit_kink``, with a jump at the break) over the levels, weighted by samples over squared level (relative error). With one
    bucket the slope is ``prior_row_fraction`` times its level (prompt steps: proportional
    to the rows); with none, the prior (prompt steps: the decode curve). ``set_regime`` keeps one set of curves per thread
    count (a step at 1 thread and at 2 costs differently).

    Args:
        prior_base_s: seconds of a one-row step before anything is observed.
        prior_row_fraction: extra cost per row relative to the one observed bucket, until
            two buckets give a fit (a weight-bound decode: a few percent per row).
        ema: kept for compatibility (unused: the window's quartile replaced the EMA).
        kink: fit a jump at the break too (``fit_kink``: non-decreasing, not convex);
            False (default): the convex hinge only (``fit_hinge``). Why: the kink can put its
            break just below the plain step's row count, so the plain step already pays the
            jump, the drafts are not charged for it and too many get proposed; the hinge
            spreads the jump over the rows past the break.

    ``cost(R)`` is positive and non-decreasing in ``R``.
    """

    def __init__(
        self,
        prior_base_s: float = 0.02,
        prior_row_fraction: float = 0.05,
        ema: float = 0.2,
        kink: bool = False,
    ):
        if not prior_base_s > 0 or not prior_row_fraction >= 0 or not 0 < ema <= 1:
            raise ValueError(
                f"need prior_base_s > 0, prior_row_fraction >= 0, 0 < ema <= 1; got "
                f"{prior_base_s}, {prior_row_fraction}, {ema}"
            )
        self.kink = kink
        self.prior_base_s = prior_base_s
        self.prior_row_fraction = prior_row_fraction
        self.ema = ema
        self.regime: object = 0
        self._curves: dict[tuple[object, bool], _Curve] = {}

    def set_regime(self, regime: object) -> None:
        """Steps from now on run under ``regime`` (the worker's thread count): learned and
        estimated on their own curves."""
        self.regime = regime

    def _curve(self, prefill: bool) -> _Curve:
        key = (self.regime, bool(prefill))
        c = self._curves.get(key)
        if c is None:
            c = self._curves[key] = _Curve()
        return c

    def observe(self, rows: int, seconds: float, prefill: bool = False) -> None:
        """Record a forward of ``rows`` query rows that took ``seconds`` (ignored unless both
        are positive and finite); ``prefill``: the step had a prompt chunk."""
        if rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._curve(prefill).add(_bucket(rows), float(seconds))

    def num_buckets(self, prefill: bool = False) -> int:
        """Distinct row-count buckets observed so far in the class (current regime)."""
        return len(self._curve(prefill).keys)

    def num_samples(self, rows: int, prefill: bool = False) -> int:
        """Samples ever taken in ``rows``'s bucket of the class (current regime)."""
        return self._curve(prefill).count.get(_bucket(rows), 0)

    def max_observed_rows(self, prefill: bool = False) -> int:
        """The largest row-count bucket observed so far in the class (current regime); 0 if none."""
        keys = self._curve(prefill).keys
        return keys[-1] if keys else 0

    def fastest(self, rows: int, n: int, prefill: bool = False) -> list[float]:
        """The ``n`` fastest samples kept in ``rows``'s bucket (ascending; fewer if it has fewer)."""
        return sorted(self._curve(prefill).window.get(_bucket(rows), []))[:n]

    def is_observed(self, rows: int, prefill: bool = False) -> bool:
        """Whether ``rows``'s bucket has a sample in the class (current regime)."""
        return _bucket(rows) in self._curve(prefill).window

    def params(self, prefill: bool = False) -> tuple[float, float, float, float, float] | None:
        """The class's fit ``(a, b, c, d, R0)`` of ``a + b R + [R > R0] (d + c (R - R0))``
        (None before two buckets)."""
        c = self._curve(prefill)
        return c.params(self.kink) if len(c.keys) >= 2 else None

    def level(self, rows: int, prefill: bool = False) -> float | None:
        """The measured level of ``rows``'s bucket (None if unobserved)."""
        c = self._curve(prefill)
        key = _bucket(rows)
        return c.level(key) if key in c.window else None

    def cost(self, rows: int, prefill: bool = False) -> float:
        """Estimated seconds of a forward with ``rows`` query rows (``> 0``)."""
        rows = max(1, int(rows))
        c = self._curve(prefill)
        if not c.keys:
            if prefill and self._curve(False).keys:
                return self.cost(rows, False)
            return self.prior_base_s * (1.0 + self.prior_row_fraction * (rows - 1))
        if len(c.keys) == 1:
            key = c.keys[0]
            lv = c.level(key)
            if prefill:  # a prompt step of hundreds of rows: each row its average share
                return max(lv * rows / key, 1e-9)
            return max(lv * (1.0 + self.prior_row_fraction * (rows - key)), 1e-9)
        return max(_eval_fit(c.params(self.kink), rows), 1e-9)


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
