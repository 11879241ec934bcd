"""Vocab-parallel LM head and embedding (Megatron's split of the vocabulary over the ranks).

With a tensor-parallel group of size T, rank r holds rows ``[r*S, (r+1)*S)`` of the LM head
(and, where the embedding is sharded, of the embedding table), ``S = ceil(vocab / T)``; the
vocabulary is padded with zero rows to ``T*S``, so only the last rank(s) hold padding.

- LM head (always, at T > 1): each rank computes its ``[N, S]`` float32 slice of the logits of
  the rows that need them (the sampler's rows, then any prompt-logprob rows) and the driver
  (rank 0) gathers them into ``[N, vocab]``; the padded columns are dropped there, never
  sampled.
- Embedding (``embedding_is_sharded``): each rank looks up the ids in its range (ids outside it
  give zero rows) and the partial ``[tokens, hidden]`` results are summed over the ranks (one
  all-reduce per forward). Ids are validated against the vocabulary before they reach the model
  (``engine.input_processor``), so no id falls in the padding or outside every range.

Why the embedding stays replicated on CPU: a replicated lookup costs microseconds, while the
sharded one adds a masked lookup and an all-reduce of ``[tokens, hidden]`` to every forward (one
more latency-bound collective: 2 x layers + 1 instead of 2 x layers), to save ``(T - 1) / T`` of
a table that host memory holds easily. On CUDA, where device memory is the limit and an NCCL
all-reduce is cheap, the table is sharded.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvserve import envs

#: Environment override of ``embedding_is_sharded``: ``1`` shards the table, ``0`` replicates it.
SHARD_EMBEDDING_ENV = "KVSERVE_TP_SHARD_EMBEDDING"


def embedding_is_sharded(tp, device) -> bool:
    """Whether a model under the tensor-parallel group ``tp`` (None: one process) on ``device``
    splits its embedding table by vocabulary rows: on CUDA yes (device memory is what runs out;
    an NCCL all-reduce of ``[tokens, hidden]`` is cheap), on CPU no (see the module docstring
    for the measurement). ``KVSERVE_TP_SHARD_EMBEDDING`` (``0`` / ``1``) overrides, for every
    rank (the peers inherit the environment).

    Raises:
        ValueError: the override is neither ``0`` nor ``1``.
    """
    if tp is None:
        return False
    override: bool | None = envs.KVSERVE_TP_SHARD_EMBEDDING  # raises ValueError unless 0 / 1
    if override is not None:
        return override
    return str(device).startswith("cuda")


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """One rank's range of the vocabulary.

    Attributes:
        vocab_size: the model's vocabulary V. world_size: T. rank: r.
        rows: ``S = ceil(V / T)`` rows per rank (V at T = 1).
        start: the first token id this rank holds, ``r * S``.
        end: one past the last real token id it holds, ``min((r + 1) * S, V)`` (may equal
            ``start`` for a rank that holds only padding, when T > V / S).
    """

    vocab_size: int
    world_size: int
    rank: int
    rows: int
    start: int
    end: int

    @classmethod
    def of(cls, vocab_size: int, world_size: int, rank: int) -> VocabShard:
        """Rank ``rank``'s shard of a ``vocab_size`` vocabulary over ``world_size`` ranks.

        Raises:
            ValueError: ``vocab_size < 1``, ``world_size < 1`` or ``rank`` outside ``[0, T)``.
        """
        if vocab_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad vocab shard: vocab_size={vocab_size}, world_size={world_size}, rank={rank}"
            )
        rows = -(-vocab_size // world_size)
        start = min(rank * rows, vocab_size)
        return cls(vocab_size, world_size, rank, rows, start, min(start + rows, vocab_size))

    @property
    def padded_vocab(self) -> int:
        """``T * S``: the vocabulary padded to a multiple of T."""
        return self.world_size * self.rows

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``[S, ...]`` rows of the full ``[V, ...]`` tensor ``full`` (a view when no
        padding is needed, else a copy with zero rows appended).

        Raises:
            ValueError: ``full`` does not have V rows.
        """
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocabulary rows, got {full.shape[0]}")
        part = full[self.start : self.end]
        if part.shape[0] == self.rows:
            return part
        pad = full.new_zeros((self.rows - part.shape[0], *full.shape[1:]))
        return torch.cat([part, pad])


def embedding(input_ids: torch.Tensor, table: torch.Tensor, shard: VocabShard, tp) -> torch.Tensor:
    """Embedding rows ``[T, hidden]`` of ``input_ids`` (int64 ``[T]``, in ``[0, V)``) looked up
    in this rank's ``table`` ``[S, hidden]`` and summed over the ranks (``tp.all_reduce``):
    every rank returns the full rows."""
    local = input_ids - shard.start
    outside = (local < 0) | (local >= shard.end - shard.start)
    x = F.embedding(local.masked_fill(outside, 0), table)
    x.masked_fill_(outside.unsqueeze(1), 0)
    return tp.all_reduce(x)


def gather_logits(local: torch.Tensor, shard: VocabShard, tp) -> torch.Tensor | None:
    """The full float32 logits ``[N, V]`` on rank 0 from every rank's ``local`` ``[N, S]``
    slice (``tp.gather``); ``None`` on the other ranks. Every rank must call it with the same
    N (the same rows), as the forward's collectives."""
    if local.shape[0] == 0:  # N comes from the step's metadata, the same on every rank
        return None if tp.rank else local.new_empty((0, shard.vocab_size))
    parts = tp.gather(local.contiguous())
    if parts is None:
        return None
    full = torch.cat(parts, dim=1)
    if full.shape[1] != shard.vocab_size:
        full = full[:, : shard.vocab_size].contiguous()  # the padding is never sampled
    return full
