"""Token sampler: next-token logits -> sampled token ids and log-probabilities.

``Sampler(eos_token_id)(logits, seq_group_metadata_list)`` returns one
``CompletionSequenceGroupOutput`` per metadata entry.

Row layout of ``logits`` (float32 ``[num_rows, vocab]``, any device): for each
``SequenceGroupMetadata`` in list order whose ``do_sample`` is True, for each sequence id in
``seq_data`` (dict order), one row holding that sequence's next-token logits. Groups with
``do_sample=False`` own no rows and get an empty output. A row of a group with
``num_samples > 1`` (an unforked prefill of an ``n > 1`` request: exactly one sequence) is
sampled ``num_samples`` times; every sample names that sequence as its parent.

Pipeline, applied per row with that row's ``SamplingParams`` (all vectorised across rows):

0. *Constrain* (structured outputs): rows whose metadata carries a ``token_bitmask`` get the
   logits of every token their grammar forbids set to ``-inf`` (one batched pass over all
   constrained rows of the step, ``model_executor.layers.bitmask``), before everything below, so
   greedy, random sampling and the reported logprobs all see the constrained distribution.
   When every row takes the greedy fast path (below) on CPU float32 logits, the masks are
   instead applied inside the greedy kernel (``bitmask_kernel.greedy_sample_masked``: same
   tokens and logprobs, no pass writing ``-inf``).
1. *Adjust* the logits (only rows that ask for it; otherwise untouched):
   a. repetition penalty over prompt + output tokens (CTRL, Keskar et al. 2019, eq. in
      section 4.1, with the sign fix used by HF transformers: positive logits are divided by
      the penalty, negative ones multiplied);
   b. presence / frequency penalties over output tokens (OpenAI API reference, "Parameter
      details": ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``);
   c. ``logit_bias`` (added to the logits; ids outside the vocab are ignored);
   c'. token masks (``-inf``): every id outside ``allowed_token_ids``; each ``bad_words``
      token sequence's last token where the output ends with the tokens before it (a
      one-token word always). Both are derived once per request (``SamplingParams.
      sampler_cache``): the allowed set as a boolean ``[V]`` mask, the bad words as prefixes;
   d. ``min_tokens``: while the sequence has fewer than ``min_tokens`` output tokens, EOS
      (unless ``ignore_eos``) and ``stop_token_ids`` are set to ``-inf``.
2. *Choose* the token:
   - greedy rows (``temperature < GREEDY_EPS``): ``argmax`` of the adjusted logits (which are
     the raw logits, bit for bit, when step 1 does nothing: this is what lets greedy output be
     compared token for token with HF transformers);
   - random rows: divide by ``temperature``; top-k; top-p (nucleus, Holtzman et al. 2019,
     "The Curious Case of Neural Text Degeneration": the smallest set of most likely tokens
     whose probability sums to at least ``top_p``, taken on the top-k-renormalised
     distribution); min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for
     Creative and Coherent LLM Outputs": drop tokens with ``p < min_p * p_max``); softmax;
     then draw with the exponential race ``argmax(p / E)``, ``E ~ Exponential(1)`` i.i.d.,
     which picks token ``i`` with probability ``p_i`` (the Gumbel-max trick in disguise).
     Seeded requests (``metadata.generator`` is a ``torch.Generator``) draw their ``E`` from
     their own generator, one call per group per step, so their tokens do not depend on what
     else is in the batch; the rest share the global RNG of the logits' device.

Log-probability convention (``SequenceOutput.logprob`` and ``top_logprobs``): log-softmax of
the *adjusted* logits of step 1 — i.e. the model's distribution after the request's logit
processors (penalties, logit_bias, token masks, min_tokens) — at temperature 1 and before top-k / top-p /
min-p truncation. Temperature and truncation are treated as properties of the *sampling
strategy*, not of the distribution being reported, so logprobs are finite for every token the
request did not forbid, are comparable across temperatures, and for a plain request equal
``log_softmax(raw_logits)`` (what HF transformers' raw ``output_logits`` give). The only
``-inf`` entries possible are tokens suppressed by ``min_tokens`` or a token mask. The sampled token's
logprob is always computed (it feeds ``cumulative_logprob``); ``top_logprobs`` is ``None``
when ``sampling_params.logprobs is None``, else ``{token_id: Logprob(logprob, rank)}`` of the
``logprobs`` most likely tokens plus the sampled token (``logprobs`` or ``logprobs + 1``
entries; rank 1 = most likely, 1 + the number of tokens with a larger adjusted logit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvserve.model_executor.layers.bitmask import apply_token_bitmask_
from kvserve.ops import bitmask as bitmask_kernel
from kvserve.ops import elementwise
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import (
    CompletionSequenceGroupOutput,
    Logprob,
    SequenceData,
    SequenceGroupMetadata,
    SequenceOutput,
)

__all__ = [
    "NON_FINITE_LOGITS",
    "Sampler",
    "apply_penalties",
    "apply_token_masks_",
    "apply_top_k_top_p_min_p",
    "non_finite_rows",
    "prompt_logprobs",
]

#: ``CompletionSequenceGroupOutput.error`` of a group whose logits held a NaN or an infinity:
#: such a row is never sampled (argmax / softmax of it is meaningless).
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or inf)"


# ---------------------------------------------------------------------------------------------
# Building blocks (pure functions on tensors; exported for tests and reuse)
# ---------------------------------------------------------------------------------------------


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts of token ids per row.

    Args:
        token_ids: one list of token ids per row (ids outside ``[0, vocab_size)`` are ignored).
    Returns:
        float32 ``[len(token_ids), vocab_size]`` on ``device``; ``counts[r, t]`` = number of
        times ``t`` occurs in ``token_ids[r]``.
    """
    num_rows = len(token_ids)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    if int(lengths.sum()) == 0:
        return counts.view(num_rows, vocab_size)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    keep = (flat >= 0) & (flat < vocab_size)
    index = (rows[keep] * vocab_size + flat[keep]).to(device)
    counts.index_add_(0, index, torch.ones(index.shape[0], dtype=torch.float32, device=device))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, presence and frequency penalties (out of place).

    Args:
        logits: float32 ``[R, V]``.
        prompt_token_ids / output_token_ids: ``R`` lists of token ids.
        repetition_penalties: float32 ``[R]`` (> 0; 1 = off). CTRL (Keskar et al. 2019): every
            token seen in prompt or output gets ``logit / penalty`` if ``logit > 0`` else
            ``logit * penalty``, so penalty > 1 always makes it less likely.
        presence_penalties / frequency_penalties: float32 ``[R]`` (0 = off). OpenAI API
            definition, over output tokens only:
            ``logit[t] -= count[t] * frequency + (count[t] > 0) * presence``.
    Returns:
        float32 ``[R, V]``, same device as ``logits``.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    rep = repetition_penalties.to(device=device, dtype=logits.dtype)
    pres = presence_penalties.to(device=device, dtype=logits.dtype)
    freq = frequency_penalties.to(device=device, dtype=logits.dtype)
    out_counts = _token_counts(output_token_ids, vocab, device)
    out_seen = out_counts > 0
    if bool((repetition_penalties != 1.0).any()):
        seen = out_seen | (_token_counts(prompt_token_ids, vocab, device) > 0)
        pen = rep.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(seen, penalised, logits)
    if bool((presence_penalties != 0).any() or (frequency_penalties != 0).any()):
        logits = logits - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * out_seen.to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (set to ``-inf``) the tokens that top-k, then top-p, then min-p exclude.

    Args:
        logits: float32 ``[R, V]`` (already divided by the temperature).
        top_k: int64 ``[R]``; keep the ``k`` largest logits (``k >= V`` or ``k <= 0`` = off).
            Ties at the boundary are broken by the sort order, so exactly ``k`` survive.
        top_p: float32 ``[R]`` in (0, 1]; nucleus sampling (Holtzman et al. 2019): keep the
            smallest prefix of the sorted, top-k-renormalised distribution whose mass is
            ``>= top_p`` (``>= 1`` = off). The most likely token always survives.
        min_p: float32 ``[R]`` in [0, 1]; min-p (Nguyen et al. 2024): drop tokens with
            ``p < min_p * max(p)`` (0 = off).
    Returns:
        float32 ``[R, V]`` (new tensor, same device).
    """
    _, vocab = logits.shape
    device = logits.device
    top_k = top_k.to(device)
    top_k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k)
    top_p = top_p.to(device=device, dtype=torch.float32)
    top_p = torch.where(top_p >= 1.0, torch.full_like(top_p, float("inf")), top_p)
    min_p = min_p.to(device=device, dtype=torch.float32)

    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    remove = positions >= top_k.unsqueeze(1)  # top-k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumsum
    remove |= mass_before >= top_p.unsqueeze(1)  # top-p
    remove |= probs < min_p.unsqueeze(1) * probs[:, :1]  # min-p
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


#: Prompt-logprob rows reduced at once: a slice's float32 temporaries (a ``> target`` mask, the
#: log-sum-exp pass) are ``PROMPT_LOGPROB_ROWS x vocab``, whatever the number of rows asked for.
PROMPT_LOGPROB_ROWS = 256


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[dict[int, Logprob]]:
    """Prompt logprobs of ``Q`` prompt positions: the log-softmax of the raw logits (no
    penalties, temperature 1), the ``ks[i]`` most likely tokens plus the actual next token.

    Works on ``PROMPT_LOGPROB_ROWS`` rows at a time and never builds the ``[Q, V]``
    log-softmax: ``logp[i, t] = logits[i, t] - logsumexp(logits[i])`` is computed only for the
    top-k values and the target, the top-k and the rank are taken on the raw logits (the same
    order: subtracting one row constant is monotonic).

    Args:
        logits: float ``[Q, V]`` (float32 is used as is, other dtypes are upcast per slice),
            row ``i`` the logits at a prompt position.
        targets: int64 ``[Q]``, the prompt token that follows each position.
        ks: per row, how many top tokens to report (0..V).
    Returns:
        ``Q`` dicts ``{token_id: Logprob(logprob, rank)}`` (rank 1 = most likely: 1 + the
        number of tokens with a strictly larger logit); the target is always present
        (``ks[i]`` or ``ks[i] + 1`` entries).
    """
    out: list[dict[int, Logprob]] = []
    for s in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):
        e = min(s + PROMPT_LOGPROB_ROWS, logits.shape[0])
        out.extend(_prompt_logprob_rows(logits[s:e], targets[s:e], ks[s:e]))
    return out


def _prompt_logprob_rows(
    logits: torch.Tensor, targets: torch.Tensor, ks: list[int]
) -> list[dict[int, Logprob]]:
    """``prompt_logprobs`` of one slice of rows (see there). On CPU float32 logits one native
    kernel (``elementwise.prompt_logprob_stats``) gives the log-sum-exp, the ranks and the top-k
    in two passes over each row; elsewhere torch does (a pass and a temporary each)."""
    x = logits.float()
    targets = targets.to(x.device)
    target_x = x.gather(1, targets.unsqueeze(1))  # [C, 1]
    k = min(x.shape[1], max(ks, default=0))
    top_vals: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if elementwise.supported(x):
        lse, rank, vals, ids = elementwise.prompt_logprob_stats(x, targets, k)
        ranks = rank.tolist()
    else:
        lse = x.logsumexp(dim=-1)  # [C]
        ranks = (torch.count_nonzero(x > target_x, dim=1) + 1).tolist()
        vals, ids = x.topk(k, dim=-1)
    target_vals = (target_x.squeeze(1) - lse).tolist()
    if k > 0:
        top_vals, top_ids = (vals - lse.unsqueeze(1)).tolist(), ids.tolist()
    out = []
    for i, (t, kk) in enumerate(zip(targets.tolist(), ks)):
        entry = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(zip(top_ids[i][:kk], top_vals[i][:kk]))}
        entry.setdefault(t, Logprob(target_vals[i], ranks[i]))
        out.append(entry)
    return out


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Indices of the rows of ``logits`` (float ``[N, V]``, any device) that hold a NaN or an
    infinity, ascending.

    One reduction over the step's logits: a row's sum is finite unless the row holds a NaN or
    an infinity (or its finite values overflow when summed); only rows whose sum is not finite
    are then checked element by element, so the overflow case is not reported.
    """
    bad = ~torch.isfinite(logits.sum(dim=1))
    if not bool(bad.any()):
        return []
    rows = bad.nonzero().flatten()
    exact = ~torch.isfinite(logits.index_select(0, rows)).all(dim=1)
    return rows[exact].tolist()


