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
    Cost: ``O(len(token_ids) * n)`` vectorised.
    """
    return ngram_lookup_with_len(token_ids, n_min, n_max, k)[0]


def ngram_lookup_with_len(token_ids: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """``ngram_lookup`` and the matched ``n`` (0 when nothing matched)."""
    L = len(token_ids)
    if k < 1 or L < n_min + 1:
        return [], 0
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n :]
        # windows starting at 0 .. L-n-1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : start + k].tolist(), n
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
                drafts, n = ngram_lookup_with_len(ids, self.prompt_lookup_min, self.prompt_lookup_max, m)
                if not drafts and self.fallback_min < self.prompt_lookup_min:
                    drafts, n = ngram_lookup_with_len(ids, self.fallback_min, self.prompt_lookup_min - 1, m)
                if drafts:
                    out[sid] = Proposal(drafts, match_len=n)
        return out
