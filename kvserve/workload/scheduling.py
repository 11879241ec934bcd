"""Scheduling workloads (several tenants, a small KV cache) and the fairness metric, shared by
``kvserve bench fairness`` and ``kvserve bench preemption``. Pure Python, no model.

Lengths come from a real trace, the Azure LLM 2023 *code* trace (``AzureLLMInferenceTrace_code.csv``
in the shared traces; its *conversation* sibling is held back), scaled to a small model's context
by one rule (``scale_lengths``): a row's prompt length is multiplied by ``max_prompt_len / 8192``
(the trace's longest prompt, 7,437 tokens, lands just under ``max_prompt_len``) and clamped to
``[16, max_prompt_len]``; its output length is clamped to ``[4, max_output_len]``. Rows are taken in
file order, so a workload is the same on every run.

Workloads (each a ``SchedWorkload``: requests plus the KV-cache size it is meant for):

* ``flood``: tenant A sends ``num_a`` (40) requests at t=0, tenant B ``num_b`` (4) at t=1 s.
  B's requests have priority 0, A's 1 (so the ``priority`` policy serves B first).
* ``b-alone``: B's requests of ``flood`` alone (same ids, lengths, arrival): B's TTFT without A.
* ``backlogged``: ``num_backlogged`` (48) trace rows, all sent at t=0, each given a tenant by
  ``tenant_of`` (two tenants, A with two thirds of the rows): both tenants stay backlogged, the
  setting for Jain's index.
* ``head-of-line``: four holders (176-token prompts, 48 outputs) fill most of the cache; while
  they decode (0.1 s after the last one's first token) a long prompt (400 tokens) arrives and
  cannot get its blocks, and 0.2 s after that token eight short requests (32-token prompts, 8 outputs):
  without backfill they wait behind the long prompt.
* ``long`` / ``many-short`` / ``n4`` (``preemption_workloads``): long prompts with long outputs,
  many short requests, and ``n=4`` sampling, each on a cache too small for all of them at once,
  so the scheduler must preempt.

Tenant rule for trace-driven runs (``tenant_of``): row ``i`` hashes to ``u = (i * 2654435761 mod
2**32) / 2**32`` (Knuth's multiplicative hash) and takes the first tenant ``j`` whose cumulative
share ``sum_{m <= j} w_m / sum w`` exceeds ``u``, with Zipf weights ``w_m = 1 / (m + 1) ** skew``:
with two tenants and ``skew = 1`` tenant ``t0`` gets about 2/3 of the rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.workload.workload import BenchRequest, corpus_window

#: the scale rule's reference prompt length: the code trace's longest prompt (7,437) fits under it
TRACE_MAX_PROMPT = 8192
#: fairness windows (seconds) for Jain's index
JAIN_WINDOW_S = 10.0


@dataclass
class SchedRequest(BenchRequest):
    """A ``BenchRequest`` with a tenant name, a priority (lower is served first by ``priority``)
    and the number of samples ``n`` (``n > 1`` samples with temperature 1)."""

    tenant: str = ""
    priority: int = 0
    n: int = 1


@dataclass
class SchedWorkload:
    """Requests and the engine settings they are meant for: ``num_gpu_blocks`` /
    ``num_cpu_blocks`` KV blocks (of 16 tokens), ``max_model_len`` tokens, tenant weights
    (Jain's index divides each tenant's tokens by its weight)."""

    name: str
    requests: list[SchedRequest]
    num_gpu_blocks: int
    num_cpu_blocks: int = 512
    max_model_len: int = 1024
    weights: dict[str, float] = field(default_factory=dict)


def scale_lengths(
    rows: Sequence[tuple[int, int]], max_prompt_len: int = 512, max_output_len: int = 48
) -> list[tuple[int, int]]:
    """The module's scale rule on ``(input_len, output_len)`` rows: prompt ``* max_prompt_len /
    8192`` rounded, clamped to ``[16, max_prompt_len]``; output clamped to ``[4, max_output_len]``.

    Raises:
        ValueError: ``max_prompt_len < 16`` or ``max_output_len < 4``.
    """
    if max_prompt_len < 16 or max_output_len < 4:
        raise ValueError(
            f"max_prompt_len must be >= 16 and max_output_len >= 4, got {max_prompt_len}, {max_output_len}"
        )
    f = max_prompt_len / TRACE_MAX_PROMPT
    return [(min(max(16, round(i * f)), max_prompt_len), min(max(4, o), max_output_len)) for i, o in rows]


def tenant_of(index: int, num_tenants: int = 2, skew: float = 1.0) -> str:
    """The tenant (``"t0"``, ``"t1"``, ...) of trace row ``index`` by the module's hash rule.

    Raises:
        ValueError: ``num_tenants < 1`` or ``skew < 0``.
    """
    if num_tenants < 1 or skew < 0:
        raise ValueError(f"num_tenants must be >= 1 and skew >= 0, got {num_tenants}, {skew}")
    u = ((index * 2654435761) % 2**32) / 2**32
    w = [1.0 / (m + 1) ** skew for m in range(num_tenants)]
    total, acc = sum(w), 0.0
    for j, wj in enumerate(w):
        acc += wj / total
        if u < acc:
            return f"t{j}"
    return f"t{num_tenants - 1}"


def _request(corpus, rid, inp, out, arrival, tenant, priority=0, n=1, after_id=None) -> SchedRequest:
    # a deterministic, distinct window of the corpus per request id
    ids = corpus_window(corpus, rid * 7919, inp)
    return SchedRequest(
        prompt_token_ids=ids,
        output_len=out,
        arrival_s=arrival,
        id=rid,
        tenant=tenant,
        priority=priority,
        n=n,
        after_id=after_id,
    )


def flood_workloads(
    rows: Sequence[tuple[int, int]],
    corpus: Sequence[int],
    num_a: int = 40,
    num_b: int = 4,
    b_at_s: float = 1.0,
) -> tuple[SchedWorkload, SchedWorkload]:
    """``(flood, b-alone)`` from scaled ``rows`` (the first ``num_a`` for A, the next ``num_b``
    for B); ``half_cache`` of A's requests (A is still queued when B arrives, so B contends).

    Raises:
        ValueError: fewer than ``num_a + num_b`` rows.
    """
    if len(rows) < num_a + num_b:
        raise ValueError(f"flood needs {num_a + num_b} length rows, got {len(rows)}")
    a = [_request(corpus, i, *rows[i], 0.0, "A", priority=1) for i in range(num_a)]
    b = [_request(corpus, num_a + j, *rows[num_a + j], b_at_s, "B") for j in range(num_b)]
    w = {"A": 1.0, "B": 1.0}
    blocks = half_cache(a)
    return SchedWorkload("flood", a + b, blocks, weights=w), SchedWorkload(
        "b-alone", list(b), blocks, weights=w
    )


def half_cache(reqs: Sequence[BenchRequest], block_size: int = 16, fraction: float = 0.5) -> int:
    """``fraction`` (default half) of the KV blocks ``reqs`` need at once in full (prompt +
    output), at least 32: a cache the requests must queue for, whatever the host's speed."""
    need = sum(math.ceil((r.prompt_len + r.output_len) / block_size) for r in reqs)
    return max(32, int(need * fraction))


