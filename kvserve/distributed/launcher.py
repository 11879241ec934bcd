"""Start the Ray runtime (or join a cluster) and the engine replicas; build the driver's
front engine (tokenizer, configs and validation, no model, no KV cache).

Ray is imported here, and only when ``data_parallel_size > 1`` asks for it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineArgs

logger = logging.getLogger("kvserve.distributed")

#: How long replicas may take to load their model before the launch fails (seconds).
REPLICA_START_TIMEOUT_S = 600.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "data_parallel_size > 1 runs its replicas on Ray, which is not installed: "
            "pip install 'kvserve[ray]' (or pip install ray)."
        ) from None
    return ray


#: How long the pre-flight check waits for a cluster address to accept a connection (seconds).
CONNECT_CHECK_TIMEOUT_S = 5.0


def check_ray_address(address: str) -> None:
    """Fail fast on a cluster address nothing answers at: Ray's own client keeps retrying the
    head for minutes. ``auto`` / ``local`` are left to Ray; ``HOST:PORT`` (or
    ``ray://HOST:PORT``) must accept a TCP connection within ``CONNECT_CHECK_TIMEOUT_S``.

    Raises:
        ValueError: a malformed address, or nothing listening there (naming ``ray_address``).
    """
    import socket

    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray_address must be 'auto' or HOST:PORT (e.g. 10.0.0.1:6379), got {address!r}.")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_CHECK_TIMEOUT_S):
            pass
    except OSError as e:
        raise ValueError(
            f"ray_address {address!r}: no Ray head answers at {host}:{port} ({e}); start one with "
            "`ray start --head --port PORT` on that machine."
        ) from None


def init_ray(address: str | None, num_replicas: int) -> Any:
    """Join the Ray cluster at ``address`` (``auto``, ``HOST:PORT``), or start a local runtime
    when None (with at least ``num_replicas`` CPUs, so every replica can be placed). A runtime
    already initialised in this process is used as it is. Returns the ``ray`` module.

    Raises:
        ValueError: Ray is not installed, or the cluster cannot be reached (naming the address).
    """
    ray = _import_ray()
    if address is not None:
        check_ray_address(address)
    if ray.is_initialized():
        return ray
    try:
        if address is None:
            ray.init(
                address="local",  # a runtime of our own, even if a cluster runs on this machine
                num_cpus=max(num_replicas, os.cpu_count() or 1),
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:
        raise ValueError(f"ray_address {address!r}: cannot connect to the Ray cluster ({e}).") from None
    return ray


def replica_actor_options(engine_args: EngineArgs, num_cpus: int = 1) -> dict[str, Any]:
    """Ray actor options of one replica: restarted by Ray when its process dies (a request in
    flight then fails, never re-runs silently), spread over the cluster's nodes, ``num_cpus``
    CPUs (Ray sets the actor's ``OMP_NUM_THREADS`` to it, so it is the replica's thread count)
    and, when the engine runs on CUDA, one GPU per tensor-parallel rank (the replica's driver
    spawns its peer ranks inside the actor's reservation)."""
    opts: dict[str, Any] = {
        "max_restarts": -1,
        "max_task_retries": 0,
        "num_cpus": num_cpus,
        "scheduling_strategy": "SPREAD",
    }
    device = engine_args.device
    if device == "cuda" or (device == "auto" and _cuda_available()):
        opts["num_gpus"] = engine_args.tensor_parallel_size
    return opts


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class ReplicaSet:
    """The replicas' actor handles and what each reported at start (``EngineReplica.info``)."""

    actors: list[Any]
    infos: list[dict[str, Any]]


def start_replicas(engine_args: EngineArgs, model_name: str) -> ReplicaSet:
    """Start ``engine_args.data_parallel_size`` replicas (each ``engine_args.replica_args()``)
    and wait until every one has loaded its model.

    Raises:
        ValueError: Ray missing or unreachable, or a replica failed to start (its error).
    """
    from kvserve.distributed.replica import EngineReplica

    n = engine_args.data_parallel_size
    ray = init_ray(engine_args.ray_address, n)
    actor_cls = ray.remote(EngineReplica)
    # the cluster's CPUs shared evenly: each replica's engine threads get cores of their own
    per_replica = max(1, int(ray.cluster_resources().get("CPU", n)) // n)
    opts = replica_actor_options(engine_args, per_replica)
    args = engine_args.replica_args()
    actors = [actor_cls.options(**opts).remote(args, i, model_name) for i in range(n)]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=REPLICA_START_TIMEOUT_S)
    except Exception as e:
        for a in actors:
            ray.kill(a, no_restart=True)
        cause = getattr(e, "cause", None)
        raise ValueError(f"a data-parallel replica failed to start: {cause or e}") from None
    for i, info in enumerate(infos):
        logger.info("replica %d: pid %d on %s", i, info["pid"], info["node"])
    return ReplicaSet(actors, infos)


def build_front_engine(engine_args: EngineArgs, info: dict[str, Any]):
    """An ``LLMEngine`` without an executor, mirroring a replica's configs (``info``) with the
    tokenizer loaded here: the server and ``LLM`` validate and tokenize with it exactly as the
    single-process engine does; it never steps."""
    from kvserve.engine.llm_engine import LLMEngine, load_generation_defaults
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.ops import quant
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(
        engine_args.model, engine_args.resolve_quantization(quant.available()).quantization
    )
    tokenizer = load_tokenizer(model_dir)
    return LLMEngine(
        info["model_config"],
        info["cache_config"],
        info["scheduler_config"],
        executor=None,
        tokenizer=tokenizer,
        vocab_size=info["vocab_size"],
        eos_token_id=info["eos_token_id"],
        speculative_config=info["speculative_config"],
        generation_defaults=load_generation_defaults(engine_args, model_dir),
    )
