"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): the drafts are the tokens
that followed the earliest earlier occurrence of the sequence's last ``n`` tokens, for the
largest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that occurs. No model, no draft
distribution: it wins where the output copies its input (summaries, edits, answers from a
document, multi-turn chat)."""

from __future__ import annotations

import numpy as np

from kvserve.sequence import ExecuteModelRequest
from kvserve.spec_decode.interfaces import Proposal, Proposer


def ngram_lookup(token_ids: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last ``n`` tokens.

    Tries ``n = n_max .. n_min`` (longest first: a longer match predicts better); for the first
    ``n`` that matches, takes the earliest occurrence (Saxena's choice: it leaves the longest
    continuation). Returns ``[]`` when nothing matches, ``k < 1`` or the sequence is too short.
    Cost: ``O(len(token_ids) + matches * n_max)`` vectorised (``suffix_matches``).
    """
    return ngram_lookup_with_len(token_ids, n_min, n_max, k)[0]


def ngram_lookup_with_len(token_ids: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """``ngram_lookup`` and the matched ``n`` (0 when nothing matched)."""
    if k < 1 or len(token_ids) < n_min + 1:
        return [], 0
    arr = np.asarray(token_ids, dtype=np.int64)
    ends, ml = suffix_matches(arr, n_max)
    return lookup_in_matches(arr, ends, ml, n_min, n_max, k)


def suffix_matches(arr: np.ndarray, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Every earlier position ``i <= L - 2`` holding the last token, and how many tokens of
    the sequence's suffix (at most ``min(n_max, L - 1)``) end there.

    One comparison over the sequence, then one over the surviving candidates per extra
    token of match: ``O(L + candidates * n_max)``, where trying each ``n`` with its own
    window comparison (the first version) cost ``O(L * n)`` per ``n``.

    Returns:
        ``(ends, lengths)``: int64 arrays of equal length, ``ends`` ascending.
    """
    L = int(arr.shape[0])
    if L < 2:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    ends = np.flatnonzero(arr[: L - 1] == arr[L - 1])
    lengths = np.ones(ends.shape[0], dtype=np.int64)
    live = np.arange(ends.shape[0])
    for j in range(1, min(n_max, L - 1)):
        pos = ends[live] - j
        keep = pos >= 0
        live, pos = live[keep], pos[keep]
        live = live[arr[pos] == arr[L - 1 - j]]
        if live.size == 0:
            break
        lengths[live] += 1
    return ends, lengths


def lookup_in_matches(
    arr: np.ndarray, ends: np.ndarray, lengths: np.ndarray, n_min: int, n_max: int, k: int
) -> tuple[list[int], int]:
    """``ngram_lookup_with_len`` from ``suffix_matches``'s result (``n_max`` at most the one
    it was computed with): the largest ``n`` in ``[n_min, n_max]`` some position matches,
    the earliest such position, and up to ``k`` tokens after it."""
    if k < 1 or ends.size == 0:
        return [], 0
    top = int(lengths.max())
    for n in range(min(n_max, top), n_min - 1, -1):
        hit = np.flatnonzero(lengths >= n)
        if hit.size:
            i = int(ends[hit[0]])
            return arr[i + 1 : i + 1 + k].tolist(), n
    return [], 0


class NGramProposer(Proposer):
    """``Proposer`` by prompt lookup over prompt + output so far (``ngram_lookup``).

    Args:
        prompt_lookup_min / prompt_lookup_max: the n-gram sizes tried (1 <= min <= max).
        fallback_min: when nothing matches at ``n >= prompt_lookup_min``, also try the sizes
            ``prompt_lookup_min - 1 .. fallback_min`` (None: no fallback). The proposal's
            ``match_len`` says which ``n`` matched, so the dynamic draft-length policy can
            weigh a short match's lower acceptance.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, fallback_min: int | None = None):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        lo = prompt_lookup_min if fallback_min is None else max(1, min(fallback_min, prompt_lookup_min))
        self.fallback_min = lo

    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        """Drafts for every sequence of a speculating decode (see ``Proposer.propose``)."""
        out: dict[int, Proposal] = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                ids = data.get_token_ids()
                if len(ids) < self.fallback_min + 1:
                    continue
                # One match scan serves both the n-gram sizes and the fallback's.
                arr = np.asarray(ids, dtype=np.int64)
                ends, lengths = suffix_matches(arr, self.prompt_lookup_max)
                drafts, n = lookup_in_matches(
                    arr, ends, lengths, self.prompt_lookup_min, self.prompt_lookup_max, m
                )
                if not drafts and self.fallback_min < self.prompt_lookup_min:
                    drafts, n = lookup_in_matches(
                        arr, ends, lengths, self.fallback_min, self.prompt_lookup_min - 1, m
                    )
                if drafts:
                    out[sid] = Proposal(drafts, match_len=n)
        return out