def _allowed_mask(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[vocab]`` on ``device``, True at ``params.allowed_token_ids`` (ids past the
    vocabulary dropped); built once per request and kept in ``params.sampler_cache``."""
    key = ("allowed", vocab, str(device))
    mask = params.sampler_cache.get(key)
    if mask is None:
        ids = torch.tensor([t for t in params.allowed_token_ids or [] if t < vocab], dtype=torch.long)
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[ids] = True
        mask = mask.to(device)
        params.sampler_cache[key] = mask
    return mask


def _bad_words_split(params: SamplingParams) -> tuple[list[int], list[tuple[tuple[int, ...], int]]]:
    """``params.bad_words_token_ids`` as (ids always banned: one-token words, [(prefix, last
    token)] of the longer ones), cached in ``params.sampler_cache``.

    Raises:
        ValueError: ``bad_words`` set but never tokenized (the engine's ``validate`` does it).
    """
    split = params.sampler_cache.get("bad_words")
    if split is None:
        seqs = params.bad_words_token_ids
        if seqs is None:
            raise ValueError("bad_words were not tokenized (LLMEngine.validate tokenizes them).")
        always = sorted({ids[0] for ids in seqs if len(ids) == 1})
        tails = [(tuple(ids[:-1]), ids[-1]) for ids in seqs if len(ids) > 1]
        split = params.sampler_cache["bad_words"] = (always, tails)
    return split


def apply_token_masks_(
    logits: torch.Tensor, row_ids: list[int], params: list[SamplingParams], data: list[SequenceData]
) -> None:
    """Set to ``-inf``, in place, the tokens ``allowed_token_ids`` and ``bad_words`` forbid.

    Args:
        logits: float32 ``[R, V]``.
        row_ids: the rows to mask; ``params[i]`` / ``data[i]`` are row ``row_ids[i]``'s
            request settings and its sequence (``output_token_ids`` is read: a bad word's last
            token is banned where the output ends with the word's other tokens, vLLM's rule).

    Raises:
        ValueError: a row has no token left (every id masked).
    """
    vocab = logits.shape[1]
    device = logits.device
    allowed = [(r, p) for r, p in zip(row_ids, params) if p.allowed_token_ids is not None]
    if allowed:
        idx = torch.tensor([r for r, _ in allowed], dtype=torch.long, device=device)
        keep = torch.stack([_allowed_mask(p, vocab, device) for _, p in allowed])
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    ban_r: list[int] = []
    ban_t: list[int] = []
    for r, p, d in zip(row_ids, params, data):
        if not p.bad_words:
            continue
        always, tails = _bad_words_split(p)
        banned = [t for t in always if t < vocab]
        out = d.output_token_ids
        for prefix, last in tails:
            k = len(prefix)
            if len(out) >= k and last < vocab and tuple(out[-k:]) == prefix:
                banned.append(last)
        ban_r.extend([r] * len(banned))
        ban_t.extend(banned)
    if ban_r:
        logits[torch.tensor(ban_r, device=device), torch.tensor(ban_t, device=device)] = float("-inf")
    # a row with nothing left to sample would give NaN logprobs and an arbitrary token
    empty = torch.isneginf(logits[torch.tensor(row_ids, device=device)]).all(dim=1)
    if bool(empty.any()):
        raise ValueError(
            "allowed_token_ids and bad_words leave no token to sample "
            f"(rows {[row_ids[i] for i in empty.nonzero().flatten().tolist()]})."
        )


def _exponential(
    num: int, vocab: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """``Exponential(1)`` noise, float32 ``[num, vocab]`` on ``device``.

    With a generator the numbers are drawn on the generator's device (then moved), so a
    request's stream depends only on its own generator.
    """
    if generator is None:
        return torch.empty(num, vocab, dtype=torch.float32, device=device).exponential_()
    q = torch.empty(num, vocab, dtype=torch.float32, device=generator.device)
    q.exponential_(generator=generator)
    return q.to(device)


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------


@dataclass
class _Row:
    group_index: int
    seq_id: int
    num_samples: int
    params: SamplingParams
    data: SequenceData
    suppressed: list[int]  # token ids forced to -inf (min_tokens), within the vocab
    generator: torch.Generator | None  # the request's RNG (seeded), or None


class Sampler:
    """Samples the next token of every scheduled sequence; see the module docstring.

    Args:
        eos_token_id: the model's EOS id, suppressed under ``min_tokens`` (unless the request
            sets ``ignore_eos``). ``None``: only ``stop_token_ids`` are suppressed.
    """

    def __init__(self, eos_token_id: int | None):
        self.eos_token_id = eos_token_id

    # -- helpers -----------------------------------------------------------------------------
    def _suppressed_ids(self, params: SamplingParams, data: SequenceData, vocab: int) -> list[int]:
        if data.get_output_len() >= params.min_tokens:
            return []
        ids = list(params.stop_token_ids or [])
        if self.eos_token_id is not None and not params.ignore_eos:
            ids.append(self.eos_token_id)
        return sorted({t for t in ids if 0 <= t < vocab})

    def _collect_rows(self, metadata_list: list[SequenceGroupMetadata], vocab: int) -> list[_Row]:
        rows: list[_Row] = []
        for g, md in enumerate(metadata_list):
            if not md.do_sample:
                continue
            if md.num_samples > 1 and len(md.seq_data) != 1:
                raise ValueError(
                    f"request {md.request_id}: num_samples={md.num_samples} needs exactly one "
                    f"sequence, got {len(md.seq_data)}"
                )
            for seq_id, data in md.seq_data.items():
                rows.append(
                    _Row(
                        g,
                        seq_id,
                        max(1, md.num_samples),
                        md.sampling_params,
                        data,
                        self._suppressed_ids(md.sampling_params, data, vocab),
                        md.generator,
                    )
                )
        return rows

    # -- main entry --------------------------------------------------------------------------
    def __call__(
        self, logits: torch.Tensor | None, seq_group_metadata_list: list[SequenceGroupMetadata]
    ) -> list[CompletionSequenceGroupOutput]:
        """Sample one step.

        Args:
            logits: float32 ``[num_rows, vocab]`` (other float dtypes are upcast), rows laid out
                as in the module docstring. May be ``None`` or have 0 rows when no group samples.
            seq_group_metadata_list: the step's scheduled groups.
        Returns:
            ``List[CompletionSequenceGroupOutput]``, one per metadata entry, in order. A group
            any of whose rows holds a NaN or an infinity gets no samples and ``error`` set to
            ``NON_FINITE_LOGITS``; the other rows are sampled as without it.
        """
        outputs = [CompletionSequenceGroupOutput() for _ in seq_group_metadata_list]
        vocab = 0 if logits is None else logits.shape[-1]
        rows = self._collect_rows(seq_group_metadata_list, vocab)
        num_rows = 0 if logits is None else logits.shape[0]
        if num_rows != len(rows):
            raise ValueError(f"logits has {num_rows} rows but the metadata asks for {len(rows)}")
        if not rows:
            return outputs
        assert logits is not None  # it has len(rows) > 0 rows (checked above)
        if logits.dtype != torch.float32:
            logits = logits.float()
        failed: set[int] = set()
        bad = non_finite_rows(logits)
        if bad:
            failed = {rows[i].group_index for i in bad}
            for g in failed:
                outputs[g].error = NON_FINITE_LOGITS
            # zeros keep the batched passes below defined for those rows; what they give for
            # them is dropped, and every other row is computed independently of them
            logits[torch.tensor(bad, dtype=torch.long, device=logits.device)] = 0.0
        constraint = self._collect_constraints(seq_group_metadata_list)
        greedy_only = all(
            r.params.is_greedy
            and not r.params.needs_penalties
            and not r.params.logit_bias
            and not r.params.needs_token_masks
            and not r.suppressed
            and r.params.logprobs is None
            for r in rows
        )
        if greedy_only and constraint is not None and bitmask_kernel.supported(logits, constraint[1]):
            # Mask fused into the greedy pass: the constrained rows are neither written nor,
            # where the grammar allows little, read in full.
            tokens, sample_lp, top = self._greedy_masked_path(logits, rows, *constraint)
            sample_ranks: dict[int, int] = {}
        else:
            if constraint is not None:
                row_ids, bitmask = constraint
                idx = None if len(row_ids) == logits.shape[0] else torch.tensor(row_ids, dtype=torch.long)
                apply_token_bitmask_(logits, idx, bitmask)
            if greedy_only:
                tokens, sample_lp, top = self._greedy_fast_path(logits, rows)
                sample_ranks = {}
            else:
                tokens, sample_lp, top, sample_ranks = self._general_path(logits, rows)

        # Assemble outputs (one Python loop over rows; each row has num_samples samples).
        s = 0
        for i, r in enumerate(rows):
            if r.group_index in failed:
                s += r.num_samples
                continue
            out = outputs[r.group_index].samples
            for _ in range(r.num_samples):
                tok, lp = tokens[s], sample_lp[s]
                top_lp: dict[int, Logprob] | None = None
                if r.params.logprobs is not None:
                    top_lp = {}
                    if r.params.logprobs > 0:
                        ids, vals = top[i]
                        k = r.params.logprobs
                        top_lp = {
                            t: Logprob(v, rank + 1) for rank, (t, v) in enumerate(zip(ids[:k], vals[:k]))
                        }
                    if tok not in top_lp:
                        top_lp[tok] = Logprob(lp, sample_ranks[s])
                out.append(
                    SequenceOutput(parent_seq_id=r.seq_id, output_token=tok, logprob=lp, top_logprobs=top_lp)
                )
                s += 1
        return outputs

    @staticmethod
    def _collect_constraints(
        metadata_list: list[SequenceGroupMetadata],
    ) -> tuple[list[int], torch.Tensor] | None:
        """The logits rows of constrained groups and their grammars' masks, concatenated
        (int32 ``[len(rows), W]``, row ``i`` for logits row ``rows[i]``); None when no row is
        constrained. Waits for the step's mask fill."""
        row_ids: list[int] = []
        masks: list[torch.Tensor] = []
        row = 0
        for md in metadata_list:
            if not md.do_sample:
                continue
            n = len(md.seq_data)
            if md.token_bitmask is not None:
                mask = md.token_bitmask.rows()
                if mask.shape[0] != n:
                    raise ValueError(
                        f"request {md.request_id}: bitmask has {mask.shape[0]} rows for {n} sequences"
                    )
                masks.append(mask)
                row_ids.extend(range(row, row + n))
            row += n
        if not masks:
            return None
        return row_ids, masks[0] if len(masks) == 1 else torch.cat(masks)

    # -- paths -------------------------------------------------------------------------------
    @staticmethod
    def _greedy_fast_path(logits: torch.Tensor, rows: list[_Row]):
        """Every row greedy with nothing to adjust: one argmax (+ the sampled logprob)."""
        if elementwise.supported(logits):
            tok, lp = elementwise.greedy_sample(logits)  # one fused pass (argmax + logsumexp)
        else:
            tok = logits.argmax(dim=-1)
            lp = logits.gather(1, tok.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
        return Sampler._expand_greedy(tok, lp, rows)

    @staticmethod
    def _greedy_masked_path(
        logits: torch.Tensor, rows: list[_Row], row_ids: list[int], bitmask: torch.Tensor
    ):
        """The greedy fast path with the constrained rows' masks applied inside the kernel
        (``logits`` is left unmasked)."""
        mask_rows = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        mask_rows[torch.tensor(row_ids, dtype=torch.int64)] = torch.arange(len(row_ids), dtype=torch.int64)
        tok, lp = bitmask_kernel.greedy_sample_masked(logits, bitmask, mask_rows)
        return Sampler._expand_greedy(tok, lp, rows)

    @staticmethod
    def _expand_greedy(tok: torch.Tensor, lp: torch.Tensor, rows: list[_Row]):
        """Per-row greedy results repeated ``num_samples`` times, as Python lists."""
        counts = [r.num_samples for r in rows]
        if any(c > 1 for c in counts):
            rep = torch.tensor(counts, device=tok.device)
            tok, lp = tok.repeat_interleave(rep), lp.repeat_interleave(rep)
        return tok.tolist(), lp.tolist(), {}

    @staticmethod
    def adjust(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Step 1 of the pipeline (penalties, logit_bias, min_tokens) on float32 ``[R, V]``
        logits, one row per ``rows`` entry. Returns ``logits`` itself when nothing applies, else
        an adjusted copy."""
        device = logits.device
        vocab = logits.shape[1]
        adjusted = logits
        pen_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if pen_rows:
            sub = [rows[i] for i in pen_rows]
            idx = torch.tensor(pen_rows, device=device)
            adjusted = adjusted.clone()
            adjusted[idx] = apply_penalties(
                adjusted[idx],
                [r.data.prompt_token_ids for r in sub],
                [r.data.output_token_ids for r in sub],
                torch.tensor([float(r.params.repetition_penalty) for r in sub]),
                torch.tensor([float(r.params.presence_penalty) for r in sub]),
                torch.tensor([float(r.params.frequency_penalty) for r in sub]),
            )
        bias_r, bias_t, bias_v = [], [], []
        for i, r in enumerate(rows):
            for t, v in (r.params.logit_bias or {}).items():
                t = int(t)
                if 0 <= t < vocab:
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(float(v))
        if bias_r:
            if adjusted is logits:
                adjusted = adjusted.clone()
            adjusted.index_put_(
                (torch.tensor(bias_r, device=device), torch.tensor(bias_t, device=device)),
                torch.tensor(bias_v, dtype=adjusted.dtype, device=device),
                accumulate=True,
            )
        masked = [i for i, r in enumerate(rows) if r.params.needs_token_masks]
        if masked:
            if adjusted is logits:
                adjusted = adjusted.clone()
            apply_token_masks_(
                adjusted, masked, [rows[i].params for i in masked], [rows[i].data for i in masked]
            )
        sup_r = [i for i, r in enumerate(rows) for _ in r.suppressed]
        if sup_r:
            if adjusted is logits:
                adjusted = adjusted.clone()
            sup_t = [t for r in rows for t in r.suppressed]
            adjusted[torch.tensor(sup_r, device=device), torch.tensor(sup_t, device=device)] = float("-inf")

        return adjusted

    @staticmethod
    def sampling_probs(adjusted: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution a random row samples from: temperature, then top-k / top-p /
        min-p truncation, then softmax. ``adjusted``: float32 ``[R, V]`` (step 1 applied),
        ``params``: the ``R`` rows' params (none greedy). Returns float32 ``[R, V]``."""
        device = adjusted.device
        temps = torch.tensor([float(p.temperature) for p in params], device=device)
        x = adjusted / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
            x = apply_top_k_top_p_min_p(
                x,
                torch.tensor([p.top_k for p in params], dtype=torch.long),
                torch.tensor([float(p.top_p) for p in params]),
                torch.tensor([float(p.min_p) for p in params]),
            )
        return x.softmax(dim=-1)

    def _general_path(self, logits: torch.Tensor, rows: list[_Row]):
        device = logits.device
        num_rows, vocab = logits.shape

        adjusted = self.adjust(logits, rows)

        # 2. Choose tokens. Samples are laid out row by row, num_samples each.
        counts = [r.num_samples for r in rows]
        num_samples_total = sum(counts)
        starts = list(itertools.accumulate([0] + counts[:-1]))
        tokens = torch.empty(num_samples_total, dtype=torch.long, device=device)

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if greedy:
            g_idx = torch.tensor(greedy, device=device)
            g_tok = adjusted[g_idx].argmax(dim=-1)
            g_counts = [counts[i] for i in greedy]
            g_pos = [starts[i] + j for i in greedy for j in range(counts[i])]
            tokens[torch.tensor(g_pos, device=device)] = g_tok.repeat_interleave(
                torch.tensor(g_counts, device=device)
            )

        random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random:
            tokens_r = self._sample_random(adjusted, rows, random, counts)
            r_pos = [starts[i] + j for i in random for j in range(counts[i])]
            tokens[torch.tensor(r_pos, device=device)] = tokens_r

        # 3. Log-probabilities of the adjusted distribution (temperature 1, untruncated).
        sample_row = torch.repeat_interleave(
            torch.arange(num_rows, device=device), torch.tensor(counts, device=device)
        )
        lse = adjusted.logsumexp(dim=-1)
        sample_lp = adjusted[sample_row, tokens] - lse[sample_row]

        # rank of each sample whose request wants logprobs: 1 + the tokens with a larger logit
        sample_ranks: dict[int, int] = {}
        wants = []
        if any(r.params.logprobs is not None for r in rows):
            wants = [s for s, i in enumerate(sample_row.tolist()) if rows[i].params.logprobs is not None]
        if wants:
            w = torch.tensor(wants, device=device)
            w_rows, w_tok = sample_row[w], tokens[w]
            chosen = adjusted[w_rows, w_tok].unsqueeze(1)
            sample_ranks = dict(zip(wants, ((adjusted[w_rows] > chosen).sum(dim=1) + 1).tolist()))

        top: dict[int, tuple] = {}
        top_n = [(i, r.params.logprobs) for i, r in enumerate(rows) if r.params.logprobs]
        if top_n:
            top_rows = [i for i, _ in top_n]
            k = min(vocab, max(n for _, n in top_n))
            t_idx = torch.tensor(top_rows, device=device)
            top_vals, top_ids = adjusted[t_idx].topk(k, dim=-1)
            vals = (top_vals - lse[t_idx].unsqueeze(1)).tolist()
            ids = top_ids.tolist()
            for j, i in enumerate(top_rows):
                top[i] = (ids[j], vals[j])
        return tokens.tolist(), sample_lp.tolist(), top, sample_ranks

    @staticmethod
    def _sample_random(
        adjusted: torch.Tensor, rows: list[_Row], random: list[int], counts: list[int]
    ) -> torch.Tensor:
        """Temperature, truncation and exponential-race draw for the non-greedy rows.

        Returns int64 ``[sum(counts[i] for i in random)]``, samples in row order.
        """
        device = adjusted.device
        vocab = adjusted.shape[1]
        sub = [rows[i] for i in random]
        x = adjusted[torch.tensor(random, device=device)]
        probs = Sampler.sampling_probs(x, [r.params for r in sub])
        sub_counts = [counts[i] for i in random]
        if any(c > 1 for c in sub_counts):
            probs = probs.repeat_interleave(torch.tensor(sub_counts, device=device), dim=0)

        # Exponential noise: unseeded samples share one draw from the global RNG; each seeded
        # group draws all of its samples in one call on its own generator.
        num = probs.shape[0]
        seeded: dict[int, list[int]] = {}  # group index -> sample positions (within ``probs``)
        unseeded: list[int] = []
        generators: dict[int, torch.Generator] = {}
        pos = 0
        for j, r in enumerate(sub):
            span = list(range(pos, pos + sub_counts[j]))
            gen = r.generator
            if gen is None:
                unseeded.extend(span)
            else:
                seeded.setdefault(r.group_index, []).extend(span)
                generators[r.group_index] = gen
            pos += sub_counts[j]
        if not seeded:
            q = _exponential(num, vocab, device, None)
        else:
            q = torch.empty(num, vocab, dtype=torch.float32, device=device)
            if unseeded:
                q[torch.tensor(unseeded, device=device)] = _exponential(len(unseeded), vocab, device, None)
            for g, span in seeded.items():
                q[torch.tensor(span, device=device)] = _exponential(len(span), vocab, device, generators[g])
        # A zero draw would turn a masked token's 0 probability into 0/0; keep q > 0.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)
