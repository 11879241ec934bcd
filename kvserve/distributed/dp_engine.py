"""The driver's engine for data parallelism: ``AsyncLLMEngine``'s interface over N replicas.

``DataParallelAsyncEngine`` is what the OpenAI server (and ``LLM(data_parallel_size=N)``) hands
requests to. Each request goes to the replica its ``Router`` picks from the prompt's token ids
and the replicas' outstanding requests; the replica (a Ray actor, ``replica.EngineReplica``)
streams its ``RequestOutput``s back. ``engine`` is the front engine (``launcher``): tokenizer,
configs and validation, exactly those of a replica, so every server route validates as the
single-process server does.

Replica death: Ray restarts a dead replica's actor (``max_restarts``); meanwhile it is marked
down, so the router sends nothing there, and it is back (its prefix record cleared) once the
new process answers. A request on it that had streamed nothing yet is sent to another replica;
one that had streamed tokens ends with ``ReplicaDiedError`` (a 503 ``engine_dead`` answer, or an
error event in a stream), since its output cannot be resumed elsewhere. A replica that does not
answer within ``RECOVERY_TIMEOUT_S`` of being marked down (Ray's restarts used up, its node
gone, a model that no longer loads) is given up on: dead for good, its actor killed, never
routed to again; the others serve on and ``/health`` reports it (``replica_states``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.distributed.router import Router
from kvserve.engine.async_llm_engine import EngineDeadError
from kvserve.engine.input_processor import PromptType
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.distributed")

#: Seconds between liveness pings of each replica (deaths between requests are seen this soon).
HEALTH_CHECK_INTERVAL_S = 1.0
#: A ping not answered within this many seconds marks the replica down.
HEALTH_CHECK_TIMEOUT_S = 30.0
#: A replica down for this many seconds without answering a ping is dead for good (its
#: replacement loads the model, which takes seconds to minutes: this leaves room for that).
RECOVERY_TIMEOUT_S = 600.0


class ReplicaDiedError(EngineDeadError):
    """The replica running a request died after the request had streamed output."""


@dataclass
class ReplicaState:
    """Driver-side view of one replica."""

    index: int
    actor: Any
    pid: int
    node: str
    healthy: bool = True
    dead: bool = False  # given up on (not back within the recovery timeout): never routed again
    down_since: float = 0.0  # clock() when last marked down
    outstanding: int = 0  # requests sent and not yet ended
    routed: int = 0  # requests ever sent here
    restarts: int = 0
    recovering: asyncio.Task | None = None


def _unwrap(ray, e: BaseException) -> BaseException:
    """The exception a replica raised (Ray wraps it in a ``RayTaskError``)."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return e


