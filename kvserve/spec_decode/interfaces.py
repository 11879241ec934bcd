"""The proposer interface of speculative decoding.

A proposer guesses, per decoding sequence, the next few tokens. The ``SpecDecodeWorker`` asks
it once per step (``propose``) with the step's whole request, before the target forward, then
verifies every proposal in that forward. Methods without a draft distribution (n-gram lookup)
return ``probs=None``; the verifier then treats each draft as a point mass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvserve.sequence import ExecuteModelRequest


@dataclass
class Proposal:
    """Proposed continuation of one sequence.

    Attributes:
        token_ids: the drafts, in order (``0 <= len <= k``; empty = nothing to propose, the
            sequence decodes plainly this step).
        probs: float32 ``[len(token_ids), vocab]`` on any device, row ``j`` the draft model's
            distribution the ``j``-th draft was sampled from (after the request's temperature
            and truncation, the same transform the target's distribution gets), or None for a
            method without one (n-gram lookup: a point mass on each draft).
        match_len: for n-gram lookup, the length of the matched suffix (a longer match is
            likelier to be accepted: the dynamic draft-length policy's prior); None otherwise.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    match_len: int | None = None


class Proposer(ABC):
    """Proposes drafts for the decoding sequences of a step. Add a method by subclassing.

    The worker calls, per step: ``apply_block_moves(req)`` (always, even when nothing is
    proposed: a proposer with its own KV cache mirrors the target's swaps and copies, as it
    shares the target's block tables), then ``propose(req, k)``, then after verification
    ``on_verified``. ``free`` is called when sequences end.

    ``proposes_cheaply``: True (the default) when proposing the full ``k`` costs next to
    nothing (n-gram lookup), so the dynamic draft-length policy asks for full proposals and
    then cuts them; False for a proposer whose cost grows with the drafts (a draft model): the
    policy then chooses the lengths first and passes them as each decode metadata entry's
    ``num_speculative_tokens`` (0: that group gets no drafts this step).
    """

    proposes_cheaply: bool = True

    @abstractmethod
    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        """Drafts for the step's speculating sequences.

        Args:
            req: the whole step: prefill chunks, decodes and block moves (a draft model runs the
                prefill chunks on its own cache so it can propose once those sequences decode).
                A decode metadata entry with ``num_speculative_tokens > 0`` speculates; for each
                of its sequences at most ``min(k, md.num_speculative_tokens)`` drafts.
            k: ``SpeculativeConfig.num_speculative_tokens``.
        Returns:
            seq_id -> ``Proposal`` (sequences left out, or with no tokens, decode plainly).
        """

    def apply_block_moves(self, req: ExecuteModelRequest) -> None:  # noqa: B027 (optional hook)
        """Apply ``req``'s swap-out, swap-in and copies to the proposer's own KV cache (if any)."""

    def on_verified(self, num_accepted: dict[int, int]) -> None:  # noqa: B027 (optional hook)
        """seq_id -> accepted drafts of this step's verification (a draft model's KV of the
        rejected positions is stale from here on; the sequence's ``num_computed_tokens``
        rolls back to the last accepted position)."""

    def free(self, seq_ids: Iterable[int]) -> None:  # noqa: B027 (optional hook)
        """Forget per-sequence state of ended sequences."""