def backlogged_workload(
    rows: Sequence[tuple[int, int]], corpus: Sequence[int], num: int = 48, skew: float = 1.0
) -> SchedWorkload:
    """``num`` rows at t=0, tenants ``A`` / ``B`` by ``tenant_of`` (``t0`` -> A, about two
    thirds at ``skew`` 1); a sixth of the cache they need (``half_cache(fraction=1/6)``), so both
    tenants stay queued for several waves of admissions.

    Raises:
        ValueError: fewer than ``num`` rows.
    """
    if len(rows) < num:
        raise ValueError(f"backlogged needs {num} length rows, got {len(rows)}")
    reqs = [
        _request(corpus, i, *rows[i], 0.0, "A" if tenant_of(i, 2, skew) == "t0" else "B") for i in range(num)
    ]
    return SchedWorkload("backlogged", reqs, half_cache(reqs, fraction=1 / 6), weights={"A": 1.0, "B": 1.0})


def head_of_line_workload(corpus: Sequence[int], num_short: int = 8) -> SchedWorkload:
    """Four holders at 0 s (176-token prompts: 11 blocks each, 14 with their 48 outputs); 0.1 s
    after the last holder's first token (while the holders decode, on a host of any speed) a
    400-token prompt (25 blocks, more than the 20 left), then 0.2 s after that token
    ``num_short`` 32-token prompts with 8 outputs (3 blocks each); 64 KV blocks."""
    reqs = [_request(corpus, i, 176, 48, 0.0, "A") for i in range(4)]
    reqs.append(_request(corpus, 4, 400, 8, 0.1, "A", after_id=3))
    reqs += [_request(corpus, 5 + j, 32, 8, 0.2, "B", after_id=3) for j in range(num_short)]
    return SchedWorkload("head-of-line", reqs, 64, weights={"A": 1.0, "B": 1.0})


