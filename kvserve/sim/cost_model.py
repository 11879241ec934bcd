"""A linear step-latency model for the simulator, and a virtual clock.

``CostModel.step_time(num_prefill_tokens, num_decode_seqs, num_context_tokens)`` returns the
seconds one engine step takes::

    t = base_s + prefill_token_s * prefill_tokens + decode_seq_s * decode_seqs
        + context_token_s * context_tokens

where ``context_tokens`` is the number of KV positions the decodes attend over (sum of their
lengths). Swapping adds ``swap_block_s`` per block moved. A speculative verification is a
decode whose forward also takes its ``m`` drafts: those extra query tokens
(``num_verify_tokens``) cost ``prefill_token_s`` each, what any token processed in a forward
costs, while its context is read once (``context_tokens`` counts it once).

Multi-LoRA: a step holding ``num_loras`` distinct adapters adds ``lora_adapter_s`` per adapter
(the batched LoRA linear runs one segment per adapter in every layer). The default 0.5 ms is a
PLACEHOLDER, not a measurement: set it from a measured run before trusting LoRA what-ifs.

Default coefficients: a least-squares fit (weighted by 1/t, i.e. relative error) to the
measured Llama-2-70B, H100-80GB, tensor-parallel 4 rows of SplitwiseSim's performance model
(``../shared/traces/calibration/splitwise_sim_perf_model.csv``; Patel et al., "Splitwise",
ISCA'24; MIT). Each CSV row gives two samples: a prefill batch (``batch_size * prompt_size``
prefill tokens -> ``prompt_time``) and a decode step (``batch_size`` seqs over
``batch_size * (prompt_size + token_size / 2)`` context tokens -> ``token_time``). Rows with
more than 16,384 prefill tokens per batch are left out of the fit (prefill turns superlinear
there). Mean absolute relative error of the fit on the rows used: 8.6% (max 29%); across
all 105 rows: 9.0%. ``fit_splitwise_csv`` refits for any model/hardware/TP in the file. That default describes
another model on other hardware: ``kvserve profile`` measures this host (``kvserve.sim.profile``)
and ``kvserve.sim.cost_model_file.load_cost_model`` loads the result.

Richer terms, all zero in the default (fitted from a profile, ``fit_cost_model``): per prompt
chunk (``prefill_seq_s``), per 1,000 causal attention pairs of prompt chunks
(``prefill_attn_s``: the term quadratic in chunk length), per sampled row (``sample_s``), per
copied block (``copy_block_s``). ``step_cost(StepShape)`` uses them all; ``step_time`` is the
old call with the four counts.

Two refinements a profile fits and the default leaves off, each from this engine's measured
steps (docs/benchmarks.md, "simulator fidelity"):

* ``decode_knots`` ``{K: s}``: a decode-only step pays ``s`` more per decode past ``K`` (a
  hinge). Decode steps are bound by streaming the weights once, whatever the batch, until the
  GEMMs' row blocks fill and each extra row starts to cost compute: the measured time per
  decode is flat to a few decodes, then steeper, a convex curve a single line through batches
  1..64 over-predicts in the middle (+7% summed over a preempting replay's batches of 2-8).
  Mixed steps are left out: their GEMM rows are mostly prompt tokens.
* ``attention_split`` ``(kv_heads, threads)``: the decode attention kernel hands one work item
  per (sequence, KV head) to ``threads`` threads, so a step of ``b`` decodes runs
  ``ceil(b * kv_heads / threads)`` rounds of equal-length items: its context costs
  ``context_tokens * ceil(b*KH/T) * T / (b*KH)`` per-token units (``context_feature``). With
  SmolLM2's 3 KV heads on 2 threads, one decode keeps a thread idle a third of the time (4/3
  per token), two or more hardly any: a line through context tokens alone, fitted mostly on
  batch-1 decodes, over-charges the long-context small batches of a preempting replay.
* ``prefill_knots`` ``{K: s}``: a step carrying prompt tokens pays ``s`` per row of its
  forward (prompt tokens, decodes and drafts) up to ``K``, ``min(rows, K) * s``: the time per
  prompt token falls as the step grows (a concave curve). oneDNN's bfloat16 GEMMs run their
  larger row counts on better-filled tiles: on this project's AMX Xeon a 2,048-token step cost
  ~0.09 ms a token past 1,024 and ~0.2 ms below 512, and one line through the profile's many
  2,048-token chunks under-predicted the replay's 100-1,000-token steps by 15-35% (and so its
  TTFT). float32 runs this project's own panels, linear in rows: its knots fit as ~0.

Past the profiled range (``ranges``, the largest counts a profile measured) the prediction is
bounded: its error grows at most linearly with how far the step is past the range. Every term
but one is linear in a count, so the fit's own extrapolation is already linear (a coefficient
off by x% is off by x% at any size). The attention-pairs term is the exception: pairs grow as
the square of a chunk's length, and its coefficient is the least constrained of the fit (over
a small profile's short chunks it is nearly collinear with the per-token and per-chunk terms
and can absorb them), so a 2,048-token chunk after 6,000 cached tokens, ~3,000 times the pairs
of a 96-token profiled chunk, multiplied that error ~3,000-fold. Past the largest mean pairs
per chunk profiled (``E``), a chunk's pairs are therefore charged along the tangent of the
quadratic at that edge, linear in the chunk's size ``r = sqrt(pairs / E)`` (its length, when
chunk and context grow together): ``E * (2r - 1)`` per chunk (``CostModel.attention_pairs``).
That keeps the fitted value and slope at the edge and is never more than the fitted quadratic
(a tangent lies below a convex curve). Such figures are still extrapolated: ``outside_range``
flags the steps, and ``kvserve simulate`` says how many and what share of the simulated time
(``--refuse-extrapolation`` makes too large a share an error).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.envs import shared_dir
from kvserve.sim.step_shape import StepShape

SPLITWISE_CSV = str(shared_dir() / "traces" / "calibration" / "splitwise_sim_perf_model.csv")


#: The ``StepShape`` counts a profile records the largest of (``CostModel.ranges``): a step
#: past one of them is extrapolated. ``prefill_attn_pairs`` is per step; the ranges also hold
#: ``PAIRS_PER_CHUNK``, the largest mean pairs per prompt chunk (the edge
#: ``CostModel.attention_pairs`` extrapolates from).
RANGED = ("prefill_tokens", "prefill_attn_pairs", "decode_seqs", "context_tokens")
PAIRS_PER_CHUNK = "prefill_attn_pairs_per_chunk"


def profile_ranges(shapes: Sequence[StepShape]) -> dict[str, float]:
    """The largest of each ``RANGED`` count over ``shapes`` (0 when there are none) and the
    largest mean attention pairs per prompt chunk (``PAIRS_PER_CHUNK``, 1,000-pair units): what
    a profile stores as ``profile.ranges``."""
    out: dict[str, float] = {k: max((getattr(s, k) for s in shapes), default=0) for k in RANGED}
    out[PAIRS_PER_CHUNK] = max(
        (s.prefill_attn_pairs / s.prefill_seqs for s in shapes if s.prefill_seqs > 0), default=0.0
    )
    return out


#: Coefficient name -> the ``StepShape`` count it multiplies (``base_s`` multiplies 1).
FEATURES: dict[str, str] = {
    "prefill_token_s": "prefill_tokens",
    "prefill_seq_s": "prefill_seqs",
    "prefill_attn_s": "prefill_attn_pairs",
    "decode_seq_s": "decode_seqs",
    "context_token_s": "context_tokens",
    "sample_s": "sampled_rows",
    "swap_block_s": "swapped_blocks",
    "copy_block_s": "copied_blocks",
    "lora_adapter_s": "loras",
}


def _decode_only(shape: StepShape) -> bool:
    """A step of decodes alone (no prompt chunk, no speculative drafts): where a knot applies."""
    return shape.decode_seqs > 0 and shape.prefill_tokens == 0 and shape.verify_tokens == 0


def prompt_rows(shape: StepShape) -> int:
    """The GEMM rows of a step that carries prompt tokens (prompt tokens + decodes + drafts),
    0 for a step without: what ``prefill_knots`` count."""
    if shape.prefill_tokens == 0:
        return 0
    return shape.prefill_tokens + shape.decode_seqs + shape.verify_tokens


def context_feature(shape: StepShape, attention_split: tuple[int, int] | None) -> float:
    """The decode-attention count ``context_token_s`` multiplies: ``shape.context_tokens``,
    scaled by the idle share of the last round of work items when ``attention_split`` =
    ``(kv_heads, threads)`` is known (module docstring): ``ceil(b*KH/T) * T / (b*KH)`` for
    ``b`` decodes, 1 when ``b*KH`` is a multiple of ``T``."""
    if not attention_split or shape.decode_seqs == 0:
        return float(shape.context_tokens)
    kv_heads, threads = attention_split
    items = shape.decode_seqs * kv_heads
    return shape.context_tokens * (-(-items // threads)) * threads / items


def decode_knot_candidates(samples: Sequence[tuple[StepShape, float]], min_count: int = 3) -> list[int]:
    """Knots to offer ``fit_cost_model``: the decode batch sizes of the decode-only samples seen
    at least ``min_count`` times, less the smallest and the largest (a hinge at either end has
    no measured batch on one side to fix it)."""
    counts: dict[int, int] = {}
    for shape, _ in samples:
        if _decode_only(shape):
            counts[shape.decode_seqs] = counts.get(shape.decode_seqs, 0) + 1
    sizes = sorted(b for b, n in counts.items() if n >= min_count)
    return sizes[1:-1]


def prefill_knot_candidates(samples: Sequence[tuple[StepShape, float]]) -> list[int]:
    """Knots to offer ``fit_cost_model`` as ``prefill_knots``: every power of two strictly
    between the smallest and the largest ``prompt_rows`` of the prompt-bearing samples (the
    GEMMs' efficiency changes with their row blocks, which double; a knot at either end has no
    measured step on one side to fix it)."""
    rows = [prompt_rows(s) for s, _ in samples if s.prefill_tokens > 0]
    if not rows:
        return []
    lo, hi = min(rows), max(rows)
    out, k = [], 1
    while k < hi:
        if k > lo:
            out.append(k)
        k *= 2
    return out


#: Where the default coefficients come from (printed in every simulation header).
BUILTIN_INFO = {
    "model": "Llama-2-70B",
    "hardware": "4x H100-80GB (tensor parallel 4)",
    "dtype": "float16",
    "source": "built-in fit to SplitwiseSim's performance model (not this machine; "
    "`kvserve profile` measures this one)",
}


@dataclass
class CostModel:
    """Seconds per step from token/sequence counts (see module docstring).

    Attributes (seconds): ``base_s`` fixed per-step cost; ``prefill_token_s`` per prefill
    token; ``decode_seq_s`` per decoding sequence; ``context_token_s`` per KV position read by
    decodes; ``swap_block_s`` per block swapped in or out; ``prefill_seq_s`` per prompt chunk;
    ``prefill_attn_s`` per 1,000 attention pairs of prompt chunks; ``sample_s`` per sampled
    row; ``copy_block_s`` per copied block;
    ``lora_adapter_s`` per distinct LoRA adapter in the step (built-in: a placeholder until
    measured; a profile without adapters fits it as 0). ``decode_knots``: ``{K: seconds per
    decode past K}`` in decode-only steps; ``prefill_knots``: ``{K: seconds per forward row up
    to K}`` in steps carrying prompt tokens; ``attention_split``: ``(kv_heads, threads)`` of the
    decode attention's work split, or None (both: module docstring). ``info``: where the
    coefficients come from (``model``, ``hardware``, ``dtype``, ``source``; see ``describe``).
    """

    base_s: float = 2.79450670e-02
    prefill_token_s: float = 8.07386575e-05
    decode_seq_s: float = 1.92680266e-04
    context_token_s: float = 2.72815994e-07
    swap_block_s: float = 2.0e-05
    lora_adapter_s: float = 5.0e-04
    prefill_seq_s: float = 0.0
    prefill_attn_s: float = 0.0
    sample_s: float = 0.0
    copy_block_s: float = 0.0
    decode_knots: dict[int, float] = field(default_factory=dict)
    prefill_knots: dict[int, float] = field(default_factory=dict)
    attention_split: tuple[int, int] | None = None
    info: dict = field(default_factory=lambda: dict(BUILTIN_INFO), compare=False)
    #: the largest value of each ``StepShape`` count the coefficients were fitted on
    #: (``profile_ranges``; None: unknown); ``outside_range`` flags steps past them
    #: (extrapolation) and ``attention_pairs`` bounds the attention term past them
    ranges: dict | None = field(default=None, compare=False)

    def outside_range(self, shape: StepShape, slack: float = 1.25) -> bool:
        """True when ``shape`` has a count more than ``slack`` times the largest profiled one
        (``RANGED``: prompt tokens, attention pairs, decodes, context tokens): its cost is
        extrapolated."""
        if not self.ranges:
            return False
        for attr in RANGED:
            top = self.ranges.get(attr)
            if top is not None and getattr(shape, attr) > slack * top:
                return True
        return False

    def past_range(self, largest: dict[str, float]) -> list[tuple[str, float, float]]:
        """``(count, largest seen, largest profiled)`` for each ``RANGED`` count whose value in
        ``largest`` (count -> the largest seen, e.g. over a simulation's steps) is above the
        profiled one; empty when ``ranges`` is unknown."""
        if not self.ranges:
            return []
        out = []
        for attr in RANGED:
            top = self.ranges.get(attr)
            seen = largest.get(attr, 0)
            if top is not None and seen > top:
                out.append((attr, seen, top))
        return out

    def attention_pairs(self, shape: StepShape) -> float:
        """The attention-pairs count ``prefill_attn_s`` multiplies (1,000-pair units):
        ``shape.prefill_attn_pairs`` within the profiled range; past the largest mean pairs per
        chunk profiled ``E`` (``ranges[PAIRS_PER_CHUNK]``, else the per-step maximum of a file
        written before that key), the tangent of the quadratic at that edge: ``n * E * (2r - 1)``
        for ``n`` chunks of mean ``r**2 * E`` pairs, linear in the chunks' size and never above
        the pairs themselves (module docstring). Unknown ranges: the pairs as they are."""
        pairs = float(shape.prefill_attn_pairs)
        n = shape.prefill_seqs
        if not self.ranges or n < 1:
            return pairs
        edge = self.ranges.get(PAIRS_PER_CHUNK) or self.ranges.get("prefill_attn_pairs")
        if not edge or pairs <= n * edge:
            return pairs
        r = math.sqrt(pairs / (n * edge))
        return n * edge * (2.0 * r - 1.0)

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int,
        num_swapped_blocks: int = 0,
        num_verify_tokens: int = 0,
        num_loras: int = 0,
    ) -> float:
        """Seconds for one step. All counts are >= 0; an empty step costs 0.
        ``num_verify_tokens``: drafts verified this step (query tokens beyond each decode's
        one); ``num_loras``: distinct LoRA adapters the step's groups run with."""
        return self.step_cost(
            StepShape(
                prefill_tokens=num_prefill_tokens,
                decode_seqs=num_decode_seqs,
                context_tokens=num_context_tokens,
                swapped_blocks=num_swapped_blocks,
                verify_tokens=num_verify_tokens,
                loras=num_loras,
            )
        )

    def step_cost(self, shape: StepShape) -> float:
        """Seconds for a step of ``shape``: ``base_s`` plus each coefficient times its count
        (``FEATURES``; the context count through ``context_feature``, the attention pairs
        through ``attention_pairs``: bounded past the profiled range), plus the decode and
        prefill knots;
        verified drafts cost ``prefill_token_s`` each. An empty step costs 0."""
        if shape.is_empty:
            return 0.0
        t = self.base_s + self.prefill_token_s * shape.verify_tokens
        for coef, attr in FEATURES.items():
            if coef == "context_token_s":
                t += self.context_token_s * context_feature(shape, self.attention_split)
            elif coef == "prefill_attn_s":
                t += self.prefill_attn_s * self.attention_pairs(shape)
            else:
                t += getattr(self, coef) * getattr(shape, attr)
        if self.decode_knots and _decode_only(shape):
            for k, s in self.decode_knots.items():
                if shape.decode_seqs > k:
                    t += s * (shape.decode_seqs - k)
        if self.prefill_knots and shape.prefill_tokens:
            rows = prompt_rows(shape)
            t += sum(s * min(rows, k) for k, s in self.prefill_knots.items())
        return t

    def coefficients(self) -> dict[str, float]:
        """``{"base_s": ..., <each FEATURES name>: ...}``."""
        return {"base_s": self.base_s, **{k: getattr(self, k) for k in FEATURES}}

    def describe(self) -> str:
        """One line naming the model, hardware, dtype and source of the coefficients."""
        i = self.info or {}
        return (
            f"{i.get('model', '?')}, {i.get('hardware', '?')}, {i.get('dtype', '?')} "
            f"(from {i.get('source', '?')})"
        )


def fit_cost_model(
    samples: Sequence[tuple[StepShape, float]],
    features: Sequence[str] | None = None,
    trim: float | None = 10.0,
    decode_knots: Sequence[int] = (),
    attention_split: tuple[int, int] | None = None,
    prefill_knots: Sequence[int] = (),
) -> CostModel:
    """Least-squares fit of ``base_s`` and the ``FEATURES`` coefficients to measured steps,
    aimed at each shape's *mean* time.

    Why the mean: a replay's virtual clock is the sum of its step costs, so a model that
    predicts the typical (fast) step of a noisy host under-predicts every latency built from
    that sum. On a host whose speed drifts by tens of percent over minutes, a fit that favoured
    the fast repeats (or trimmed the slow ones) under-predicted its own profile's summed time by
    8-11%; this one is within ~1% (docs/benchmarks.md, "simulator fidelity").

    How: residuals are relative (weighted by 1/t on the first pass, so a 20 ms decode step
    matters as much as a 1 s prefill), then by 1/prediction on the passes after it: with the
    weight fixed by the previous pass, the repeats of one shape are fitted at their mean (1/t
    weights would pull it toward the fastest one: an under-prediction costs at most 100%, an
    over-prediction any amount). Coefficients are kept >= 0 (a cost cannot be negative): a
    feature whose coefficient comes out negative is dropped and the rest refitted, until all are
    >= 0. Features that are 0 in every sample are left at 0.

    ``trim``: after the first pass, steps more than ``trim`` times slower or faster than
    predicted are left out of the coefficients (default 10: only gross outliers, e.g. a 30 ms
    step stalled for a second by the host), and their time beyond the prediction is put back as
    one factor on every coefficient (a stall hits a step with a chance in proportion to its
    length), so the summed prediction still counts them. Slow steps within the bound are part
    of what a replay sees and stay in the mean; ``None`` keeps every step. ``info`` of the result is empty (the caller names
    the source).

    ``decode_knots``: batch sizes ``K`` at which the decode-only line may bend upward (a
    coefficient >= 0 per decode past ``K``; ``decode_knot_candidates`` picks them from the
    profile); a knot fitted as 0 (under 1 ns a step) is left out of the result. ``prefill_knots``: row counts ``K``
    below which a prompt-bearing step's rows cost more (a coefficient >= 0 per row up to ``K``:
    a concave line; ``prefill_knot_candidates``). ``attention_split``: ``(kv_heads,
    threads)``; the context count is taken through ``context_feature`` with it (module docstring).

    Raises:
        ValueError: fewer samples than coefficients, a non-positive time, ``trim`` <= 1, or a
            knot or split value < 1.
    """
    import numpy as np

    names = list(features) if features is not None else list(FEATURES)
    knots = sorted({int(k) for k in decode_knots})
    if any(k < 1 for k in knots):
        raise ValueError(f"decode_knots must be >= 1, got {list(decode_knots)}")
    pknots = sorted({int(k) for k in prefill_knots})
    if any(k < 1 for k in pknots):
        raise ValueError(f"prefill_knots must be >= 1, got {list(prefill_knots)}")
    if attention_split is not None and (len(attention_split) != 2 or min(attention_split) < 1):
        raise ValueError(f"attention_split must be (kv_heads >= 1, threads >= 1), got {attention_split}")
    ys = np.array([t for _, t in samples], dtype=float)
    need = len(names) + len(knots) + len(pknots) + 1
    if len(samples) < need:
        raise ValueError(f"need at least {need} measured steps to fit, got {len(samples)}")
    if (ys <= 0).any() or not np.isfinite(ys).all():
        raise ValueError("measured step times must be finite and > 0")
    if trim is not None and not trim > 1:
        raise ValueError(f"trim must be > 1 (a ratio of measured to predicted time), got {trim}")
    cols = {
        n: np.array(
            [
                context_feature(s, attention_split)
                if n == "context_token_s"
                else float(getattr(s, FEATURES[n]))
                for s, _ in samples
            ]
        )
        for n in names
    }
    for k in knots:
        cols[f"knot_{k}"] = np.array(
            [float(max(0, s.decode_seqs - k)) if _decode_only(s) else 0.0 for s, _ in samples]
        )
    for k in pknots:
        cols[f"pknot_{k}"] = np.array([float(min(prompt_rows(s), k)) for s, _ in samples])
    names = list(cols)
    keep = np.ones(len(ys), dtype=bool)
    w = 1.0 / ys
    for it in range(4):
        base, coef = _fit_nonneg(ys[keep], {n: c[keep] for n, c in cols.items()}, w[keep])
        pred = sum((coef.get(n, 0.0) * cols[n] for n in names), np.full(len(ys), base))
        w = 1.0 / np.maximum(pred, ys.min())
        # trim against the first pass: its 1/t weights keep it on the fast majority even when
        # stalls are frequent (a mean fit would follow them and flag nothing)
        if trim and it == 0:
            # a ratio both ways: a step 10x slower than predicted is as far out as one 10x faster
            ratio = ys / np.maximum(pred, 1e-12)
            inside = (ratio <= trim) & (ratio >= 1.0 / trim)
            if inside.sum() >= len(names) + 1:
                keep = inside
    if not keep.all():
        # the trimmed steps leave the coefficients (one stall must not bend one shape's line)
        # but not the clock: their time beyond the prediction is spread over every step in
        # proportion to its length, as a stall from outside hits a step with a chance in
        # proportion to how long it runs
        scale = 1.0 + float((ys[~keep] - pred[~keep]).sum()) / float(pred.sum())
        if scale > 0:
            base *= scale
            coef = {n: c * scale for n, c in coef.items()}
    fields = {n: 0.0 for n in FEATURES}
    fields.update({n: c for n, c in coef.items() if n in FEATURES})
    # a knot whose largest share of a step is under a nanosecond is rounding, not a bend
    fitted_knots = {k: c for k in knots if (c := coef.get(f"knot_{k}", 0.0)) * cols[f"knot_{k}"].max() > 1e-9}
    fitted_pknots = {k: c for k in pknots if (c := coef.get(f"pknot_{k}", 0.0)) * k > 1e-9}
    return CostModel(
        base_s=base,
        info={},
        ranges=None,
        decode_knots=fitted_knots,
        prefill_knots=fitted_pknots,
        attention_split=(attention_split[0], attention_split[1]) if attention_split else None,
        **fields,
    )


def _fit_nonneg(ys, cols: dict, w) -> tuple[float, dict[str, float]]:
    """``w``-weighted least squares of ``ys`` on an intercept and ``cols`` with every
    coefficient >= 0 (drop the most negative and refit; no intercept if it comes out < 0)."""
    import numpy as np

    active = [n for n, c in cols.items() if c.any()]
    intercept = True
    while True:
        parts = ([np.ones(len(ys))] if intercept else []) + [cols[n] for n in active]
        if not parts:
            return 0.0, {}
        x = np.column_stack(parts)
        sol, *_ = np.linalg.lstsq(x * w[:, None], ys * w, rcond=None)
        b0 = float(sol[0]) if intercept else 0.0
        rest = sol[1:] if intercept else sol
        neg = [(float(c) * float(np.abs(cols[n]).max()), n) for n, c in zip(active, rest) if c < 0]
        if not neg and b0 >= 0:
            return b0, {n: float(c) for n, c in zip(active, rest)}
        if neg:
            active.remove(min(neg)[1])  # the most negative contribution goes first
        else:
            intercept = False


def fit_errors(model: CostModel, samples: Sequence[tuple[StepShape, float]]) -> dict[str, dict]:
    """Relative error ``|predicted - measured| / measured`` of ``model`` on ``samples``, per
    ``StepShape.shape_class`` and ``all``: ``{"n", "mean", "p50", "p90", "max", "bias",
    "total"}`` (bias: mean signed error, > 0 means the model predicts too slow; total: signed
    error of the summed time, what a replay's clock accumulates)."""
    from kvserve.workload.stats import percentile

    by: dict[str, list[float]] = {}
    sums: dict[str, list[float]] = {}
    for shape, t in samples:
        p = model.step_cost(shape)
        e = (p - t) / t
        for k in (shape.shape_class, "all"):
            by.setdefault(k, []).append(e)
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += p
            acc[1] += t
    out = {}
    for k, es in sorted(by.items()):
        a = [abs(e) for e in es]
        out[k] = {
            "n": len(es),
            "mean": sum(a) / len(a),
            "p50": percentile(a, 50),
            "p90": percentile(a, 90),
            "max": max(a),
            "bias": sum(es) / len(es),
            "total": (sums[k][0] - sums[k][1]) / sums[k][1],
        }
    return out


def fit_splitwise_csv(
    path: str = SPLITWISE_CSV,
    model: str = "llama2-70b",
    hardware: str = "h100-80gb",
    tensor_parallel: int = 4,
    max_prefill_tokens: int = 16384,
) -> CostModel:
    """Fit ``CostModel`` coefficients to one configuration of SplitwiseSim's perf model.

    Raises:
        ValueError: no row matches (model, hardware, tensor_parallel).
    """
    import numpy as np

    xs, ys = [], []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if (r["model"], r["hardware"], int(r["tensor_parallel"])) != (model, hardware, tensor_parallel):
                continue
            b, p, t = int(r["batch_size"]), int(r["prompt_size"]), int(r["token_size"])
            if b * p <= max_prefill_tokens:
                xs.append([1.0, b * p, 0.0, 0.0])
                ys.append(float(r["prompt_time"]) / 1000.0)
            xs.append([1.0, 0.0, b, b * (p + t / 2)])
            ys.append(float(r["token_time"]) / 1000.0)
    if not xs:
        raise ValueError(
            f"no rows for model={model!r} hardware={hardware!r} tensor_parallel={tensor_parallel} in {path}"
        )
    x, y = np.array(xs), np.array(ys)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return CostModel(
        base_s=float(coef[0]),
        prefill_token_s=float(coef[1]),
        decode_seq_s=float(coef[2]),
        context_token_s=float(coef[3]),
        info={
            "model": model,
            "hardware": f"{hardware} (tensor parallel {tensor_parallel})",
            "dtype": "float16",
            "source": f"fit to {path}",
        },
    )


class VirtualClock:
    """Simulated time in seconds. Callable (``clock()``) so it can be passed wherever a
    ``time.time``-like clock is expected; ``now()`` reads it; ``advance(dt)`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        return self._now

    def advance(self, dt: float) -> float:
        """Move time forward by ``dt`` >= 0 seconds. Raises ValueError if negative."""
        if dt < 0:
            raise ValueError(f"cannot move the clock backwards (dt={dt})")
        self._now += dt
        return self._now

    def set(self, t: float) -> None:
        """Jump forward to ``t`` (idle until the next arrival). Raises ValueError if in the past."""
        if t < self._now:
            raise ValueError(f"cannot move the clock backwards ({t} < {self._now})")
        self._now = float(t)


def default_cost_model(cost_model: CostModel | None = None) -> CostModel:
    return cost_model if cost_model is not None else CostModel()
