"""One engine's tensor-parallel group: its ranks, and the all-reduce the sharded layers call.

Each engine at ``tensor_parallel_size > 1`` gets its own ``TensorParallelGroup``: a
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) built straight from a
``TCPStore`` on 127.0.0.1 rather than the process-global default group, so that two engines
(a TP=1 reference and a TP=2 engine in one test process, or the replicas of a data-parallel
deployment) never share or clash over ``init_process_group``'s global state.

The model layers call ``TensorParallelGroup.all_reduce`` (after the vocab-parallel embedding
and the row-parallel o and down projections) and ``TensorParallelGroup.gather`` (the
vocab-parallel LM head's logits, to the driver); the group counts the calls and the seconds
they take (``stats``, ``gather_stats``), which are the all-reduce and gather shares the
tensor-parallel benchmark reports.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Protocol, cast

import torch
import torch.distributed as dist

from kvserve import envs


def collective_timeout_s() -> float:
    """Seconds a collective may wait for a peer rank before it fails (a rank that died or
    hangs): ``KVSERVE_TP_TIMEOUT_S``, default 120. Idle engines never wait in a collective (step
    inputs travel over pipes, ``kvserve.worker.tp_executor``), so an idle server never times out."""
    return envs.KVSERVE_TP_TIMEOUT_S


def host_store(world_size: int, timeout_s: float | None = None) -> dist.TCPStore:
    """Rank 0's ``TCPStore`` on 127.0.0.1, listening on a port the OS picks as it binds (read it
    from ``.port`` and hand it to the other ranks). Why: a port found free and bound later can be
    taken in between by another process (two engines starting at once). Does not wait for the
    other ranks: ``TensorParallelGroup``'s rendezvous does, within its timeout."""
    timeout = datetime.timedelta(seconds=timeout_s or collective_timeout_s())
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)


@dataclasses.dataclass
class CollectiveStats:
    """Calls, wall seconds and elements (sent by this rank) of one kind of collective on this
    rank since the last ``reset``."""

    calls: int = 0
    seconds: float = 0.0
    elements: int = 0

    def reset(self) -> None:
        self.calls, self.seconds, self.elements = 0, 0.0, 0

    def add(self, elements: int, seconds: float) -> None:
        self.calls += 1
        self.elements += elements
        self.seconds += seconds


class _Collectives(Protocol):
    """What ``TensorParallelGroup`` calls on its gloo or NCCL backend."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> dist.Work: ...


class TensorParallelGroup:
    """This process's rank in one engine's tensor-parallel group.

    Args:
        rank: 0 (the driver, which also hosts the store) .. ``world_size - 1``.
        world_size: the tensor-parallel size T (>= 2).
        port: the ``TCPStore`` port on 127.0.0.1 (rank 0 listens on it).
        store: rank 0's store from ``host_store`` (required on rank 0, None on the others).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one device per rank: ``cuda:<rank>``).
        timeout_s: how long a collective or the rendezvous waits for the others.

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s`` (a rank never came).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,
        device: str,
        timeout_s: float | None = None,
        store: dist.TCPStore | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        #: ``all_reduce`` calls (embedding, o, down); ``gather_stats``: ``gather`` calls (logits).
        self.stats = CollectiveStats()
        self.gather_stats = CollectiveStats()
        timeout = datetime.timedelta(seconds=timeout_s or collective_timeout_s())
        if (store is None) != (rank != 0):
            raise ValueError(f"rank {rank}: the store is rank 0's own (host_store), the others connect to it")
        self._store = store or dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        # torch's stubs declare these backends without their collectives (and Gloo without
        # ``_Options``, the options class its constructor takes), hence the casts
        self.pg: _Collectives
        if device == "cuda":
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            self.pg = cast(_Collectives, dist.ProcessGroupNCCL(self._store, rank, world_size, nccl_opts))
        else:
            gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from the stub
            gloo_opts._timeout = timeout
            gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = cast(_Collectives, dist.ProcessGroupGloo(self._store, rank, world_size, gloo_opts))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over all ranks in place (every rank gets the sum); returns ``t``.

        gloo has no bfloat16 / float16 sum on every build, so those are summed in float32 (the
        partial sums are float32 in the kernels anyway) and cast back.

        Raises:
            RuntimeError: a peer rank died or did not join within the timeout.
        """
        t0 = time.perf_counter()
        if self.device == "cpu" and t.dtype != torch.float32:
            buf = t.float()
            self.pg.allreduce([buf]).wait()
            t.copy_(buf)
        else:
            self.pg.allreduce([t]).wait()
        self.stats.add(t.numel(), time.perf_counter() - t0)
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Collect every rank's ``t`` (same shape and dtype on all ranks) on rank ``dst``:
        returns the T tensors in rank order there, ``None`` on the other ranks.

        Raises:
            RuntimeError: a peer rank died or did not join within the timeout.
        """
        t0 = time.perf_counter()
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        out: list[torch.Tensor] | None
        if self.rank == dst:
            gathered = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather([gathered], [t], opts).wait()
            out = gathered
        else:
            out = None
            self.pg.gather([], [t], opts).wait()
        self.gather_stats.add(t.numel(), time.perf_counter() - t0)
        return out

    def barrier(self) -> None:
        """Wait until every rank arrives (a tiny all-reduce, so it works on both backends)."""
        x = torch.zeros(1, device=self.device)
        self.pg.allreduce([x]).wait()

    def close(self) -> None:
        """Drop the process group and the store (the sockets close; peers' collectives fail)."""
        self.pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
