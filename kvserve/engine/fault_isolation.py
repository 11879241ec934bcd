"""Find the rows of a failed batch that make it fail, by bisection.

When one step's forward (or its input preparation, or its sampling) raises, the engine does not
know which scheduled group caused it. ``bisect_failures`` re-runs the batch split in halves,
recursively: a half that succeeds yields its results, a half that fails is split again, and a
single row that still fails alone is at fault. With one bad row among ``N``, that costs about
``2 * log2(N)`` extra runs covering ``~2N`` rows in all; when every row fails alone (a fault of
the engine, not of any request) it costs ``2N - 1`` runs and every row is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class RequestFault(RuntimeError):
    """A fault the executor pinned on one request itself (its step output carries the reason,
    e.g. non-finite logits), so no bisection is needed; the message is that reason."""


def bisect_failures(
    run: Callable[[list[T]], Sequence[R]],
    items: Sequence[T],
    first_error: BaseException,
    before_attempt: Callable[[list[int]], None] | None = None,
) -> tuple[list[R | None], dict[int, BaseException]]:
    """Re-run ``items`` (which failed together with ``first_error``) in halves.

    Args:
        run: runs a sub-list of ``items`` (in their original relative order) and returns one
            result per item, or raises. A wrong number of results counts as a failure.
        items: the batch that failed.
        first_error: what the whole batch raised (reported for a batch of one).
        before_attempt: called with the indices of every sub-list just before it is run
            (e.g. to restore per-row RNG state consumed by a failed attempt).

    Returns:
        ``(results, faults)``: ``results[i]`` is item ``i``'s result (``None`` for a faulty
        item); ``faults`` maps the index of each item that failed on its own to its error.
    """
    n = len(items)
    results: list[R | None] = [None] * n
    faults: dict[int, BaseException] = {}
    if n == 1:
        faults[0] = first_error
        return results, faults
    mid = n // 2
    # Depth-first, left half first: a deterministic order of attempts.
    stack: list[list[int]] = [list(range(mid, n)), list(range(mid))]
    while stack:
        idx = stack.pop()
        if before_attempt is not None:
            before_attempt(idx)
        try:
            out = list(run([items[i] for i in idx]))
            if len(out) != len(idx):
                raise RuntimeError(f"executor returned {len(out)} results for {len(idx)} groups")
        except Exception as e:
            if len(idx) == 1:
                faults[idx[0]] = e
            else:
                half = len(idx) // 2
                stack.append(idx[half:])
                stack.append(idx[:half])
            continue
        for i, r in zip(idx, out):
            results[i] = r
    return results, faults
