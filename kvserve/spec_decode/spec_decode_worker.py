"""``SpecDecodeWorker``: speculative decoding around a ``Worker``.

Per step: apply the block moves (target and proposer), ask the proposer for drafts, then run
ONE target forward in which every speculating sequence is a verify chunk of ``m + 1`` query
tokens (its last token and its ``m`` drafts, at positions ``len - 1 .. len - 1 + m``, attending
to its paged context: the chunked-prefill attention path), mixed with the step's prefill
chunks and plain decodes. The logits of all ``m + 1`` positions are verified:

* greedy rows accept the longest prefix of drafts equal to the target's argmax at each
  position, plus the target's token after it (the correction, or the bonus token when all
  were accepted), so the output equals decoding without speculation;
* random rows go through ``rejection_sample`` (the output distribution stays the target's).

Each verified position gets the request's logit processing with the drafts before it counted
as output (penalties, ``min_tokens``, ``logit_bias``, token masks), and every emitted token its logprob.
A constrained (structured-output) sequence's drafts are checked against its grammar and each
verified position gets that position's mask (``GroupBitmask.verify_masks``: computed on the
grammar thread during the forward, applied before the logit processing as the sampler does);
only drafts the grammar allows can be accepted, so every emitted token is grammar-valid and
greedy output equals decoding without speculation.
The K/V written for rejected drafts are never read: the engine rolls ``num_computed_tokens``
back to the last accepted position, and those slots are overwritten by later steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvserve.model_executor.layers.bitmask import apply_token_bitmask_
from kvserve.model_executor.sampler import Sampler, _Row
from kvserve.ops import elementwise
from kvserve.sequence import (
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    Logprob,
    SequenceData,
    SequenceGroupMetadata,
    SequenceOutput,
)
from kvserve.spec_decode.draft_policy import DynamicDraftPolicy, base_rows, has_prompt, step_rows
from kvserve.spec_decode.interfaces import Proposal, Proposer
from kvserve.spec_decode.rejection_sampler import rejection_sample

if TYPE_CHECKING:
    from kvserve.config import SpeculativeConfig

logger = logging.getLogger("kvserve.spec_decode")


def build_proposer(spec_config: SpeculativeConfig, worker: Any) -> Proposer:
    """The proposer ``spec_config.method`` names. ``draft_model`` is
    ``kvserve.spec_decode.draft_model_proposer.DraftModelProposer(spec_config, worker)`` (it
    loads ``spec_config.model`` and sizes its own KV cache like ``worker``'s).

    Raises:
        ValueError: the method is not available (naming ``speculative_config.method``).
    """
    if spec_config.method == "ngram":
        from kvserve.spec_decode.ngram_proposer import NGramProposer

        # With dynamic draft lengths a 1-gram match is offered too where nothing longer matched:
        # the policy's acceptance prior for it is low, so it is drafted only where that pays.
        fallback = 1 if spec_config.dynamic else None
        return NGramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, fallback)
    if spec_config.method == "draft_model":
        try:
            from kvserve.spec_decode.draft_model_proposer import DraftModelProposer
        except ImportError as e:
            raise ValueError(f"speculative_config.method 'draft_model' is not available: {e}") from None
        return DraftModelProposer(spec_config, worker)
    raise ValueError(f"speculative_config.method {spec_config.method!r} is not supported.")


class _PositionData:
    """A sequence's data as seen at verified position ``j``: its output plus the first ``j``
    drafts (what the sampler's logit processing reads)."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "_out_len")

    def __init__(self, data: SequenceData, drafts: list[int], j: int, with_tokens: bool):
        self.prompt_token_ids = data.prompt_token_ids
        # The token lists are only read by penalties and bad words; build them only then.
        self.output_token_ids = data.output_token_ids + drafts[:j] if with_tokens else data.output_token_ids
        self._out_len = data.get_output_len() + j

    def get_output_len(self) -> int:
        return self._out_len


@dataclasses.dataclass
class _Verify:
    index: int  # metadata index
    seq_id: int
    data: SequenceData
    drafts: list[int]  # padded to the group's chunk
    num_real: int  # the proposer's drafts among them (a prefix); only those may be accepted
    draft_probs: torch.Tensor | None  # [num_real, V] or None
    masks: Any = None  # (VerifyMasks, position in the group) for a constrained sequence
    num_allowed: int = -1  # of the real drafts, those its grammar allows (set in _verify)


class SpecDecodeWorker:
    """A ``Worker`` that speculates (see the module docstring). Everything else (cache sizing,
    ``init_cache``, ``warm_up``, ``hf_config``...) is the wrapped worker's.

    Args:
        worker: a ``kvserve.worker.worker.Worker``.
        proposer: drafts per sequence (``Proposer``).
        spec_config: ``num_speculative_tokens`` is the most drafts per sequence per step;
            ``dynamic`` chooses each step's lengths with a ``DynamicDraftPolicy``
            (``self.policy``; None: always up to ``num_speculative_tokens``).
    """

    def __init__(self, worker: Any, proposer: Proposer, spec_config: SpeculativeConfig):
        self.worker = worker
        self.proposer = proposer
        self.spec_config = spec_config
        self.k = spec_config.num_speculative_tokens
        self.policy: DynamicDraftPolicy | None = (
            DynamicDraftPolicy(self.k) if getattr(spec_config, "dynamic", False) else None
        )
        if self.policy is not None:
            # On CPU the policy learns from the engine thread's CPU time: on a shared machine
            # wall-clock step times swing by more than the draft rows cost, while CPU time per
            # row count is stable; descheduling stretches every step alike, so the ratios the
            # policy needs are the same. (On an accelerator the CPU time of a synchronising
            # thread says nothing: wall clock.)
            self.policy.use_cpu_time = str(getattr(worker, "device", "cpu")).startswith("cpu")
            self.policy.proposer_label = (
                "draft model" if spec_config.method == "draft_model" else spec_config.method
            )
        self.vocab_size: int | None = getattr(getattr(worker, "hf_config", None), "vocab_size", None)
        self._warned_bad_proposal = False
        self._row_cap: tuple[int | None] | None = None  # (cap,) once ``_max_rows`` computed it

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes this object lacks: the wrapped worker's.
        if name == "worker":
            raise AttributeError(name)
        return getattr(self.worker, name)

    def free_seqs(self, seq_ids: list[int]) -> None:
        """Forward ended sequences to the proposer (``Proposer.free``) and the policy."""
        self._call_proposer("free", seq_ids)
        if self.policy is not None:
            self.policy.free(seq_ids)

    def _call_proposer(self, hook: str, *args: Any) -> Any:
        """Call a proposer hook; a failure is logged, never raised. Drafts only ever save
        steps (every one is verified), so a proposer in a bad state costs speed, not answers."""
        try:
            return getattr(self.proposer, hook)(*args)
        except Exception:
            logger.exception("the proposer's %s failed; this step decodes without its drafts", hook)
            return None

    # ------------------------------------------------------------------ step
    def execute_model(self, req: ExecuteModelRequest) -> list[CompletionSequenceGroupOutput]:
        """Like ``Worker.execute_model``; a verified decode's output carries its emitted
        tokens (``SequenceOutput.spec_tokens``) and the step's draft / accepted counts.

        Raises:
            BlockMoveError: applying the block moves failed (nothing was run); other
                exceptions as ``Worker.execute_model``.
        """
        self.worker.apply_block_moves(req)
        self._call_proposer("apply_block_moves", req)
        metas = req.seq_group_metadata_list
        if not metas:
            return []
        speculating = any(md.num_speculative_tokens > 0 and not md.is_prompt for md in metas)
        proposals: dict[int, Proposal] = {}
        proposed: set[int] = set()  # sequences the proposer drafted for, before the row cap
        if speculating:
            if self.policy is not None:
                self.policy.max_rows = self._max_rows()
            raw = self._propose(req)
            proposed = {sid for sid, p in raw.items() if p.token_ids}
            proposals = self._cap_rows(metas, raw)
        run_metas, verify = self._verify_chunks(metas, proposals)
        runner = self.worker.runner
        self.worker.before_step()
        if self.policy is not None:
            # One cost curve per thread count: the worker re-calibrates it under load.
            self.policy.set_regime(getattr(self.worker, "num_threads", None))
        t0, c0 = time.perf_counter(), time.thread_time()
        inp, hidden = runner.forward(run_metas, self.worker.cache_engine.gpu_cache)
        accepted: dict[int, int] = {}
        if verify and inp is not None and hidden is not None:
            # One LM head call for the sampled rows and every verify position (each call
            # reads all of the head's weights).
            n_sampled = int(inp.sample_rows.shape[0])
            with torch.inference_mode():
                logits, pl_logits = runner.logits(inp, hidden, self._verify_rows(verify, inp))
                outputs = runner.sample_logits(run_metas, inp, logits[:n_sampled], pl_logits)
                accepted = self._verify(metas, verify, logits[n_sampled:], outputs)
            self._call_proposer("on_verified", accepted)
        else:
            outputs = runner.sample(run_metas, inp, hidden)
        if speculating:
            verified = {v.seq_id for v in verify if v.num_real}
            policy_reasons = self.policy.skip_reasons if self.policy is not None else {}
            for md, out in zip(metas, outputs):
                if not md.is_prompt and md.num_speculative_tokens > 0:
                    out.spec_num_eligible_seqs = len(md.seq_data)
                    for sid, data in md.seq_data.items():
                        if sid not in verified:
                            reason = self._skip_reason(md, data, policy_reasons.get(sid), sid in proposed)
                            out.spec_skipped[reason] = out.spec_skipped.get(reason, 0) + 1
        if self.policy is not None:
            # The step's cost as the policy sees it: the forward, sampling and verification
            # (sampling and .tolist() synchronise an accelerator).
            self.policy.observe_step(
                step_rows(run_metas),
                time.perf_counter() - t0,
                has_prompt(run_metas),
                time.thread_time() - c0,
            )
            if verify:
                self.policy.observe_verified({v.seq_id: v.num_real for v in verify if v.num_real}, accepted)
        return outputs

    @staticmethod
    def _skip_reason(
        md: SequenceGroupMetadata, data: SequenceData, policy: str | None, proposed: bool
    ) -> str:
        """Why a sequence with lookahead slots verified no drafts this step: the policy's
        reason (``draft_policy.SKIP_*``), ``max_tokens`` (one token left: a draft could never
        be emitted), ``row_cap`` (the step's rows left no room for its drafts), or
        ``no_proposal`` (the proposer had none: no n-gram match, or a proposer failure)."""
        if policy is not None:
            return policy
        max_tokens = md.sampling_params.max_tokens
        if max_tokens is not None and max_tokens - data.get_output_len() - 1 < 1:
            return "max_tokens"
        return "row_cap" if proposed else "no_proposal"

    def _propose(self, req: ExecuteModelRequest) -> dict[int, Proposal]:
        """The step's proposals: the proposer's as they are (fixed k), or cut / limited to the
        lengths the dynamic policy chooses."""
        policy = self.policy
        if policy is None:
            return self._call_proposer("propose", req, self.k) or {}
        if getattr(self.proposer, "proposes_cheaply", True):
            full = self._call_proposer("propose", req, self.k) or {}
            try:
                return policy.cut_proposals(req.seq_group_metadata_list, full)
            except Exception:
                logger.exception("the draft-length policy failed; this step uses the full proposals")
                return full
        try:
            limited = policy.limit_request(req)
        except Exception:
            logger.exception("the draft-length policy failed; this step proposes up to k drafts")
            limited = req
        t0 = time.perf_counter()
        proposals = self._call_proposer("propose", limited, self.k) or {}
        depth = max((len(p.token_ids) for p in proposals.values()), default=0)
        policy.observe_proposer(depth, time.perf_counter() - t0)
        return proposals

    def _max_rows(self) -> int | None:
        """The most rows a step may have with its drafts: the target's
        ``cpu_decode_step.uniform_kernel_rows`` (None: no cap, e.g. float32), computed once."""
        if self._row_cap is None:
            model = getattr(getattr(self.worker, "runner", None), "model", None)
            cap = None
            if model is not None and hasattr(model, "layers") and hasattr(model, "lm_head"):
                from kvserve.model_executor.models.cpu_decode_step import uniform_kernel_rows

                cap = uniform_kernel_rows(model)
            self._row_cap = (cap,)
        return self._row_cap[0]

    def _cap_rows(
        self, metas: list[SequenceGroupMetadata], proposals: dict[int, Proposal]
    ) -> dict[int, Proposal]:
        """``proposals`` cut so that the step's rows (prefill chunks, one per decode, and every
        group's padded drafts) stay within ``_max_rows``: past it the target's kernels change
        and an accepted draft's K/V would not be the plain decode's, so greedy output could
        drift from speculation off. Groups in metadata order take what is left; a step whose
        plain rows already exceed the cap verifies nothing."""
        cap = self._max_rows()
        if cap is None or not proposals:
            return proposals
        budget = cap - base_rows(metas)
        out: dict[int, Proposal] = {}
        for md in metas:
            if md.is_prompt or md.num_speculative_tokens < 1:
                continue
            ps = {sid: proposals[sid] for sid in md.seq_data if sid in proposals and proposals[sid].token_ids}
            if not ps:
                continue
            # the group's sequences share one chunk length (padded): m rows for each
            n = len(md.seq_data)
            m = min(max(len(p.token_ids) for p in ps.values()), max(0, budget) // n)
            if m < 1:
                continue
            budget -= m * n
            for sid, p in ps.items():
                out[sid] = Proposal(
                    list(p.token_ids[:m]), None if p.probs is None else p.probs[:m], p.match_len
                )
        return out

    def _verify_chunks(
        self, metas: list[SequenceGroupMetadata], proposals: dict[int, Proposal]
    ) -> tuple[list[SequenceGroupMetadata], list[_Verify]]:
        """The step's metadata with each speculating decode replaced by its verify chunk."""
        run_metas = list(metas)
        verify: list[_Verify] = []
        if not proposals:
            return run_metas, verify
        for i, md in enumerate(metas):
            if md.is_prompt or md.num_speculative_tokens < 1:
                continue
            limit = min(md.num_speculative_tokens, self.k)
            max_tokens = md.sampling_params.max_tokens
            real: dict[int, tuple[list[int], torch.Tensor | None]] = {}
            for sid, data in md.seq_data.items():
                p = proposals.get(sid)
                m = limit if p is None else min(len(p.token_ids), limit)
                if max_tokens is not None:  # drafts past max_tokens could never be emitted
                    m = min(m, max_tokens - data.get_output_len() - 1)
                if p is None or m < 1:
                    continue
                drafts = [int(t) for t in p.token_ids[:m]]
                if self._valid_proposal(drafts, p, m):
                    real[sid] = (drafts, p.probs[:m] if p.probs is not None else None)
            if not real:
                continue
            # The group's sequences share one chunk size (they advance in lockstep): shorter
            # proposals are padded; padding is never accepted.
            m = max(len(d) for d, _ in real.values())
            masks = None
            if md.token_bitmask is not None:
                # Constrained: the grammar check and the per-position masks run on the
                # grammar thread while the forward runs.
                masks = md.token_bitmask.verify_masks([real.get(sid, ([], None))[0] for sid in md.seq_data])
            seq_data = {}
            for j, (sid, data) in enumerate(md.seq_data.items()):
                drafts, probs = real.get(sid, ([], None))
                padded = drafts + [0] * (m - len(drafts))
                vdata = SequenceData([])
                vdata.prompt_token_ids = data.prompt_token_ids  # shared, read only
                vdata.output_token_ids = data.output_token_ids + padded
                vdata.set_num_computed_tokens(data.get_num_computed_tokens())
                seq_data[sid] = vdata
                verify.append(
                    _Verify(i, sid, data, padded, len(drafts), probs, None if masks is None else (masks, j))
                )
            run_metas[i] = dataclasses.replace(md, seq_data=seq_data, token_chunk_size=m + 1, do_sample=False)
        return run_metas, verify

    def _valid_proposal(self, drafts: list[int], p: Proposal, m: int) -> bool:
        """Drafts inside the vocabulary and, if given, draft probabilities of shape
        ``[>= m, vocab]``; anything else is dropped (that sequence decodes plainly)."""
        V = self.vocab_size
        ok = all(0 <= t < V for t in drafts) if V is not None else all(t >= 0 for t in drafts)
        if ok and p.probs is not None:
            shape = tuple(p.probs.shape)
            ok = len(shape) == 2 and shape[0] >= m and (V is None or shape[1] == V)
        if not ok and not self._warned_bad_proposal:
            self._warned_bad_proposal = True
            logger.warning(
                "dropped a malformed proposal (token ids outside the vocabulary or bad probs shape)"
            )
        return ok

    @staticmethod
    def _verify_rows(verify: list[_Verify], inp: Any) -> torch.Tensor:
        """int64 indices of the forward's rows of every verify position, in ``verify`` order
        (``len(drafts) + 1`` per entry)."""
        hidden_rows: list[int] = []
        for v in verify:
            start, end = inp.seq_rows[v.seq_id]
            assert end - start == len(v.drafts) + 1, (v.seq_id, start, end, len(v.drafts))
            hidden_rows.extend(range(start, end))
        return torch.tensor(hidden_rows, dtype=torch.long, device=inp.sample_rows.device)

    def _verify(
        self,
        metas: list[SequenceGroupMetadata],
        verify: list[_Verify],
        logits: torch.Tensor,
        outputs: list[CompletionSequenceGroupOutput],
    ) -> dict[int, int]:
        """Score every verify chunk's positions (``logits``: float32 ``[sum(len(drafts) + 1),
        vocab]``, the rows of ``_verify_rows``), accept, fill ``outputs``. Returns seq_id ->
        accepted drafts."""
        sampler: Sampler = self.worker.runner.sampler
        logits = logits.float()
        vocab = logits.shape[1]
        offsets: list[int] = []
        off = 0
        for v in verify:
            offsets.append(off)
            off += len(v.drafts) + 1
        self._apply_grammar(verify, offsets, logits)
        rows: list[_Row] = []
        for v in verify:
            md = metas[v.index]
            params = md.sampling_params
            for j in range(len(v.drafts) + 1):
                pdata = _PositionData(v.data, v.drafts, j, params.needs_penalties or bool(params.bad_words))
                # _PositionData stands in for SequenceData: it serves the sampler's reads
                rows.append(
                    _Row(
                        v.index,
                        v.seq_id,
                        1,
                        params,
                        pdata,  # type: ignore[arg-type]
                        sampler._suppressed_ids(params, pdata, vocab),  # type: ignore[arg-type]
                        None,
                    )
                )
        adjusted = Sampler.adjust(logits, rows)
        random_ids = [n for n, v in enumerate(verify) if not metas[v.index].sampling_params.is_greedy]
        # All greedy: the sampler's fused argmax + logsumexp pass over the rows (the plain
        # decode's own kernel, so an emitted token's logprob is computed as without
        # speculation); torch's separate argmax over [rows, V] would be a second full pass.
        greedy_lps: list[float] | None = None
        if not random_ids and elementwise.supported(adjusted):
            tok, lp = elementwise.greedy_sample(adjusted)
            argmax, greedy_lps = tok.tolist(), lp.tolist()
        else:
            argmax = adjusted.argmax(dim=-1).tolist()

        emitted: dict[int, list[int]] = {}  # verify index -> emitted token ids
        for n, v in enumerate(verify):
            if metas[v.index].sampling_params.is_greedy:
                t = argmax[offsets[n] : offsets[n] + len(v.drafts) + 1]
                a = 0
                while a < v.num_allowed and v.drafts[a] == t[a]:
                    a += 1
                emitted[n] = t[: a + 1]
        if random_ids:
            emitted.update(self._rejection(metas, verify, random_ids, offsets, adjusted))

        # A group with several sequences emits as many tokens for each as the one that
        # accepted fewest (lockstep); cutting a verified run short keeps every kept token's
        # distribution (each is drawn given the tokens before it).
        shortest: dict[int, int] = {}
        for n, v in enumerate(verify):
            shortest[v.index] = min(shortest.get(v.index, len(emitted[n])), len(emitted[n]))
        # Log-probabilities of the emitted tokens only: one logsumexp over their rows (the
        # rows after a rejection need none, and a full log_softmax wrote all V of every row).
        kept = [emitted[n][: shortest[v.index]] for n, v in enumerate(verify)]
        sel_rows = [offsets[n] + j for n, toks in enumerate(kept) for j in range(len(toks))]
        want_top = any(metas[v.index].sampling_params.logprobs is not None for v in verify)
        if greedy_lps is not None and not want_top:
            # every kept token is its row's argmax: greedy_sample gave its logprob
            all_lps = [greedy_lps[r] for r in sel_rows]
        else:
            sel = torch.tensor(sel_rows, dtype=torch.long, device=adjusted.device)
            sel_logits = adjusted.index_select(0, sel)
            lse = sel_logits.logsumexp(dim=-1)
            flat_toks = torch.tensor(
                [t for toks in kept for t in toks], dtype=torch.long, device=adjusted.device
            )
            all_lps = (sel_logits.gather(1, flat_toks.unsqueeze(1)).squeeze(1) - lse).tolist()
        accepted: dict[int, int] = {}
        first_row = 0
        for n, v in enumerate(verify):
            md = metas[v.index]
            params = md.sampling_params
            toks = kept[n]
            r0, first_row = first_row, first_row + len(toks)
            lps = all_lps[r0:first_row]
            tops: list[dict[int, Logprob] | None] = [None] * len(toks)
            if params.logprobs is not None:
                kk = min(vocab, params.logprobs)
                vals = ids = None
                rows_logits = sel_logits[r0:first_row]
                if kk > 0:
                    tv, ti = rows_logits.topk(kk, dim=-1)
                    tv = tv - lse[r0:first_row].unsqueeze(1)
                    vals, ids = tv.tolist(), ti.tolist()
                # each token's rank: 1 + the tokens with a larger logit at its position
                chosen = rows_logits.gather(1, torch.tensor(toks, device=rows_logits.device).unsqueeze(1))
                ranks = ((rows_logits > chosen).sum(dim=1) + 1).tolist()
                for j, token in enumerate(toks):
                    top: dict[int, Logprob] = (
                        {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids[j], vals[j]))}
                        if ids is not None and vals is not None
                        else {}
                    )
                    if token not in top:
                        top[token] = Logprob(lps[j], ranks[j])
                    tops[j] = top
            samples = [
                SequenceOutput(parent_seq_id=v.seq_id, output_token=tok, logprob=lp, top_logprobs=top)
                for tok, lp, top in zip(toks, lps, tops)
            ]
            first = samples[0]
            first.spec_tokens = samples[1:]
            first.num_draft_tokens = v.num_real
            first.num_accepted_tokens = len(toks) - 1
            group_out = outputs[v.index]  # (empty from the runner: a verify chunk samples nothing)
            group_out.samples.append(first)
            group_out.spec_num_draft_tokens += v.num_real
            group_out.spec_num_accepted_tokens += len(toks) - 1
            accepted[v.seq_id] = len(toks) - 1
        return accepted

    @staticmethod
    def _apply_grammar(verify: list[_Verify], offsets: list[int], logits: torch.Tensor) -> None:
        """Set each verify entry's ``num_allowed`` and mask the logits rows of its positions
        ``0 .. num_allowed`` with its grammar (in place; unconstrained entries untouched)."""
        row_ids: list[int] = []
        parts: list[torch.Tensor] = []
        for n, v in enumerate(verify):
            v.num_allowed = v.num_real
            if v.masks is None:
                continue
            vm, j = v.masks
            allowed, rows = vm.get(j)
            v.num_allowed = min(v.num_real, allowed)
            parts.append(rows[: v.num_allowed + 1])
            row_ids.extend(range(offsets[n], offsets[n] + v.num_allowed + 1))
        if parts:
            apply_token_bitmask_(logits, torch.tensor(row_ids, dtype=torch.long), torch.cat(parts))

    def _rejection(
        self,
        metas: list[SequenceGroupMetadata],
        verify: list[_Verify],
        ids: list[int],
        offsets: list[int],
        adjusted: torch.Tensor,
    ) -> dict[int, list[int]]:
        """Rejection-sample the random rows ``ids`` (indices into ``verify``) in one call."""
        k = max(1, max(verify[n].num_allowed for n in ids))
        B, V = len(ids), adjusted.shape[1]
        device = adjusted.device
        target = torch.zeros(B, k + 1, V, dtype=torch.float32, device=device)
        draft_ids = torch.zeros(B, k, dtype=torch.long, device=device)
        counts = torch.zeros(B, dtype=torch.long, device=device)
        any_probs = any(verify[n].draft_probs is not None for n in ids)
        draft_probs = torch.zeros(B, k, V, dtype=torch.float32, device=device) if any_probs else None
        generators = []
        for b, n in enumerate(ids):
            v = verify[n]
            m = v.num_allowed
            params = metas[v.index].sampling_params
            target[b, : m + 1] = Sampler.sampling_probs(
                adjusted[offsets[n] : offsets[n] + m + 1], [params] * (m + 1)
            )
            draft_ids[b, :m] = torch.tensor(v.drafts[:m], dtype=torch.long)
            counts[b] = m
            if draft_probs is not None:
                if v.draft_probs is not None:
                    draft_probs[b, :m] = v.draft_probs[:m].to(device=device, dtype=torch.float32)
                else:  # a proposer without a distribution: a point mass on each draft
                    draft_probs[b, torch.arange(m), draft_ids[b, :m]] = 1.0
            generators.append(metas[v.index].generator)
        # every row draws for k = num_speculative_tokens drafts, whatever this step's largest
        # count: a seeded row's stream must not depend on what the other rows draft
        tokens, num_acc = rejection_sample(
            target, draft_ids, draft_probs, generators, counts, draws_per_row=self.k
        )
        out: dict[int, list[int]] = {}
        tok_list, acc_list = tokens.tolist(), num_acc.tolist()
        for b, n in enumerate(ids):
            out[n] = [int(t) for t in tok_list[b][: int(acc_list[b]) + 1]]
        return out
