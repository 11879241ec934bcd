"""One data-parallel replica: a full ``LLMEngine`` (its own KV cache) inside a Ray actor.

``EngineReplica`` is a plain class; ``launcher.py`` turns it into an async Ray actor, so this
module never imports Ray. In the actor process the engine steps on the ``AsyncLLMEngine``
thread as in the single-process server; the actor's event loop only moves requests in and
outputs out. ``generate`` is an async generator: Ray streams each ``RequestOutput`` to the
caller as it is yielded.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from kvserve.config import EngineArgs
from kvserve.engine.input_processor import PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

#: Families the driver owns (HTTP answers are counted where they are sent).
_DRIVER_FAMILIES = ("kvserve:http_responses",)


class EngineReplica:
    """An engine replica (run as a Ray actor by ``launcher.start_replicas``).

    Args:
        engine_args: the replica's settings (``EngineArgs.replica_args()``: passed through as
            they are, tensor-parallel ones included).
        replica_id: its index among the replicas (the ``replica`` metrics label).
        model_name: the ``model_name`` metrics label.

    Raises:
        ValueError: from ``LLMEngine.from_engine_args`` (a bad model path or setting).
    """

    def __init__(self, engine_args: EngineArgs, replica_id: int, model_name: str):
        from kvserve.engine.async_llm_engine import AsyncLLMEngine
        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.engine.prometheus import ServerMetrics

        self.replica_id = replica_id
        self.engine = LLMEngine.from_engine_args(engine_args)
        self.async_engine = AsyncLLMEngine(self.engine)
        self.metrics = ServerMetrics(self.engine, model_name)

    def _ensure_started(self) -> None:
        if self.async_engine._thread is None:
            self.async_engine.start(asyncio.get_running_loop())

    async def info(self) -> dict[str, Any]:
        """What the driver needs to mirror this engine: its configs, vocabulary size, EOS id,
        and where it runs (``pid``, ``node``)."""
        self._ensure_started()
        e = self.engine
        return {
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "model_config": e.model_config,
            "cache_config": e.cache_config,
            "scheduler_config": e.scheduler_config,
            "vocab_size": e.vocab_size,
            "eos_token_id": e.eos_token_id,
            "speculative_config": e.speculative_config,
        }

    async def ping(self) -> int:
        """Liveness: the process id (so a replaced replica shows a new one). A replica whose
        engine loop has stopped for good (``errored``: e.g. a tensor-parallel peer rank died)
        ends its process instead (exit code 70), so that Ray starts a fresh one."""
        if getattr(self.async_engine, "errored", None) is not None:
            print(
                f"replica {getattr(self, 'replica_id', '?')}: engine dead ({self.async_engine.errored}); exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(70)
        return os.getpid()

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (the last has ``finished=True``; ``tenant``: the
        scheduler's ``SequenceGroup.tenant``). Raises ValueError (invalid input, duplicate id)
        before anything is queued."""
        self._ensure_started()
        so = getattr(params, "structured_outputs", None)
        if so is not None:
            # compiled here, off the event loop, as the server does: the engine thread then
            # finds it in the cache at add_request instead of compiling inside a step
            await self.compile_constraint(so)
        async for out in self.async_engine.generate(
            prompt, params, request_id, priority=priority, tenant=tenant
        ):
            yield out

    async def compile_constraint(self, constraint) -> None:
        """Compile a ``StructuredOutputsParams`` here (cached for the request that follows), off
        the event loop; the grammar compiler runs it on its own large-stack thread with a
        timeout. Raises ValueError naming the constraint's field."""
        await asyncio.to_thread(self.engine.structured_output.compile, constraint)

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its stream ends with ``abort``."""
        self.async_engine.abort(request_id)

    async def load(self) -> dict[str, int]:
        """Queue lengths now: ``waiting``, ``running``, ``swapped``, ``in_flight``."""
        s = self.engine.scheduler
        return {
            "waiting": len(s.waiting),
            "running": len(s.running),
            "swapped": len(s.swapped),
            "in_flight": self.async_engine.num_in_flight,
        }

    async def reset_prefix_cache(self) -> bool:
        """``AsyncLLMEngine.reset_prefix_cache`` of this replica."""
        return await self.async_engine.reset_prefix_cache()

    async def kv_cache_stats(self) -> dict[str, Any]:
        """``LLMEngine.get_kv_cache_stats()`` of this replica."""
        return dict(self.engine.get_kv_cache_stats())

    async def metric_families(self) -> list:
        """This replica's Prometheus families (``prometheus_client`` ``Metric``s, without the
        vLLM aliases and the HTTP counter: the driver adds both)."""
        return [f for f in self.metrics.source.collect() if f.name not in _DRIVER_FAMILIES]

    async def shutdown(self) -> None:
        """Stop the engine thread."""
        await asyncio.get_running_loop().run_in_executor(None, self.async_engine.shutdown)
