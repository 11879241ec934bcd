"""Rejection sampling for speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"): the emitted tokens are distributed exactly as sampling
from the target alone."""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: list[torch.Generator | None],
    num_draft_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and sample the token after it.

    Row ``b`` has ``m_b`` drafts (``num_draft_tokens[b]``, or ``k`` for every row when None);
    positions past them are padding and are never read (their ids may be anything, e.g. 0).
    Draft ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))`` (``p`` = target,
    ``q`` = draft, ``x`` = the draft token), in order, until the first rejection; the token
    after the accepted prefix is drawn from ``normalize(max(0, p_j - q_j))`` at a rejection,
    or from ``p_{m_b}`` (the bonus token) when all ``m_b`` drafts were accepted.

    Args:
        target_probs: float32 ``[B, k+1, V]``, the target's sampling distribution (after
            temperature and truncation) at each verified position; row ``j`` scores draft ``j``
            (and row ``m_b`` gives the bonus).
        draft_token_ids: int64 ``[B, k]``.
        draft_probs: float32 ``[B, k, V]`` the draft distributions, or None: a point mass on
            each drafted token (n-gram lookup; acceptance is then ``p_j(x)`` and the correction
            is drawn from ``p_j`` with ``x`` removed).
        generators: ``B`` entries: the request's seeded ``torch.Generator`` (every random draw
            of that row comes from it, so a seeded request's output does not depend on the
            batch) or None (the global RNG of the tensors' device).
        num_draft_tokens: int64 ``[B]`` drafts per row (``0 <= m_b <= k``), or None (all ``k``).
    Returns:
        ``(token_ids int64 [B, k+1], num_accepted int64 [B])``: row ``b`` emits
        ``token_ids[b, : num_accepted[b] + 1]`` (the accepted drafts then the sampled token);
        entries after it are ``-1``. ``0 <= num_accepted[b] <= m_b``.
    Raises:
        ValueError: shapes or ``len(generators)`` do not agree.
    """
    raise NotImplementedError("rejection_sample is not implemented yet")
