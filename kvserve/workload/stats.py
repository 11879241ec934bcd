"""Latency statistics shared by the offline and online benchmarks (pure Python, no model).

Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method), so
p50 of ``[1, 2, 3, 4]`` is 2.5 and p99 of 100 samples lies between the two largest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; None when empty.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    values: Iterable[float | None], percentiles: Sequence[float] = DEFAULT_PERCENTILES, scale: float = 1.0
) -> dict[str, float | None]:
    """``{"n", "mean", "std", "min", "max", "p50", "p90", "p99"}`` of the non-None values times ``scale``
    (e.g. ``scale=1000`` for seconds -> ms). All None (n=0) for an empty input."""
    xs = [v * scale for v in values if v is not None and not math.isnan(v)]
    out: dict[str, float | None] = {"n": len(xs)}
    if not xs:
        out.update(mean=None, std=None, min=None, max=None)
        out.update({f"p{_fmt_q(q)}": None for q in percentiles})
        return out
    mean = sum(xs) / len(xs)
    out["mean"] = mean
    out["std"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    out["min"] = min(xs)
    out["max"] = max(xs)
    for q in percentiles:
        out[f"p{_fmt_q(q)}"] = percentile(xs, q)
    return out


def _fmt_q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q).replace(".", "_")


@dataclass
class RequestResult:
    """What the load generator saw for one request (times in seconds, wall clock).

    ``itl`` holds the gaps between successive streamed chunks after the first one (one chunk
    normally carries one token). ``output_tokens`` is the server's usage count when it sent one,
    else the number of non-empty chunks.
    """

    request_id: int
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    send_time: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    scheduled_arrival: float = 0.0

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): the mean time per output token after the first."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class SLO:
    """Service-level objectives in milliseconds; a None bound is not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """True when every set bound holds (latencies in seconds). A request with a single output
        token has no TPOT; that bound then counts as met."""
        if self.ttft_ms is not None and (ttft is None or ttft * 1000 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        if self.e2e_ms is not None and (e2e is None or e2e * 1000 > self.e2e_ms):
            return False
        return True


def goodput(results: Sequence[RequestResult], slo: SLO, duration_s: float) -> dict[str, float]:
    """Requests (and their output tokens) that succeeded *and* met the SLO, per second of the run.

    Returns ``{"good_requests", "good_fraction", "goodput_req_s", "goodput_output_tok_s"}``;
    without any SLO bound every successful request is good.
    """
    good = [r for r in results if r.success and slo.met(r.ttft, r.tpot, r.e2e)]
    n = len(results)
    d = max(duration_s, 1e-9)
    return {
        "good_requests": len(good),
        "good_fraction": len(good) / n if n else 0.0,
        "goodput_req_s": len(good) / d,
        "goodput_output_tok_s": sum(r.output_tokens for r in good) / d,
    }


def summarize_results(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, object]:
    """The online benchmark's metrics for one run: counts, throughput, TTFT/TPOT/ITL/E2E (ms) and
    goodput under ``slo``."""
    ok = [r for r in results if r.success]
    d = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, object] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": summarize([r.ttft for r in ok], scale=1000),
        "tpot_ms": summarize([r.tpot for r in ok], scale=1000),
        "itl_ms": summarize([g for r in ok for g in r.itl], scale=1000),
        "e2e_ms": summarize([r.e2e for r in ok], scale=1000),
    }
    errors = [r.error for r in results if not r.success]
    if errors:
        summary["first_errors"] = errors[:5]
    slo = slo or SLO()
    summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
    summary.update(goodput(results, slo, duration_s))
    return summary
