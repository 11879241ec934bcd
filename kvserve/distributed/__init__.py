"""Data parallelism: N engine replicas on Ray behind one endpoint (or one ``LLM``).

- ``router``: which replica serves a request (``prefix`` | ``least-loaded`` | ``round-robin``);
  pure bookkeeping, no Ray.
- ``replica``: ``EngineReplica``, a full ``LLMEngine`` with its own KV cache, run as a Ray actor.
- ``launcher``: the Ray runtime (local, or a cluster's ``ray_address``), the replica actors, the
  driver's front engine (tokenizer and validation only).
- ``dp_engine``: ``DataParallelAsyncEngine``, ``AsyncLLMEngine``'s interface over the replicas
  (routing, retries and replacement when a replica dies).
- ``dp_metrics``: the server's ``/metrics`` over all replicas (a ``replica`` label).

Importing this package does not import Ray; ``start_data_parallel_engine`` does.
"""

from __future__ import annotations

from kvserve.config import EngineArgs


def start_data_parallel_engine(engine_args: EngineArgs, model_name: str = ""):
    """Start ``engine_args.data_parallel_size`` replicas on Ray and return the
    ``DataParallelAsyncEngine`` over them (its router from ``engine_args.router`` and
    ``router_balance_threshold``, block size from ``block_size``).

    Raises:
        ValueError: Ray missing or unreachable, a bad model or setting (a replica's error).
    """
    from kvserve.distributed.dp_engine import DataParallelAsyncEngine
    from kvserve.distributed.launcher import build_front_engine, start_replicas
    from kvserve.distributed.router import make_router

    n = engine_args.data_parallel_size
    # The model path is checked (and a GGUF converted or its metadata cached once, as the
    # replicas will run it) here, before any replica starts,
    # so N replicas never race to convert it and a bad path fails fast.
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.ops import quant

    resolve_model_dir(engine_args.model, engine_args.resolve_quantization(quant.available()).quantization)
    replicas = start_replicas(engine_args, model_name)
    front = build_front_engine(engine_args, replicas.infos[0])
    cache_blocks = front.cache_config.num_gpu_blocks or 4096
    router = make_router(
        engine_args.router,
        n,
        engine_args.block_size,
        balance_threshold=engine_args.router_balance_threshold,
        cache_blocks=cache_blocks,
    )
    return DataParallelAsyncEngine(front, replicas.actors, replicas.infos, router, model_name)
