"""Draft-model proposer: a small local HF Llama-family model guesses the next ``k`` tokens.

The draft model has its own paged KV cache (``CacheEngine``) with exactly as many blocks as the
target's, addressed by the *target's* block tables: the one block manager hands out block
numbers for both, and every swap-out, swap-in and copy of a step is applied to both caches. So
the scheduler and block manager know nothing of the draft.

Validity (the draft must never read stale K/V). Per sequence the proposer records ``valid``:
how many leading positions hold K/V that the draft wrote for *this* sequence's tokens, and the
block numbers they were written to. At each step:

- ``valid`` is capped by the target's ``num_computed_tokens`` (tokens before it never change),
  and by the first block whose number differs from the recorded one (a prefix-cache hit on
  blocks another sequence computed); swaps and copies translate the recorded numbers, so a
  swapped-out and swapped-in sequence keeps its draft K/V.
- a sequence recomputed after preemption (``SequenceData.num_recomputes`` changed) starts over
  at 0, even where it finds its old block numbers again: its blocks were freed, and a
  prefix-cache hit may be on a block that was evicted, written by another sequence's draft and
  then recomputed for this content on the target alone (by a request the draft never saw).
- the draft then feeds whatever it is missing: for a prefill chunk ``c .. c+n-1`` of the step
  it feeds ``valid .. c+n-1``; for a speculating decode of length ``L`` it feeds
  ``valid .. L-1`` (usually one token, two after a fully accepted run: the last draft is never
  fed to the draft model), samples draft 1, then feeds each draft back for the next, ``m``
  single-token steps in all (one batched forward per step across sequences).
- after verification (``on_verified``) ``valid = L + min(accepted, m - 1)``: the K/V of drafts
  past the accepted run were computed from rejected tokens.

Plain (non-speculating) decodes are not fed: the draft catches up the next time the sequence
speculates. A step's first draft forward feeds at most ``max_catch_up_tokens`` (the target's
step budget); a sequence further behind is fed that much and proposes in a later step. Greedy requests get greedy drafts (``probs=None``: a deterministic proposal); random
requests get drafts sampled from the draft's distribution under the request's temperature,
top-k, top-p and min-p, with those distributions (``Proposal.probs``) for rejection sampling;
seeded requests draw from their own generator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch

from kvserve.config import SpeculativeConfig
from kvserve.model_executor.sampler import Sampler
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.spec_decode.interfaces import Proposal, Proposer
from kvserve.worker.cache_engine import CacheEngine
from kvserve.worker.model_runner import ModelRunner

__all__ = ["DraftModelProposer"]


@dataclasses.dataclass
class _SeqState:
    #: Leading positions whose draft K/V were written for this sequence's current tokens.
    valid: int = 0
    #: Block numbers those positions (and any drafts past them) were written to; an entry
    #: ``< 0`` is CPU block ``-1 - entry`` (swapped out).
    table: list[int] = dataclasses.field(default_factory=list)
    #: ``(L, fed)`` of the last proposal awaiting ``on_verified``: the length at proposal and
    #: how many drafts were fed back to the draft model (their K/V written at ``L, L+1, ..``).
    pending: tuple[int, int] | None = None
    #: The sequence's ``SequenceData.num_recomputes`` when this state began.
    recomputes: int = 0


@dataclasses.dataclass
class _Item:
    """One sequence's work in a step."""

    md: SequenceGroupMetadata
    seq_id: int
    data: SequenceData
    table: list[int]
    start: int  # first position to feed
    end: int  # feed positions start .. end-1 in the first forward
    num_drafts: int  # 0: a prefill chunk (nothing proposed)
    drafts: list[int] = dataclasses.field(default_factory=list)
    probs: list[torch.Tensor] = dataclasses.field(default_factory=list)


def _view(data: SequenceData, extra: list[int], num_computed: int) -> SequenceData:
    """A ``SequenceData`` with ``data``'s tokens (+ ``extra`` drafts), computed count set,
    sharing ``data``'s lists (the runner only reads them)."""
    view = SequenceData([])
    view.prompt_token_ids = data.prompt_token_ids
    view.output_token_ids = data.output_token_ids + extra if extra else data.output_token_ids
    view.set_num_computed_tokens(num_computed)
    return view


