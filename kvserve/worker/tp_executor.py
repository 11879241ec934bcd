"""The tensor-parallel ranks behind one engine's driver worker (vLLM V0's driver-worker shape).

At ``tensor_parallel_size`` T > 1 the engine's ``Worker`` is rank 0, the *driver*: it starts
T-1 peer processes (``torch.multiprocessing``, spawn), each a ``Worker`` of rank r holding its
1/T shard of the model and of the KV cache, joined to the driver in one
``TensorParallelGroup`` (gloo on CPU, NCCL on CUDA). The scheduler runs once, in the engine
that owns the driver; every step the driver sends each peer the same step (the
``ExecuteModelRequest``: metadata and the blocks to swap in / out / copy), then runs its own
shard, and all ranks meet in the all-reduces of the forward and in the gather of the
vocab-parallel logits (the driver's ``compute_logits`` calls, the peers' ``ModelRunner.logits``).
Only the driver samples.

Why pipes for the step inputs and not a collective broadcast: a peer blocks on its pipe while
the engine is idle, for as long as the server has no requests, with no timeout to expire; and
a driver that dies closes the pipe, so its peers end at once (EOF) instead of waiting out a
collective timeout. The forward's collectives (``parallel_state``) carry the tensors.

Peers never outlive their driver: ``TensorParallelPeers.shutdown`` (the engine's shutdown,
a ``weakref.finalize`` and so interpreter exit) asks them to stop, then terminates and finally
kills any that remain; they are daemonic processes as well. A peer that died is reported by
the next step as a ``RuntimeError`` naming its rank, pid and exit code.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from typing import Any, cast

import torch.multiprocessing as mp

from kvserve import envs
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData

logger = logging.getLogger(__name__)

#: Seconds to wait for a peer to load its shard and join the group.
START_TIMEOUT_S = 300.0
#: Seconds ``shutdown`` waits for peers to exit by themselves before terminating them.
STOP_GRACE_S = 5.0


class SequenceWindow:
    """What a peer's ``ModelRunner`` reads of one ``SequenceData`` in one step: its lengths,
    its computed count and the tokens of ``[start, start + len(tokens))`` (the step's chunk and
    the token after it, the last prompt-logprob target), instead of every token of the
    sequence. The runner reads tokens only through ``token_at`` / ``token_range``, which this
    class serves from the window.

    Why: the step reaches each peer pickled; whole token lists would make its size and its
    pickling time grow with the context, windows keep it a few tokens per sequence.
    """

    __slots__ = ("start", "tokens", "prompt_len", "length", "num_computed")

    def __init__(self, data: SequenceData, chunk: int):
        c = data.get_num_computed_tokens()
        self.start = c
        self.tokens = data.token_range(c, c + chunk + 1)
        self.prompt_len = data.get_prompt_len()
        self.length = data.get_len()
        self.num_computed = c

    def get_num_computed_tokens(self) -> int:
        return self.num_computed

    def get_len(self) -> int:
        return self.length

    def get_prompt_len(self) -> int:
        return self.prompt_len

    def token_range(self, lo: int, hi: int) -> list[int]:
        """Tokens ``lo .. hi - 1`` of the sequence.

        Raises:
            IndexError: the range leaves the window (a runner reading outside its chunk).
        """
        a, b = lo - self.start, min(hi, self.length) - self.start
        if a < 0 or b > len(self.tokens):
            raise IndexError(
                f"tokens {lo}..{hi} are outside this step's window {self.start}..{self.start + len(self.tokens)}"
            )
        return self.tokens[a:b]

    def token_at(self, i: int) -> int:
        """Token ``i`` of the sequence (IndexError outside the window)."""
        return self.token_range(i, i + 1)[0]

    def __getstate__(self):
        return (self.start, self.tokens, self.prompt_len, self.length, self.num_computed)

    def __setstate__(self, state) -> None:
        self.start, self.tokens, self.prompt_len, self.length, self.num_computed = state


@functools.lru_cache(maxsize=64)
def _peer_params(prompt_logprobs: int | None) -> SamplingParams:
    # The peers need no sampling settings: only what shapes the forward and which rows get
    # logits (the prompt-logprob rows join the LM head's gather too).
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)


def for_peers(req: ExecuteModelRequest) -> ExecuteModelRequest:
    """``req`` with what only the driver uses (sampling settings, seeded generators, grammar
    bitmasks) stripped and each sequence's tokens cut to the step's ``SequenceWindow``, so
    that it pickles and stays small whatever the context length. What picks the rows that get
    logits stays (``do_sample``, ``prompt_logprobs_from`` and the prompt-logprobs count): every
    rank computes its slice of the same logits."""
    mds = [
        dataclasses.replace(
            md,
            seq_data={
                # duck-typed: the runner reads only what SequenceWindow serves
                sid: cast(SequenceData, SequenceWindow(data, md.token_chunk_size))
                for sid, data in md.seq_data.items()
            },
            sampling_params=_peer_params(
                md.sampling_params.prompt_logprobs if md.prompt_logprobs_from is not None else None
            ),
            generator=None,
            token_bitmask=None,
        )
        for md in req.seq_group_metadata_list
    ]
    return dataclasses.replace(req, seq_group_metadata_list=mds)


class PeerError(RuntimeError):
    """A tensor-parallel peer rank died, hung or raised."""


def _peer_main(rank: int, world_size: int, port: int, worker_cls: type, configs: tuple, conn) -> None:
    """A peer rank's process: build the ``worker_cls`` shard (``Worker``), then serve the
    driver's calls until ``shutdown`` or until the driver's end of the pipe closes."""
    import signal

    # Ctrl-C reaches the whole process group: the driver decides when its peers stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("started", None))  # imports done: the driver may now wait in the rendezvous
    try:
        worker = worker_cls(*configs, rank=rank, tp_world_size=world_size, tp_port=port)
    except BaseException as e:  # the driver reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            break
        if method == "shutdown":
            break
        try:
            getattr(worker, method)(*args)
            conn.send(("ok", None))
        except BaseException as e:  # the same fault usually hits the driver: it decides
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            except OSError:
                break
    worker.close_group()


class TensorParallelPeers:
    """Ranks 1..T-1 of one engine, seen from the driver.

    Args:
        world_size: T (>= 2). port: the group's store port (the driver listens on it).
        worker_cls: the driver's ``Worker`` class, built in each peer (passed in, so that this
            module, which ``worker`` imports, does not import it back).
        configs: ``(model_config, cache_config, scheduler_config)`` for each peer's ``Worker``.

    ``start`` spawns them (their ``Worker`` then connects to the group the driver creates);
    ``wait_ready`` waits until each has loaded its shard.
    """

    def __init__(self, world_size: int, port: int, worker_cls: type, configs: tuple):
        self.world_size = world_size
        self.port = port
        self._worker_cls = worker_cls
        self._configs = configs
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_peer_main,
                args=(rank, self.world_size, self.port, self._worker_cls, self._configs, child),
                name=f"kvserve-tp-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, list(self._procs), list(self._conns))

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..T-1."""
        return [int(p.pid) for p in self._procs]

    def check_alive(self) -> None:
        """Raises PeerError naming the first peer that is no longer running."""
        for rank, p in enumerate(self._procs, start=1):
            if not p.is_alive():
                raise PeerError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                    "this engine cannot run steps any more (restart it)"
                )

    def send(self, method: str, *args) -> None:
        """Ask every peer to run ``Worker.<method>(*args)``.

        Raises:
            PeerError: a peer is dead or its pipe is closed.
        """
        self.check_alive()
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send((method, args))
            except OSError as e:
                raise PeerError(f"tensor-parallel worker rank {rank} is unreachable: {e}") from e

    def collect(self, timeout_s: float) -> list[str]:
        """Wait for every peer's reply to the last ``send``; returns the error messages
        (``"rank r: ..."``), empty when all succeeded.

        Raises:
            PeerError: a peer died or did not answer within ``timeout_s``.
        """
        errors = []
        deadline = time.monotonic() + timeout_s
        for rank, (conn, p) in enumerate(zip(self._conns, self._procs), start=1):
            status, msg = self._receive(rank, conn, p, deadline, timeout_s, "during the step")
            if status != "ok":
                errors.append(f"rank {rank}: {msg}")
        return errors

    def wait_started(self) -> None:
        """Wait until every peer process is up (its imports done, about to join the group), so
        that one that dies at start (an import error, a script without a ``__main__`` guard)
        is reported at once rather than after the rendezvous timeout.

        Raises:
            PeerError: a peer exited first, naming its rank and exit code.
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, p) in enumerate(zip(self._conns, self._procs), start=1):
            status, _ = self._receive(
                rank,
                conn,
                p,
                deadline,
                START_TIMEOUT_S,
                "while starting (a script that starts tensor-parallel engines needs an "
                "`if __name__ == '__main__':` guard)",
            )
            if status != "started":
                raise PeerError(f"tensor-parallel worker rank {rank} sent {status!r} before starting")

    @staticmethod
    def _receive(rank: int, conn, p, deadline: float, timeout_s: float, when: str):
        """Rank ``rank``'s next ``(status, message)`` from its pipe, polled so that a dead peer
        or a passed ``deadline`` (``time.monotonic()``) is a ``PeerError`` naming the rank and
        ``when`` it happened, never a hang."""
        while not conn.poll(0.2):
            if not p.is_alive():
                raise PeerError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode} {when}"
                )
            if time.monotonic() > deadline:
                raise PeerError(
                    f"tensor-parallel worker rank {rank} did not answer within {timeout_s:g} s {when}"
                )
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            raise PeerError(f"tensor-parallel worker rank {rank} closed its pipe {when}: {e!r}") from e

    def wait_ready(self) -> None:
        """Raises PeerError if a peer failed to load its shard (with its message)."""
        errors = self.collect(START_TIMEOUT_S)
        if errors:
            raise PeerError("tensor-parallel worker failed to start: " + "; ".join(errors))

    def shutdown(self) -> None:
        """Stop every peer (ask, then terminate, then kill); idempotent."""
        if self._finalizer is not None:
            self._finalizer()


def _stop(procs: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            logger.warning("tensor-parallel worker pid %s ignored SIGTERM; killing it", p.pid)
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


def threads_per_rank(num_cpus: int, world_size: int) -> int:
    """Torch / OpenMP threads for each of ``world_size`` ranks sharing ``num_cpus`` cores
    (``KVSERVE_NUM_THREADS`` overrides): the cores split evenly, at least one each."""
    n = envs.KVSERVE_NUM_THREADS
    if n is not None:
        return n
    return max(1, num_cpus // world_size)
