"""Row counts that oneDNN GEMMs run at: a step's rows padded up to one of a few buckets.

oneDNN builds (JIT-compiles) one primitive per distinct row count and weight shape, and a
serving engine meets ever-new row counts (each step's token count). A row count seen for the
first time costs clearly more than a repeat of it (docs/benchmarks.md, CPU kernels). Without
padding almost every prefill or mixed step of a trace with varied prompt lengths would pay that,
and a bounded primitive cache (``kvserve/__init__.py``) would forget counts as others came, so
the same step would cost more or less depending on what ran before it (which the simulator
cannot know).

``onednn_rows`` pads to 8 buckets per doubling (at most 1/8 more rows, 1/16 on average) above 16
rows: 40 buckets from 65 to 2,048 rows, so after a run's first minutes every step finds its
primitives cached -- or from the first step: the warm-up runs every bucket once
(``buckets``, ``LlamaForCausalLM.warm_row_buckets``) and oneDNN's primitive cache holds them all
(``kvserve/__init__.py``), so a bucket's first step costs about what its repeats do.
"""

from __future__ import annotations

import torch

#: Row counts up to this are run as they are (few distinct values; and the 1-row case has its
#: own rule in ``linear.linear``).
EXACT_ROWS = 16
#: Buckets per doubling of the row count.
BUCKETS_PER_DOUBLING = 8


def onednn_rows(rows: int) -> int:
    """The row count (>= ``rows``) a GEMM of ``rows`` rows runs at: ``rows`` itself up to
    ``EXACT_ROWS``, else ``rows`` rounded up to a multiple of 1/8 of the power of two below it
    (65-128 rows: multiples of 8; 1,025-2,048: of 128)."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << ((rows - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    return -(-rows // step) * step


def buckets(lo: int, hi: int) -> list[int]:
    """The distinct ``onednn_rows`` values of row counts ``lo..hi`` (ascending): the GEMM row
    counts steps of that many rows can run at (for ``lo=65, hi=2048``: 40)."""
    out: list[int] = []
    r = max(1, lo)
    while r <= hi:
        b = onednn_rows(r)
        out.append(b)
        r = b + 1
    return out


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, K]`` with zero rows appended up to ``onednn_rows(T)`` (``x`` itself when
    already a bucket); the caller keeps the first ``T`` output rows."""
    rows = x.shape[0]
    padded = onednn_rows(rows)
    if padded == rows:
        return x.contiguous()
    out = x.new_empty(padded, x.shape[1])
    out[:rows] = x
    out[rows:].zero_()  # only the padding: zeroing all rows first would write them twice
    return out