class DraftModelProposer(Proposer):
    """Proposes with a draft model sharing the target's tokenizer and block tables.

    Args:
        spec_config: ``model`` (a local HF Llama-family directory) and
            ``num_speculative_tokens``.
        worker: the target ``kvserve.worker.worker.Worker``: the draft runs on its device in its
            dtype, with its block size; its KV cache gets as many blocks as the worker's
            (``init_cache``, or on first use once the worker's cache exists).

    Raises:
        ValueError: naming ``speculative_config.model``: the directory is not a supported
            model, or its vocabulary size differs from the target's; or a sliding-window KV
            cache (blocks leaving the window are recycled, which the draft's catch-up cannot
            follow).
    """

    #: A forward per draft: the dynamic policy chooses each sequence's length before proposing.
    proposes_cheaply = False

    def __init__(self, spec_config: SpeculativeConfig, worker: Any):
        from kvserve.model_executor.model_loader import load_hf_config, load_model, resolve_model_dir
        from kvserve.transformers_utils.hf_config import get_sliding_window

        field = "speculative_config.model"
        try:
            model_dir = resolve_model_dir(spec_config.model)
            hf_config = load_hf_config(model_dir)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        target_vocab = int(worker.hf_config.vocab_size)
        if int(hf_config.vocab_size) != target_vocab:
            raise ValueError(
                f"{field}: the draft model's vocabulary has {hf_config.vocab_size} tokens but the "
                f"target's has {target_vocab}; a draft model must share the target's tokenizer"
            )
        cache_config = worker.cache_config
        if cache_config.sliding_window is not None:
            raise ValueError(
                f"{field}: a draft model cannot be used with a sliding-window KV cache "
                f"(sliding_window={cache_config.sliding_window})"
            )
        self.k = spec_config.num_speculative_tokens
        self.hf_config = hf_config
        self.device = worker.device
        self.dtype = worker.dtype
        self.block_size = cache_config.block_size
        sc = getattr(worker, "scheduler_config", None)
        # Positions reach max_model_len - 1 + k; the rotary table must cover them even when
        # the draft was trained on shorter contexts (it only proposes: quality, not safety).
        need = (sc.max_model_len if sc is not None else 0) + self.k + 1
        max_position = max(int(getattr(hf_config, "max_position_embeddings", 0) or 0), need)
        try:
            self.model = load_model(model_dir, self.dtype, self.device, hf_config, max_position=max_position)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        self.sliding_window = get_sliding_window(hf_config)
        self._worker = worker
        self.cache_engine: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        self._seqs: dict[int, _SeqState] = {}
        self._copies: dict[int, list[int]] = {}  # this step's copy-on-write moves
        #: Tokens fed to the draft model so far (prefill, catch-up and drafts), for tests and
        #: overhead accounting.
        self.num_fed_tokens = 0
        #: Most tokens the draft's first forward of a step feeds (prefill chunks and catch-up),
        #: so catching up after a long prefix-cache hit or a pause in speculation is spread
        #: over steps instead of one outsize forward: the target's step budget.
        self.max_catch_up_tokens = max(int(sc.max_num_batched_tokens) if sc is not None else 2048, self.k + 1)
        #: Seconds spent in ``propose`` and drafts proposed (the benchmark's overhead figure).
        self.propose_seconds = 0.0
        self.num_proposed_tokens = 0
        if getattr(worker, "cache_engine", None) is not None:
            self._ensure_cache()

    # ------------------------------------------------------------------ cache
    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the draft KV cache (zero-filled) with the target's block counts.

        Raises:
            ValueError: naming ``speculative_config.model``: the draft's pools and the
                target's together exceed host memory (or, on CUDA, free device memory).
        """
        m = self.model
        self._check_memory(num_gpu_blocks, num_cpu_blocks)
        self.cache_engine = CacheEngine(
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            self.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.dtype,
            self.device,
        )
        # The runner's sampler is unused: the proposer samples its own drafts.
        self.runner = ModelRunner(m, self.block_size, num_gpu_blocks, self.sliding_window, None, self.device)
        self._seqs.clear()

    def _check_memory(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Refuse a draft cache that memory cannot hold beside the target's, with the target's
        own check (``Worker._check_host_memory``) over both caches' bytes per block, rather than
        fail in the allocator."""
        from kvserve.worker.cache_engine import bytes_per_block

        m, gib = self.model, float(1 << 30)
        draft_bpb = bytes_per_block(m.num_layers, self.block_size, m.num_kv_heads, m.head_dim, self.dtype)
        where = f"speculative_config.model: the draft model's KV cache ({draft_bpb} bytes a block, as many blocks as the target's)"
        try:
            self._worker._check_host_memory(
                num_gpu_blocks, num_cpu_blocks, self._worker.bytes_per_block() + draft_bpb
            )
        except ValueError as e:
            raise ValueError(
                f"{where} does not fit beside the target's: {e}, or use a smaller draft model"
            ) from None
        if not str(self.device).startswith("cpu") and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            if num_gpu_blocks * draft_bpb > free:
                raise ValueError(
                    f"{where} needs {num_gpu_blocks * draft_bpb / gib:.2f} GiB of device memory but only "
                    f"{free / gib:.2f} GiB is free; lower kv_cache_memory_gib or num_gpu_blocks"
                )

    def _ensure_cache(self) -> tuple[CacheEngine, ModelRunner]:
        if self.cache_engine is None or self.runner is None:
            ce = getattr(self._worker, "cache_engine", None)
            if ce is None:
                raise RuntimeError("the target worker's KV cache must exist before the draft model runs")
            self.init_cache(ce.num_gpu_blocks, ce.num_cpu_blocks)
        assert self.cache_engine is not None and self.runner is not None
        return self.cache_engine, self.runner

    def apply_block_moves(self, req: ExecuteModelRequest) -> None:
        """Mirror the step's swap-out, swap-in and copies on the draft cache, and follow the
        moved blocks in the recorded tables (so swapped sequences keep their draft K/V)."""
        cache, _ = self._ensure_cache()
        try:
            with torch.inference_mode():
                cache.swap_out(req.blocks_to_swap_out)
                cache.swap_in(req.blocks_to_swap_in)
                cache.copy(req.blocks_to_copy)
        except Exception:
            # Some moves may be half applied: trust nothing the draft computed before.
            self._seqs.clear()
            raise
        if req.blocks_to_swap_out:
            out = req.blocks_to_swap_out
            for st in self._seqs.values():
                st.table = [-1 - out[b] if b >= 0 and b in out else b for b in st.table]
        if req.blocks_to_swap_in:
            back = req.blocks_to_swap_in
            for st in self._seqs.values():
                st.table = [back.get(-1 - b, b) if b < 0 else b for b in st.table]
        self._copies = req.blocks_to_copy

    # ------------------------------------------------------------------ state
    def _valid_prefix(self, st: _SeqState, table: list[int], num_computed: int) -> int:
        """Leading positions of the draft K/V still valid for a sequence whose block table is
        now ``table`` and whose target has computed ``num_computed`` tokens."""
        v = min(st.valid, num_computed)
        nb = -(-v // self.block_size)
        if st.table[:nb] == table[:nb]:
            return v
        copies = self._copies
        for i in range(nb):
            old = st.table[i] if i < len(st.table) else None
            new = table[i]
            if old != new and not (old is not None and new in copies.get(old, ())):
                return i * self.block_size
        return v

    def free(self, seq_ids: Iterable[int]) -> None:
        """Forget ended sequences."""
        for sid in seq_ids:
            self._seqs.pop(sid, None)

    def on_verified(self, num_accepted: dict[int, int]) -> None:
        """Record each sequence's accepted drafts: the draft K/V past the accepted run (fed
        from rejected drafts) is no longer valid."""
        for sid, a in num_accepted.items():
            st = self._seqs.get(sid)
            if st is None or st.pending is None:
                continue
            length, fed = st.pending
            st.valid = length + min(int(a), fed)
            st.pending = None

    # ------------------------------------------------------------------ propose
    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        """Run the step's prefill chunks and catch-up on the draft, then draft up to
        ``min(k, md.num_speculative_tokens)`` tokens (less when ``max_tokens`` is nearer) for
        sequence of each speculating decode. Returns seq_id -> ``Proposal``."""
        t0 = time.perf_counter()
        try:
            proposals = self._propose(req, k)
        finally:
            self.propose_seconds += time.perf_counter() - t0
        self.num_proposed_tokens += sum(len(p.token_ids) for p in proposals.values())
        return proposals

    def _propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        _, runner = self._ensure_cache()
        items: list[_Item] = []
        budget = self.max_catch_up_tokens  # tokens of the step's first draft forward
        for md in req.seq_group_metadata_list:
            speculating = not md.is_prompt and md.num_speculative_tokens > 0
            if not md.is_prompt and not speculating:
                continue  # a plain decode: the draft catches up when it next speculates
            for sid, data in md.seq_data.items():
                table = md.block_tables[sid]
                st = self._seqs.get(sid)
                # The counter, not a step that saw the re-prefill (steps without a speculating
                # decode never reach ``propose``), says the sequence was recomputed meanwhile.
                if st is None or st.recomputes != data.num_recomputes:
                    st = self._seqs[sid] = _SeqState(recomputes=data.num_recomputes)
                st.pending = None
                c = data.get_num_computed_tokens()
                v = self._valid_prefix(st, table, c)
                st.valid = v
                if md.is_prompt:
                    end = min(c + md.token_chunk_size, v + budget)
                    if end > v:
                        items.append(_Item(md, sid, data, table, v, end, 0))
                        budget -= end - v
                    continue
                length = data.get_len()
                m = min(k, md.num_speculative_tokens)
                max_tokens = md.sampling_params.max_tokens
                if max_tokens is not None:  # drafts past max_tokens could never be emitted
                    m = min(m, max_tokens - data.get_output_len() - 1)
                if m < 1:
                    continue
                if length - v > budget:
                    # Too far behind (a long prefix-cache hit, a recompute, many steps without
                    # speculation): catch up by at most the budget now, propose in a later step.
                    if budget > 0:
                        items.append(_Item(md, sid, data, table, v, v + budget, 0))
                        budget = 0
                    continue
                items.append(_Item(md, sid, data, table, v, length, m))
                budget -= length - v
        if not items:
            return {}
        caches = self.cache_engine.gpu_cache if self.cache_engine is not None else None
        # Forward 1: every item's missing tokens (prefill chunks and catch-up) in one batch;
        # speculating items sample their first draft from the last position.
        metas = [
            SequenceGroupMetadata(
                it.md.request_id,
                it.num_drafts == 0,
                {it.seq_id: _view(it.data, [], it.start)},
                it.md.sampling_params,
                {it.seq_id: it.table},
                token_chunk_size=it.end - it.start,
                do_sample=it.num_drafts > 0,
            )
            for it in items
        ]
        self.num_fed_tokens += sum(it.end - it.start for it in items)
        logits = runner.compute_logits(metas, caches)
        spec = [it for it in items if it.num_drafts > 0]
        for it in items:
            st = self._seqs[it.seq_id]
            st.valid = it.end
            st.table = list(it.table[: -(-it.end // self.block_size)])
        if spec and logits is not None:
            self._choose(spec, logits)
        # Forwards 2..m: feed each draft back, one token per speculating sequence.
        for j in range(1, max((it.num_drafts for it in spec), default=0)):
            active = [it for it in spec if it.num_drafts > j]
            lengths = [it.data.get_len() for it in active]
            metas = [
                SequenceGroupMetadata(
                    it.md.request_id,
                    False,
                    {it.seq_id: _view(it.data, it.drafts, n + j - 1)},
                    it.md.sampling_params,
                    {it.seq_id: it.table},
                    token_chunk_size=1,
                )
                for it, n in zip(active, lengths)
            ]
            self.num_fed_tokens += len(active)
            logits = runner.compute_logits(metas, caches)
            assert logits is not None
            self._choose(active, logits)
        proposals: dict[int, Proposal] = {}
        for it in spec:
            st = self._seqs[it.seq_id]
            length = it.data.get_len()
            st.pending = (length, len(it.drafts) - 1)
            st.table = list(it.table[: -(-(length + len(it.drafts) - 1) // self.block_size)])
            probs = torch.stack(it.probs) if it.probs else None
            proposals[it.seq_id] = Proposal(list(it.drafts), probs)
        return proposals

    def _choose(self, items: list[_Item], logits: torch.Tensor) -> None:
        """Append the next draft to each item from its row of ``logits [len(items), V]``:
        argmax for greedy requests, a draw from the request's sampling distribution (kept
        in ``item.probs``) otherwise."""
        logits = logits.float()
        greedy = [i for i, it in enumerate(items) if it.md.sampling_params.is_greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            for i, t in zip(greedy, logits.index_select(0, idx).argmax(dim=-1).tolist()):
                items[i].drafts.append(int(t))
        rand = [i for i, it in enumerate(items) if not it.md.sampling_params.is_greedy]
        if not rand:
            return
        idx = torch.tensor(rand, device=logits.device)
        params = [items[i].md.sampling_params for i in rand]
        probs = Sampler.sampling_probs(logits.index_select(0, idx), params)  # as the target's
        for row, i in enumerate(rand):
            gen = items[i].md.generator
            noise = torch.empty(
                probs.shape[1], dtype=torch.float32, device=gen.device if gen else probs.device
            )
            noise.exponential_(generator=gen)
            noise = noise.to(probs.device).clamp_min_(torch.finfo(torch.float32).tiny)
            token = int((probs[row] / noise).argmax())
            items[i].drafts.append(token)
            items[i].probs.append(probs[row])