def preemption_workloads(corpus: Sequence[int], quick: bool = False) -> list[SchedWorkload]:
    """``long`` (6 prompts of 256 with 160 outputs, 40 blocks: two prompts are admitted, 16
    blocks each, and outgrow the cache), ``many-short`` (32 prompts of 32 with 48 outputs, 40
    blocks), ``n4`` (4 groups of ``n=4``, 64 + 64 tokens, 40 blocks); ``quick`` halves the
    request counts and output lengths, and the cache of the last two."""
    k = 2 if quick else 1
    long_ = [_request(corpus, i, 256, 160 // k, 0.0, "A") for i in range(6 // k)]
    short = [_request(corpus, i, 32, 48 // k, 0.0, "A") for i in range(32 // k)]
    n4 = [_request(corpus, i, 64, 64 // k, 0.0, "A", n=4) for i in range(4 // k)]
    return [
        SchedWorkload("long", long_, 40, num_cpu_blocks=256),
        SchedWorkload("many-short", short, 40 // k, num_cpu_blocks=256),
        SchedWorkload("n4", n4, 40 // k, num_cpu_blocks=256),
    ]


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` (Jain, Chiu, Hawe, DEC-TR-301, 1984):
    1 when all equal, ``1/n`` when one takes everything; None for no values or all zero."""
    xs = list(values)
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * sq)


def _events(samples: Sequence) -> list[tuple[float, float]]:
    """``(time, amount)`` pairs from times (amount 1) or pairs."""
    return [(x, 1.0) if isinstance(x, (int, float)) else (x[0], x[1]) for x in samples]


def windowed_jain(
    token_times: Mapping[str, Sequence[float] | Sequence[tuple[float, float]]],
    active: Mapping[str, tuple[float, float]],
    weights: Mapping[str, float] | None = None,
    window_s: float = JAIN_WINDOW_S,
) -> dict:
    """Jain's index of served tokens per window while every tenant had work, weighted: a
    tenant's tokens in a window are divided by its weight (default 1). ``token_times``: tenant
    -> the time (s) of each token it was served, or ``(time, amount)`` pairs (service counted
    as ``amount`` tokens at ``time``); ``active``: tenant -> ``(start, end)`` of the time it had
    work (e.g. first arrival to last admission). The span all tenants share, ``[max start, min
    end]``, is cut into windows of ``window_s`` from its start; a remainder shorter than
    ``window_s`` joins the window before it (a tail of one step is not a window of the stated
    length: on a slow host it can hold a single tenant's prompt credit and read as 1/n), and a
    span shorter than ``window_s`` is one window. Each window's index is over all tenants'
    tokens served in it. Returns ``{"mean": mean over the windows (None with fewer than two
    tenants or an empty span), "min": the least window's index, "windows": [index per window],
    "span_s": (start, end) or None}``.

    Raises:
        ValueError: ``window_s <= 0``.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    weights = weights or {}
    empty: dict = {"mean": None, "min": None, "windows": [], "span_s": None}
    if len(active) < 2:
        return empty
    start = max(a for a, _ in active.values())
    end = min(b for _, b in active.values())
    if end <= start:
        return empty
    num_windows = max(1, int((end - start) // window_s))
    edges = [start + i * window_s for i in range(num_windows)] + [end]
    events = {t: _events(token_times.get(t, ())) for t in active}
    out: list[float] = []
    for lo, hi in zip(edges, edges[1:]):
        last = hi == end  # the span's last token counts in its last window
        xs = [
            sum(a for x, a in events[t] if lo <= x < hi or (last and x == hi)) / weights.get(t, 1.0)
            for t in active
        ]
        j = jain_index(xs)
        if j is not None:
            out.append(j)
    return {
        "mean": sum(out) / len(out) if out else None,
        "min": min(out, default=None),
        "windows": out,
        "span_s": (start, end),
    }