def _raise_if_cancelling() -> None:
    """Re-raise a cancellation of the current task that ``asyncio.wait_for`` swallowed.

    Before Python 3.12, ``wait_for`` returns (or raises) its inner result instead of
    ``CancelledError`` when the task is cancelled just as the inner call finishes: a ping that
    fails at once then looks like one more failed ping, and a cancelled recovery would go on
    pinging until its deadline (``recovery_timeout_s``). Raises ``CancelledError`` when
    the current task has a cancellation pending (``Task.cancelling``, Python 3.11+; on 3.10 it
    does nothing)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


class DataParallelAsyncEngine:
    """``AsyncLLMEngine``'s interface (``generate``, ``abort``, ``start``, ``shutdown``,
    ``num_in_flight``, ``errored``, ``engine``) over data-parallel replicas.

    Args:
        front_engine: the driver's ``LLMEngine`` without an executor (``launcher.build_front_engine``).
        actors: the replicas' Ray actor handles (``launcher.start_replicas``).
        infos: what each replica reported at start (``pid``, ``node``).
        router: picks a replica per request.
        model_name: the ``model_name`` metrics label.
        recovery_timeout_s: seconds a replica marked down may take to answer again before it
            is marked dead for good (``RECOVERY_TIMEOUT_S``).
        health_check_interval_s, health_check_timeout_s: the pings' period and deadline.
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        front_engine,
        actors: list,
        infos: list[dict],
        router: Router,
        model_name: str = "",
        *,
        recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
        health_check_interval_s: float = HEALTH_CHECK_INTERVAL_S,
        health_check_timeout_s: float = HEALTH_CHECK_TIMEOUT_S,
        clock=time.monotonic,
    ):
        import ray

        self._ray = ray
        self.recovery_timeout_s = recovery_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self._clock = clock
        self.engine = front_engine
        self.router = router
        self.model_name = model_name
        self.replicas = [
            ReplicaState(i, a, int(info["pid"]), str(info["node"]))
            for i, (a, info) in enumerate(zip(actors, infos))
        ]
        self.errored: BaseException | None = None
        self._thread: Any = None  # the server's lifespan starts an engine whose _thread is None
        self._supervisor: asyncio.Task | None = None
        self._inflight: dict[str, int] = {}  # request id -> replica index
        self._waiting: set[str] = set()  # sent, no output yet
        self.num_retried = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the health checks on the running event loop."""
        self._thread = self  # the server reads _thread.is_alive() for /health
        self._supervisor = asyncio.ensure_future(self._watch())

    def is_alive(self) -> bool:
        """True while at least one replica is up."""
        return any(r.healthy for r in self.replicas)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the health checks and the replicas (in-flight requests should have ended)."""
        if self._supervisor is not None:
            self._supervisor.cancel()
        for r in self.replicas:
            if r.recovering is not None:
                r.recovering.cancel()
            with contextlib.suppress(Exception):
                self._ray.kill(r.actor, no_restart=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def num_waiting(self) -> int:
        """Requests sent to a replica that have produced no output yet (the server's
        ``max_waiting`` check counts these)."""
        return len(self._waiting)

    def loads(self) -> list[int]:
        return [r.outstanding for r in self.replicas]

    def healthy(self) -> list[bool]:
        return [r.healthy for r in self.replicas]

    def replica_states(self) -> list[str]:
        """Each replica's state: ``"up"``, ``"recovering"`` (down, its replacement awaited) or
        ``"dead"`` (not back within ``recovery_timeout_s``: given up on)."""
        return ["up" if r.healthy else "dead" if r.dead else "recovering" for r in self.replicas]

    # ---------------------------------------------------------------- replica health
    def mark_down(self, index: int, reason: BaseException | str) -> None:
        """Replica ``index`` died: route nothing there until its replacement answers."""
        r = self.replicas[index]
        if not r.healthy or r.dead:
            return
        logger.warning("replica %d (pid %d) is down: %s; waiting for its replacement", index, r.pid, reason)
        r.healthy = False
        r.down_since = self._clock()
        self.router.reset_replica(index)
        self._resume_recovery()

    def _resume_recovery(self) -> None:
        """Make sure every replica that is down (not given up on) has its recovery running: a
        ``generate`` batch of ``LLM`` runs on an event loop of its own, which takes any task
        still pending with it when it ends; the next call starts it again (same deadline)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: started at the next generate
            return
        for r in self.replicas:
            if r.healthy or r.dead or (r.recovering is not None and not r.recovering.done()):
                continue
            r.recovering = loop.create_task(self._recover(r))

    async def _recover(self, r: ReplicaState) -> None:
        ray = self._ray
        deadline = r.down_since + self.recovery_timeout_s
        while True:
            left = deadline - self._clock()
            if left <= 0:
                self._give_up(r)
                return
            try:
                pid = await asyncio.wait_for(r.actor.ping.remote(), min(self.health_check_timeout_s, left))
            except (asyncio.TimeoutError, ray.exceptions.RayError):  # any failed ping: try again
                _raise_if_cancelling()
                await asyncio.sleep(max(0.0, min(self.health_check_interval_s, deadline - self._clock())))
                continue
            # Ray restarted the actor: a new process with an empty KV cache
            self.router.reset_replica(r.index)
            r.pid, r.healthy, r.recovering = int(pid), True, None
            r.restarts += 1
            logger.warning("replica %d is back (pid %d, restart %d)", r.index, r.pid, r.restarts)
            return

    def _give_up(self, r: ReplicaState) -> None:
        """``r`` did not come back in time: dead for good (its actor killed, so a late restart
        holds no resources nobody routes to); the other replicas serve on."""
        r.dead, r.recovering = True, None
        logger.error(
            "replica %d did not come back within %.0f s; giving up on it (%d of %d replicas up)",
            r.index,
            self.recovery_timeout_s,
            sum(x.healthy for x in self.replicas),
            len(self.replicas),
        )
        with contextlib.suppress(Exception):
            self._ray.kill(r.actor, no_restart=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            # all at once: one hung replica must not delay the others' checks by its timeout
            await asyncio.gather(*(self._ping(r) for r in self.replicas if r.healthy))

    async def _ping(self, r: ReplicaState) -> None:
        """One liveness check of a healthy replica: marks it down when the ping fails or times
        out, and resets its routing state when Ray restarted it since the last ping."""
        ray = self._ray
        try:
            pid = await asyncio.wait_for(r.actor.ping.remote(), self.health_check_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError) as e:
            _raise_if_cancelling()
            self.mark_down(r.index, e)
            return
        if int(pid) != r.pid:  # restarted between two pings
            self.router.reset_replica(r.index)
            r.pid = int(pid)
            r.restarts += 1

    # ---------------------------------------------------------------- requests
    @staticmethod
    def _prompt_ids(prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            return list(prompt)
        return []  # a text prompt (not from the server): routed by load alone

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs from the replica the router picks (the single engine's
        signature; ``lora_request`` must be None: replicas serve no adapters).

        Raises:
            ValueError: invalid input, a duplicate id (the replica's own check), or a
                ``lora_request``.
            EngineDeadError: no replica is up.
            ReplicaDiedError: its replica died after it had streamed output.
        """
        if lora_request is not None:
            raise ValueError("lora_request is not supported with data_parallel_size > 1.")
        ray = self._ray
        if request_id in self._inflight:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        ids = self._prompt_ids(prompt)
        self._resume_recovery()
        attempts = 0
        while True:
            attempts += 1
            if not self.is_alive():
                raise EngineDeadError("no data-parallel replica is up")
            idx = self.router.select(ids, self.loads(), self.healthy())
            self.router.on_routed(idx, ids)
            r = self.replicas[idx]
            r.outstanding += 1
            r.routed += 1
            self._inflight[request_id] = idx
            self._waiting.add(request_id)
            streamed = False
            finished = False
            try:
                gen = r.actor.generate.options(num_returns="streaming").remote(
                    prompt, params, request_id, priority
                )
                async for ref in gen:
                    out = await ref
                    if not streamed:
                        streamed = True
                        self._waiting.discard(request_id)
                    finished = out.finished
                    yield out
                    if finished:
                        return
                # a stream that ends without a finished output: the replica went away
                raise ray.exceptions.RayActorError()
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                cause = _unwrap(ray, e)
                if isinstance(e, ray.exceptions.RayTaskError) and not isinstance(cause, EngineDeadError):
                    raise cause from None  # the request's own error (a ValueError)
                # the actor died, or lives with an engine that can run no more steps (its
                # ping then ends the process, so Ray replaces it): a dead replica either way
                self.mark_down(idx, cause)
                if streamed:
                    raise ReplicaDiedError(
                        f"replica {idx} died while running request {request_id} (after it had "
                        "streamed output); retry the request"
                    ) from None
                if attempts > len(self.replicas):
                    raise EngineDeadError(f"request {request_id}: every replica tried has died") from None
                self.num_retried += 1
                logger.warning("request %s: replica %d died before any output; retrying", request_id, idx)
                continue
            finally:
                r.outstanding -= 1
                self._inflight.pop(request_id, None)
                self._waiting.discard(request_id)
                if not finished and r.healthy:
                    # the caller went away (or an error): free its blocks on the replica now
                    self._abort_on(idx, request_id)

    async def compile_constraint(self, constraint) -> None:
        """Compile a structured-output constraint (``StructuredOutputsParams``) on a replica
        that is up, so that this (front) process never runs the grammar engine: its compile is
        where a hostile constraint costs the most. The replica keeps it cached; the one the
        request is routed to compiles it again if it is another. With no replica answering,
        nothing is checked here (``generate`` then fails or retries as usual).

        Raises:
            ValueError: naming the constraint's field (the replica's compile error).
        """
        ray = self._ray
        for r in self.replicas:
            if not r.healthy:
                continue
            try:
                await r.actor.compile_constraint.remote(constraint)
                return
            except ray.exceptions.RayError as e:
                cause = _unwrap(ray, e)
                if isinstance(cause, ValueError):
                    raise cause from None
                continue  # the replica died or failed: try the next one

    def _abort_on(self, idx: int, request_id: str) -> None:
        with contextlib.suppress(Exception):
            self.replicas[idx].actor.abort.remote(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its stream ends with ``abort``."""
        idx = self._inflight.get(request_id)
        if idx is not None:
            self._abort_on(idx, request_id)

    async def reset_prefix_cache(self) -> bool:
        """Reset every live replica's prefix cache (and the router's record of what each
        holds). True if every replica answered and has no cached block left."""
        results = await self.replica_calls("reset_prefix_cache")
        for r in self.replicas:
            self.router.reset_replica(r.index)
        live = sum(1 for r in self.replicas if r.healthy)
        return len(results) == live and all(bool(v) for _, v in results)

    # ---------------------------------------------------------------- observability
    async def replica_calls(self, method: str, timeout_s: float = 5.0) -> list[tuple[int, Any]]:
        """``(index, result)`` of ``method()`` on every replica that is up and answers in time."""
        ray = self._ray
        live = [r for r in self.replicas if r.healthy]

        async def one(r: ReplicaState):
            try:
                return r.index, await asyncio.wait_for(getattr(r.actor, method).remote(), timeout_s)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                return r.index, None

        results = await asyncio.gather(*(one(r) for r in live))
        return [(i, v) for i, v in results if v is not None]

    def make_metrics(self, model_name: str):
        """The server's ``/metrics`` for this engine (``dp_metrics.DataParallelMetrics``)."""
        from kvserve.distributed.dp_metrics import DataParallelMetrics

        return DataParallelMetrics(self, model_name)


def run_batch(
    dp: DataParallelAsyncEngine,
    requests: list[tuple[str, PromptType, SamplingParams, int]],
    use_tqdm: bool = False,
) -> list[RequestOutput]:
    """``LLM.generate`` over replicas: validate every ``(request_id, prompt, params,
    priority)`` with the front engine first (a ``ValueError`` before anything is sent, as with
    one engine), then run them all concurrently; returns the final outputs in request order.

    Prompts go to the replicas as token ids (tokenized here), so the router sees their
    prefixes. A request whose replica died after streaming ends ``failed`` with the error.
    """
    from tqdm.auto import tqdm

    from kvserve.engine.input_processor import tokenize_prompt, truncate_prompt
    from kvserve.field_limits import LIMITS

    front = dp.engine
    prepared = []
    for rid, prompt, params, prio in requests:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        LIMITS["priority"].check("priority", prio)
        text, ids = tokenize_prompt(prompt, front.tokenizer)
        ids = truncate_prompt(ids, params, front.scheduler_config.max_model_len)
        front.validate(ids, params)
        prepared.append((rid, {"prompt": text, "prompt_token_ids": ids}, params, prio))

    async def run_all() -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prepared), desc="Generating", unit="req", disable=not use_tqdm)

        async def one(rid, prompt, params, prio):
            last: RequestOutput | None = None
            try:
                async for out in dp.generate(prompt, params, rid, priority=prio):
                    last = out
            except EngineDeadError as e:  # its replica died mid-stream: ends failed, alone
                outs = last.outputs if last is not None else [CompletionOutput(0, "", [])]
                for o in outs:
                    o.finish_reason = "error"
                last = RequestOutput(
                    rid, prompt["prompt"], prompt["prompt_token_ids"], outs, finished=True, error=str(e)
                )
            assert last is not None, "a request's stream ends with its final output"
            final[rid] = last
            bar.update(1)

        try:
            await asyncio.gather(*(one(*p) for p in prepared))
        finally:
            bar.close()
        return final

    final = asyncio.run(run_all())
    return [final[rid] for rid, *_ in prepared]
