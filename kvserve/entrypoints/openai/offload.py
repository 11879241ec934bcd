"""Heavy per-request work (tokenization, chat-template rendering, detokenization of large
inputs) runs here, off the server's event loop, so that ``/health`` and every other connection
keep being served while it runs.

The pool is small (``max_workers`` threads, default 2) so that a flood of large prompts cannot
take the machine's CPUs from the engine, and its queue is bounded (``max_queued`` jobs waiting):
past it a request gets 503 ``server_busy`` instead of waiting behind an ever-growing line. Work on
small inputs (under ``inline_below`` characters or tokens) runs inline: the thread hop would cost
more than the work. Hugging Face fast tokenizers release the GIL while they encode, so the loop
runs freely meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_MAX_WORKERS = 2
DEFAULT_MAX_QUEUED = 64
DEFAULT_INLINE_BELOW = 4096


class PoolBusyError(RuntimeError):
    """More than ``max_queued`` jobs are waiting for the pool."""


class OffloadPool:
    """A bounded thread pool for CPU-heavy request preparation.

    Args:
        max_workers: threads (>= 1).
        max_queued: jobs that may wait for a thread before ``run`` raises ``PoolBusyError``.
        inline_below: inputs smaller than this (characters or tokens, as the caller measures
            them) run on the calling thread.
    """

    def __init__(
        self,
        max_workers: int = DEFAULT_MAX_WORKERS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        inline_below: int = DEFAULT_INLINE_BELOW,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}.")
        self.max_workers = max_workers
        self.max_queued = max_queued
        self.inline_below = inline_below
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kvserve-prep")
        self._jobs = 0  # submitted and not finished (event-loop thread only)

    @property
    def jobs(self) -> int:
        """Jobs submitted to the threads and not finished yet."""
        return self._jobs

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, inline when ``size < inline_below``, else on a pool thread.

        Raises:
            PoolBusyError: the pool has ``max_workers + max_queued`` jobs already.
            whatever ``fn`` raises.
        """
        if size < self.inline_below:
            return fn(*args)
        if self._jobs >= self.max_workers + self.max_queued:
            raise PoolBusyError(
                f"{self._jobs} prompts are being prepared (limit {self.max_workers + self.max_queued})"
            )
        loop = asyncio.get_running_loop()
        self._jobs += 1
        job = self._executor.submit(fn, *args)
        # counted until the thread is done with it, even when the caller stops waiting
        job.add_done_callback(lambda _: self._call_on(loop, self._job_done))
        return await asyncio.wrap_future(job)

    @staticmethod
    def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed (server stopped): nothing left to count
            pass

    def _job_done(self) -> None:
        self._jobs -= 1

    def close(self) -> None:
        """Stop the threads (waiting jobs are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
