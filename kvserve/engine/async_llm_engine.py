"""An asyncio front for ``LLMEngine``: the step loop runs in a background thread.

The model step is blocking, CPU/GPU-bound work, so it runs in its own thread (PyTorch releases
the GIL inside its kernels); the event loop only validates requests and moves outputs into
per-request ``asyncio.Queue``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import EngineSleepingError, LLMEngine
from kvserve.lora_request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.openmp_pool import release_calling_thread_pool

logger = logging.getLogger("kvserve.async_engine")


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away while waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve_value(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class EngineDeadError(RuntimeError):
    """The background loop stopped after an unexpected error."""


class AsyncLLMEngine:
    """Many concurrent requests share one continuous batch.

    ``generate(...)`` validates synchronously (raising ``ValueError`` before anything is queued),
    then yields ``RequestOutput``s as tokens arrive, the last one with ``finished=True``.
    Cancelling the consumer (a client disconnect) aborts the request at once: its KV blocks
    are freed on the engine thread before the next step.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errored: BaseException | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        # The calling thread's idle OpenMP workers would slow every parallel region of the
        # engine thread (libgomp's throttled spinning; see openmp_pool).
        release_calling_thread_pool()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread (in-flight requests should be finished or aborted first)."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---------------------------------------------------------------- requests
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request (with ``lora_request``'s adapter, None: the base
        model; for ``tenant``, None: the default tenant). Raises ValueError (invalid input, duplicate id, an adapter that does not load)
        before queueing, EngineDeadError if the loop died."""
        if self.errored is not None:
            raise self._dead_error()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        # Stamped here, not when the engine thread drains the inbox between steps: the wait for
        # the running step belongs to the request's TTFT and queue time, as its client sees it.
        arrival_time = self.engine.clock()
        self._inbox.put(
            ("add", request_id, prompt, params, priority, accepted, lora_request, tenant, arrival_time)
        )
        self._wakeup.set()
        # Validation runs on the engine thread (the engine is single-threaded).
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # in case it was accepted while we were cancelled
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended)."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    # ---------------------------------------------------------------- adapters
    def submit(self, fn, *args) -> asyncio.Future:
        """Run ``fn(*args)`` on the engine thread, between steps and in inbox order (after
        the adds and aborts queued before it); the future gets its result or exception.
        Must be called on the event loop of ``start()``. Before ``start()`` (no step can
        run) it runs at once; a dead loop gives ``EngineDeadError``."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if self.errored is not None:
            future.set_exception(self._dead_error())
            return future
        if self._thread is None or not self._thread.is_alive():
            try:
                future.set_result(fn(*args))
            except Exception as e:
                future.set_exception(e)
            return future
        self._inbox.put(("call", fn, args, future))
        self._wakeup.set()
        return future

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """``LLMEngine.add_lora`` on the engine thread (the adapter is read and validated
        there, between steps). Raises ValueError naming the path or the limit."""
        return bool(await self.submit(self.engine.add_lora, lora_request))

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` on the engine thread, between steps: True if no
        cached block is left (False: blocks running requests hold keep theirs)."""
        return bool(await self.submit(self.engine.reset_prefix_cache))

    # ---------------------------------------------------------------- sleep mode
    @property
    def is_sleeping(self) -> bool:
        """``LLMEngine.is_sleeping``."""
        return self.engine.is_sleeping

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` on the engine thread, between steps (after the requests queued
        before it were added: those make it refuse). Raises ValueError as it does."""
        await self.submit(self.engine.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLMEngine.wake_up`` on the engine thread (weights read again at level 2 take a
        while: the event loop stays free meanwhile). Raises ValueError as it does."""
        await self.submit(self.engine.wake_up, tags)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora`` on the engine thread; False if it was not loaded."""
        return bool(await self.submit(self.engine.remove_lora, lora_int_id))

    # ---------------------------------------------------------------- engine thread
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _drain_inbox(self) -> None:
        """Apply the queued adds and aborts in order. Consecutive aborts go to the engine as
        one batch: each ``abort_request`` call scans the scheduler's queues, so one call per id
        would cost O(aborts x queued requests) (a dropped client with a batch of 20k prompts
        held the engine thread for minutes)."""
        loop = self._loop
        assert loop is not None, "start() sets the loop before the thread runs"
        aborts: list[str] = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                if aborts:
                    self.engine.abort_request(aborts)
                return
            if msg[0] == "abort":
                aborts.append(msg[1])
                continue
            if aborts:  # keep the inbox order: aborts queued before this add come first
                self.engine.abort_request(aborts)
                aborts = []
            if msg[0] == "call":
                _, fn, args, future = msg
                try:
                    result, error = fn(*args), None
                except Exception as e:  # reported to the caller, never fatal
                    result, error = None, e
                loop.call_soon_threadsafe(_resolve_value, future, result, error)
            elif msg[0] == "add":
                _, rid, prompt, params, priority, accepted, *extra = msg
                lora, tenant, arrival_time = (list(extra) + [None] * 3)[:3]  # all optional
                try:
                    self.engine.add_request(
                        rid,
                        prompt,
                        params,
                        arrival_time=arrival_time,
                        priority=priority,
                        lora_request=lora,
                        tenant=tenant,
                    )
                    loop.call_soon_threadsafe(_resolve, accepted, None)
                except Exception as e:  # invalid input: reported to the caller, never fatal
                    err = e if isinstance(e, (ValueError, EngineSleepingError)) else ValueError(str(e))
                    loop.call_soon_threadsafe(_resolve, accepted, err)

    def _dead_error(self) -> EngineDeadError:
        """A fresh ``EngineDeadError`` saying why the loop stopped (``errored``)."""
        e = self.errored
        return EngineDeadError(str(e) if isinstance(e, EngineDeadError) else f"engine loop stopped: {e!r}")

    def _die(self, error: BaseException) -> None:
        """Stop for good on ``error``: every request in flight, and every add and call still
        in the inbox, gets an ``EngineDeadError`` (none waits for an answer that cannot
        come); the engine's requests are aborted so their blocks are freed."""
        loop = self._loop
        assert loop is not None
        dead = (
            error
            if isinstance(error, EngineDeadError)
            else EngineDeadError(f"engine loop stopped: {error!r}")
        )
        self.errored = dead
        with contextlib.suppress(Exception):  # frees the aborted groups' blocks (no forward runs)
            self.engine.abort_request(list(self.engine._groups))
            self.engine.step()
        if loop.is_closed():  # the caller's loop is gone: nobody is left to answer
            return
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":
                loop.call_soon_threadsafe(_resolve, msg[5], dead)
            elif msg[0] == "call":
                loop.call_soon_threadsafe(_resolve_value, msg[3], None, dead)
        loop.call_soon_threadsafe(self._fail_streams, dead)

    def _fail_streams(self, error: BaseException) -> None:
        # on the event loop, which owns ``_streams``; after the outputs delivered before it
        for stream in list(self._streams.values()):
            stream.put_nowait(error)

    def _check_alive(self) -> bool:
        """False (after ``_die``) when the engine can run no more steps."""
        reason = self.engine.dead_reason()
        if reason is None:
            return True
        logger.error("the engine can run no more steps: %s", reason)
        self._die(EngineDeadError(reason))
        return False

    def _recover(self, error: BaseException) -> bool:
        """After a fault of the engine rather than of a request (a scheduler bug, an abort that
        raised): every request in flight gets an internal error naming it, their blocks are
        freed, and the loop keeps serving. When that fails too, stop for good (``_die``).
        Returns False when the loop must stop."""
        engine = self.engine
        loop = self._loop
        assert loop is not None
        ids = list(engine._groups)
        try:
            engine.abort_request(ids)
            engine.step()  # flush the abort outputs and free blocks
        except Exception:
            self._die(error)
            return False
        for rid in ids:
            err = RuntimeError(f"internal error while running request {rid}: {error!r}")
            loop.call_soon_threadsafe(self._deliver, rid, err)
        return self._check_alive()

    def _run(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None, "start() sets the loop before the thread runs"
        while not self._stopping:
            self._wakeup.clear()
            try:
                self._drain_inbox()
            except Exception as e:  # e.g. an abort that raised: every stream would wait forever
                logger.exception("engine inbox failed; aborting in-flight requests")
                if not self._recover(e):
                    return
                continue
            if not engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                if not self._check_alive():  # e.g. a peer rank died while idle
                    return
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a scheduler bug (step() isolates request faults): fail all, keep serving
                logger.exception("engine step failed; aborting in-flight requests")
                if not self._recover(e):
                    return
                continue
            reason = engine.dead_reason()
            for out in outputs:
                if reason is not None and out.outcome == "failed":
                    continue  # failed by the death: answered engine-dead below instead
                loop.call_soon_threadsafe(self._deliver, out.request_id, out)
            if reason is not None:
                logger.error("the engine can run no more steps: %s", reason)
                self._die(EngineDeadError(reason))
                return
