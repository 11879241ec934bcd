"""What the paged KV cache can hold for one request: the admission check that stands beside
``max_model_len`` (a request whose sequences can never fit the cache is refused, not cut short)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCapacity:
    """The device KV pool as admission sees it.

    Attributes:
        num_blocks: blocks one request may fill: the pool minus the watermark, the scheduler's
            admission rule (a request preempted by recompute must fit it again to come back).
        block_size: tokens per block.
        num_total_blocks: blocks in the pool (for messages).
        watermark_blocks: blocks admission keeps free (for messages).
    """

    num_blocks: int
    block_size: int
    num_total_blocks: int
    watermark_blocks: int

    @property
    def num_tokens(self) -> int:
        """Token slots one sequence can hold: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    def blocks_needed(self, prompt_len: int, max_tokens: int, num_seqs: int, identical: bool = False) -> int:
        """Blocks a request needs at its longest: every sequence holding ``prompt_len +
        max_tokens - 1`` tokens (the last generated token is returned, never written to the
        cache).

        The ``num_seqs`` sequences (``n``, or ``best_of``) share the prompt's full blocks; each
        holds its own blocks from there on, the prompt's last partial block included (copied on
        its first write, as the block manager's copy-on-write does after the fork). With one
        sequence this is ``ceil((prompt_len + max_tokens - 1) / block_size)``.

        ``identical``: the sequences generate the same tokens (greedy decoding). The scheduler
        then recomputes a group that outgrows the cache, and the re-prefill shares every full
        block the sequences have in common: each sequence past the first holds only its own
        last, partial block.
        """
        bs = self.block_size
        total = -(-(prompt_len + max_tokens - 1) // bs)
        if identical:
            return total + (num_seqs - 1)
        shared = prompt_len // bs
        return shared + num_seqs * (total - shared)

    def max_new_tokens(self, prompt_len: int, num_seqs: int, identical: bool = False) -> int:
        """The largest ``max_tokens`` whose ``blocks_needed`` fits ``num_blocks`` (0 or less:
        not even one token fits)."""
        bs = self.block_size
        if identical:
            return (self.num_blocks - (num_seqs - 1)) * bs - prompt_len + 1
        shared = prompt_len // bs
        own = (self.num_blocks - shared) // num_seqs
        return (shared + own) * bs - prompt_len + 1

    def describe(self) -> str:
        """``"48 KV blocks of 16 tokens: 48 less a watermark of 0"``: the limit, for messages."""
        return (
            f"{self.num_blocks} KV blocks of {self.block_size} tokens: {self.num_total_blocks} less a "
            f"watermark of {self.watermark_blocks}"
        )
