"""Turns an ``ExecuteModelRequest`` into one flattened forward pass and samples.

Batch layout (internal; the sampler sees rows in metadata order):

* rows ``[0, P)``: the multi-token chunks (prefills), one sequence after another;
* rows ``[P, P + B)``: single-token queries (decodes, and 1-token prefill chunks), attended
  together in one batched masked attention. With the native decode kernel, a short decode
  chunk of ``n > 1`` tokens (a speculative verify chunk) is expanded into ``n`` single-token
  rows: row ``i`` is position ``c+i`` and attends keys ``0 .. c+i`` through the block table.
  This is exact because every row's K/V is written to the cache before the layer's attention
  runs, and it keeps a step of decodes and verify chunks on the fast pure-decode path. (Not on
  the torch decode path: it sorts rows by length, which would split a sequence's rows.)

For sequence ``s`` with ``c = num_computed_tokens`` and chunk ``n`` the runner feeds tokens
``c .. c+n-1`` at positions ``c .. c+n-1``, writes their K/V to slots
``table[pos // bs] * bs + pos % bs`` and attends to positions ``0 .. c+n-1`` (the last
``sliding_window`` of them with a window) read back through the block table. Block-table
entries for blocks wholly outside the window are never read unmasked (they may point at any
block).

Metadata are built with a handful of Python operations per *sequence* (numpy ranges for
multi-token chunks) and a few vectorised tensor ops per step; nothing loops per token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.model_executor.layers.attention import (
    AttentionMetadata,
    DecodeBucket,
    NativeDecode,
    NativePrefill,
    PrefillChunk,
)
from kvserve.model_executor.layers.kv_quant import storage_dtype
from kvserve.model_executor.layers.lora import LoRAMapping
from kvserve.model_executor.sampler import PROMPT_LOGPROB_ROWS, prompt_logprobs
from kvserve.ops import attention as paged_attention
from kvserve.ops import prefill_attention
from kvserve.sequence import CompletionSequenceGroupOutput, SequenceGroupMetadata

if TYPE_CHECKING:
    from kvserve.lora.manager import LoRAManager

#: Cost of one extra decode bucket per layer (a gather + an attention call), in padded
#: block-rows (one block of K and V for one sequence); used to trade padding for calls.
BUCKET_OVERHEAD_BLOCK_ROWS = 24
MAX_DECODE_BUCKETS = 4
#: Longest non-prompt chunk run as single-token decode rows (see the module doc); longer ones
#: (never a verify chunk with a sane lookahead) stay chunks, where one prefill attention call
#: reading the context once is cheaper than a decode row per token.
MAX_EXPANDED_DECODE_CHUNK = 16


def split_buckets(
    nblk_sorted: np.ndarray,
    overhead: float = BUCKET_OVERHEAD_BLOCK_ROWS,
    max_buckets: int = MAX_DECODE_BUCKETS,
) -> list[int]:
    """Split an ascending array of per-sequence block counts into at most ``max_buckets``
    contiguous buckets minimising ``sum(len(bucket) * max(bucket)) + overhead * buckets``
    (the padded gather + attention work). Returns the bucket end indices (last == len).
    Exact dynamic programme, vectorised over the split point (``O(max_buckets * B^2)``).
    """
    B = len(nblk_sorted)
    a = nblk_sorted.astype(np.float64)
    j = np.arange(1, B + 1)
    i = np.arange(B)
    # cost of bucket i..j-1 (0-based, j exclusive) = (j - i) * a[j-1]
    seg = (j[None, :] - i[:, None]) * a[None, :]  # [i, j-1]
    seg[i[:, None] > (j[None, :] - 1)] = np.inf
    best = seg[0].copy()  # one bucket covering 0..j-1
    choice = [np.zeros(B, dtype=np.int64)]
    costs = [best + overhead]
    for _ in range(1, max_buckets):
        # prev bucket ends at i (exclusive), i >= 1; new bucket i..j-1
        cand = np.full((B, B), np.inf)
        cand[1:] = best[:-1, None] + seg[1:]
        arg = cand.argmin(axis=0)
        best = cand[arg, np.arange(B)]
        choice.append(arg)
        costs.append(best + overhead * (len(costs) + 1))
    k = int(np.argmin([c[-1] for c in costs]))
    ends = [B]
    end = B
    for level in range(k, 0, -1):
        start = int(choice[level][end - 1])
        ends.append(start)
        end = start
    return sorted(ends)


@dataclass
class ModelInput:
    """Tensors for one forward (on the model's device).

    Attributes:
        input_ids, positions: int64 ``[T]``.
        attn: attention metadata (slots, chunks, decode gather index and mask).
        sample_rows: int64 ``[N]`` rows of the hidden states to turn into logits, in sampler
            order (groups in list order with ``do_sample``, sequences in ``seq_data`` order).
        seq_rows: seq_id -> ``(first_row, end_row)`` of its tokens in the batch.
        prompt_rows: int64 ``[Q]`` rows whose logits become prompt logprobs (only chunks of
            requests that ask for them), or None; prompt_targets: int64 ``[Q]`` the prompt token
            each of those rows scores; prompt_spans: per asking chunk ``(metadata index, first
            position, count, k)``, rows in that order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor
    seq_rows: dict[int, tuple[int, int]]
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_spans: list[tuple[int, int, int, int]] = field(default_factory=list)


class ModelRunner:
    """Builds model inputs from scheduler metadata, runs the model, samples.

    Args:
        model: a ``LlamaForCausalLM`` (our module).
        block_size: tokens per KV block; num_gpu_blocks: blocks in the device pool (for the
            flat cache indices); sliding_window: attention window in tokens or ``None``.
        sampler: callable ``(logits float32 [N, vocab], metadata list) ->
            List[CompletionSequenceGroupOutput]``.
        device: where the model lives.
        use_native: decode attention with the native CPU kernel (``None`` = when available:
            CPU, float32 or bfloat16, compiled); else the torch gather + SDPA path. With it,
            multi-token chunks go to the native prefill kernel too, when that one takes the
            model's head shape (``prefill_attention.supports``) and ``native_prefill``
            is True.
        cache_dtype: ``CacheConfig.cache_dtype``: with a quantized cache the native decode
            and prefill kernels apply only where they have the storage dtype
            (``paged_attention.supports_cache_dtype``; both read every ``QUANT_KIND``).
    """

    #: Attend multi-token chunks with ``prefill_attention`` when ``use_native`` holds
    #: (False: one torch SDPA call per chunk and layer).
    native_prefill = True
    #: A ``kvserve.lora.manager.LoRAManager`` when LoRA is enabled: each step's adapters get
    #: device slots (``activate``) and the batch a per-row slot map (``meta.lora``).
    lora_manager: LoRAManager | None = None

    def __init__(
        self,
        model,
        block_size: int,
        num_gpu_blocks: int,
        sliding_window: int | None,
        sampler,
        device: str = "cpu",
        use_native: bool | None = None,
        cache_dtype: str = "auto",
    ):
        self.model = model
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.sliding_window = sliding_window
        self.sampler = sampler
        self.device = torch.device(device)
        kh = model.num_kv_heads
        # (s * kv_heads + h) for s in (K, V), h in heads: block-row and slot-row offsets.
        sh = np.arange(2 * kh, dtype=np.int64).reshape(2, kh)
        self._block_base = sh * num_gpu_blocks  # [2, KH]
        self._slot_base = sh * num_gpu_blocks * block_size  # [2, KH]
        self._head_dim = model.head_dim
        self._workspace: torch.Tensor | None = None
        self.cache_dtype = cache_dtype
        if use_native is None:
            use_native = (
                self.device.type == "cpu"
                and paged_attention.supports_dtype(model.dtype)
                and paged_attention.supports_cache_dtype(storage_dtype(cache_dtype, model.dtype))
                and paged_attention.available()
            )
        # the native kernels do not soft-cap attention logits
        self.use_native = bool(use_native) and not getattr(model, "attn_softcap", None)
        #: Every window (tokens, 0 for none) some layer attends with, when layers differ
        #: (the model's ``layer_windows``): a step's metadata is built once per window.
        self._layer_windows = sorted({int(w or 0) for w in getattr(model, "layer_windows", None) or ()})
        self._prefill_kernel_ok: bool | None = None  # decided on the first multi-token chunk

    def _native_prefill_applies(self) -> bool:
        """The native prefill kernel takes this model's multi-token chunks (see the class doc)."""
        if not (self.use_native and self.native_prefill):
            return False
        if self._prefill_kernel_ok is None:
            attn = self.model.layers[0].self_attn  # (all layers have one shape)
            self._prefill_kernel_ok = (
                prefill_attention.supports(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.model.dtype)
                and prefill_attention.available()
            )
        return self._prefill_kernel_ok

    def _get_workspace(self, numel: int) -> torch.Tensor:
        """A reusable flat buffer of at least ``numel`` elements (grown by 25 % steps)."""
        if self._workspace is None or self._workspace.numel() < numel:
            self._workspace = torch.empty(int(numel * 1.25) + 1, dtype=self.model.dtype, device=self.device)
        return self._workspace

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, metadata: Seq[SequenceGroupMetadata]) -> ModelInput | None:
        """Flatten the scheduled tokens of ``metadata`` into one batch (``None`` if empty).

        Raises:
            ValueError: a chunk size < 1, a chunk past the sequence end, or a block table too
                short for the chunk.
        """
        bs = self.block_size
        W = self.sliding_window
        # multi-token chunks
        p_tokens: list[int] = []
        p_pos: list[np.ndarray] = []
        p_slots: list[np.ndarray] = []
        p_chunks: list[tuple[int, int, list]] = []  # (c, n, table)
        # single-token queries
        d_tokens: list[int] = []
        d_pos: list[int] = []
        d_slots: list[int] = []
        d_tables: list[list] = []
        d_sids: list[tuple[int, int, int]] = []  # (seq_id, first decode index, count)
        p_sids: list[int] = []
        order: list[tuple[bool, int]] = []  # (is_decode, index) per sampled row
        # prompt logprobs: (group index, is_decode, first row or decode index, first position,
        # count, k) per chunk that asks, and the prompt token after each of those positions
        pl_spans: list[tuple[int, bool, int, int, int, int]] = []
        pl_targets: list[int] = []
        # LoRA: the slot of every row (-1 = base model), in the row order of p / d tokens
        slot_of = self._lora_slots(metadata)
        p_lora: list[int] = []
        d_lora: list[int] = []
        # LongRoPE: whether each row's prompt is longer than the model's threshold
        long_after = getattr(getattr(self.model, "rope", None), "longrope_after", None)
        p_long: list[bool] = []
        d_long: list[bool] = []
        for g, md in enumerate(metadata):
            n = md.token_chunk_size
            if n < 1:
                raise ValueError(f"request {md.request_id}: token_chunk_size={n} (must be >= 1)")
            lslot = -1 if md.lora_request is None or slot_of is None else slot_of[md.lora_request.lora_int_id]
            as_decode = n == 1 or (self.use_native and not md.is_prompt and n <= MAX_EXPANDED_DECODE_CHUNK)
            for sid, data in md.seq_data.items():
                c = data.get_num_computed_tokens()
                if c + n > data.get_len():
                    raise ValueError(
                        f"request {md.request_id} seq {sid}: chunk {c}..{c + n} is past "
                        f"the sequence length {data.get_len()}"
                    )
                table = md.block_tables[sid]
                last = c + n - 1
                if last // bs >= len(table):
                    raise ValueError(
                        f"request {md.request_id} seq {sid}: block table has {len(table)} "
                        f"blocks, position {last} needs {last // bs + 1}"
                    )
                if md.prompt_logprobs_from is not None and md.sampling_params.prompt_logprobs is not None:
                    # position q's logits score prompt token q + 1
                    lo = max(c, md.prompt_logprobs_from)
                    hi = min(c + n, data.get_prompt_len() - 1)
                    if lo < hi:
                        base = (len(d_tokens) if as_decode else len(p_tokens)) + lo - c
                        k = md.sampling_params.prompt_logprobs
                        pl_spans.append((g, as_decode, base, lo, hi - lo, k))
                        pl_targets.extend(data.token_range(lo + 1, hi + 1))
                if slot_of is not None:
                    (d_lora if as_decode else p_lora).extend([lslot] * n)
                if long_after is not None:
                    (d_long if as_decode else p_long).extend([data.get_prompt_len() > long_after] * n)
                if n == 1:
                    d_sids.append((sid, len(d_tokens), 1))
                    d_tokens.append(data.token_at(c))
                    d_pos.append(c)
                    d_slots.append(table[c // bs] * bs + c % bs)
                    d_tables.append(table)
                    if md.do_sample:
                        order.append((True, len(d_tokens) - 1))
                elif as_decode:  # n rows at positions c .. c+n-1, sharing the block table
                    d_sids.append((sid, len(d_tokens), n))
                    d_tokens.extend(data.token_range(c, c + n))
                    d_pos.extend(range(c, c + n))
                    d_slots.extend(table[q // bs] * bs + q % bs for q in range(c, c + n))
                    d_tables.extend([table] * n)
                    if md.do_sample:
                        order.append((True, len(d_tokens) - 1))
                else:
                    p_tokens.extend(data.token_range(c, c + n))
                    pos = np.arange(c, c + n, dtype=np.int64)
                    tbl = np.asarray(table[c // bs : last // bs + 1], dtype=np.int64)
                    p_pos.append(pos)
                    p_slots.append(tbl[pos // bs - c // bs] * bs + pos % bs)
                    p_chunks.append((c, n, table))
                    p_sids.append(sid)
                    if md.do_sample:
                        order.append((False, len(p_chunks) - 1))
        P = len(p_tokens)
        B = len(d_tokens)
        if P + B == 0:
            return None
        dev = self.device
        positions = np.concatenate(p_pos + [np.asarray(d_pos, dtype=np.int64)])
        slots = np.concatenate(p_slots + [np.asarray(d_slots, dtype=np.int64)])
        meta = AttentionMetadata(write_idx=None, num_prefill_tokens=P, num_decode=B, window=int(W or 0))
        ends = [int(e) for e in np.cumsum([n for _, n, _ in p_chunks])]
        # single-token queries: the native kernel takes them in order; the torch path sorts them
        # by block count (of the step's base window) and buckets them
        d_row = np.zeros(0, dtype=np.int64)
        ctx = np.asarray(d_pos, dtype=np.int64)  # query position == last key position
        perm: np.ndarray | None = None
        ends_b: list[int] = []
        if B and self.use_native:
            d_row = np.arange(B, dtype=np.int64)
        elif B:
            perm = np.argsort(self._decode_blocks(ctx, W), kind="stable")
            d_row = np.empty(B, dtype=np.int64)
            d_row[perm] = np.arange(B)  # decode i -> its row offset after sorting
            d_tokens = [d_tokens[i] for i in perm]
            if d_lora:
                d_lora = [d_lora[i] for i in perm]
            if d_long:
                d_long = [d_long[i] for i in perm]
            positions[P:] = ctx[perm]
            slots[P:] = slots[P:][perm]
            ends_b = split_buckets(self._decode_blocks(ctx, W)[perm])
        need = self._attention_parts(meta, p_chunks, ctx, d_tables, perm, ends_b)
        for w in self._layer_windows:
            if w != meta.window:  # the same step for the layers with another window
                variant = AttentionMetadata(write_idx=None, num_prefill_tokens=P, num_decode=B, window=w)
                need = max(need, self._attention_parts(variant, p_chunks, ctx, d_tables, perm, ends_b))
                meta.windowed[w] = variant
        if need:
            meta.workspace = self._get_workspace(need)  # one buffer: layers run one after another
            for variant in meta.windowed.values():
                variant.workspace = meta.workspace

        write_idx = (self._slot_base[:, :, None] + slots[None, None, :]).reshape(-1)
        meta.write_idx = torch.from_numpy(write_idx).to(dev)
        meta.slot_mapping = torch.from_numpy(slots.astype(np.int64, copy=False)).to(dev)
        if slot_of:
            meta.lora = LoRAMapping.build(np.asarray(p_lora + d_lora, dtype=np.int64), dev)
        if long_after is not None:
            meta.long_prompt = torch.tensor(p_long + d_long, dtype=torch.bool, device=dev)
        for variant in meta.windowed.values():
            variant.write_idx, variant.slot_mapping, variant.lora, variant.long_prompt = (
                meta.write_idx,
                meta.slot_mapping,
                meta.lora,
                meta.long_prompt,
            )
        rows = [P + int(d_row[i]) if is_dec else ends[i] - 1 for is_dec, i in order]
        seq_rows = {sid: (pc.start, pc.end) for sid, pc in zip(p_sids, meta.prefills)}
        for sid, i, cnt in d_sids:
            # an expanded chunk only runs natively, where rows keep their order (d_row[i] == i)
            r = int(d_row[i])
            seq_rows[sid] = (P + r, P + r + cnt)
        input_ids = torch.tensor(p_tokens + d_tokens, dtype=torch.long)
        inp = ModelInput(
            input_ids=input_ids.to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn=meta,
            sample_rows=torch.tensor(rows, dtype=torch.long).to(dev),
            seq_rows=seq_rows,
        )
        if pl_spans:
            pl_rows: list[int] = []
            for _, is_dec, base, _, count, _ in pl_spans:
                first_row = P + int(d_row[base]) if is_dec else base
                pl_rows.extend(range(first_row, first_row + count))
            inp.prompt_rows = torch.tensor(pl_rows, dtype=torch.long).to(dev)
            inp.prompt_targets = torch.tensor(pl_targets, dtype=torch.long)
            inp.prompt_spans = [(g, lo, count, k) for g, _, _, lo, count, k in pl_spans]
        return inp

    def _decode_blocks(self, ctx: np.ndarray, W: int | None) -> np.ndarray:
        """Blocks each single-token query at position ``ctx`` reads with window ``W``."""
        first = (np.maximum(ctx - W + 1, 0) // self.block_size) if W else np.zeros_like(ctx)
        return ctx // self.block_size - first + 1

    def _attention_parts(
        self,
        meta: AttentionMetadata,
        p_chunks: list[tuple[int, int, list]],
        ctx: np.ndarray,
        d_tables: list[list],
        perm: np.ndarray | None,
        ends_b: list[int],
    ) -> int:
        """Fill ``meta``'s window-dependent parts for window ``meta.window`` (0: none): the
        multi-token chunks (``prefills``, ``native_prefill``) and the single-token queries
        (``native_decode``, or ``decode_buckets`` over the rows ordered by ``perm`` and split
        at ``ends_b``). Returns the workspace elements the buckets need (0 without any).

        Multi-token chunks: native kernel -> one padded block table (from each chunk's first
        key block) + row ranges for all chunks; torch path -> per chunk a gather index and a
        mask when the chunk has cached context, a mask when its window is shorter than it.
        """
        bs = self.block_size
        W = meta.window
        dev = self.device
        P = meta.num_prefill_tokens
        B = meta.num_decode
        native_p = bool(p_chunks) and self.device.type == "cpu" and self._native_prefill_applies()
        if native_p:
            fbs = [max(0, c - W + 1) // bs if W else 0 for c, _, _ in p_chunks]
            widths = [(c + n - 1) // bs - f + 1 for (c, n, _), f in zip(p_chunks, fbs)]
            pad = np.zeros((len(p_chunks), max(widths)), dtype=np.int64)
            for i, ((_, _, table), f, w) in enumerate(zip(p_chunks, fbs, widths)):
                pad[i, :w] = table[f : f + w]
            q_start = np.zeros(len(p_chunks) + 1, dtype=np.int64)
            np.cumsum([n for _, n, _ in p_chunks], out=q_start[1:])
            meta.native_prefill = NativePrefill(
                table=torch.from_numpy(pad),
                q_start=torch.from_numpy(q_start),
                pos0=torch.tensor([c for c, _, _ in p_chunks], dtype=torch.int64),
                kstart=torch.from_numpy(np.asarray(fbs, dtype=np.int64) * bs),
                window=W,
            )
        start = 0
        for c, n, table in p_chunks:
            pc = PrefillChunk(start=start, end=start + n, context_start=c)
            if c > 0 and not native_p:
                q_pos = np.arange(c, c + n, dtype=np.int64)
                fb = max(0, c - W + 1) // bs if W else 0
                lb = (c + n - 1) // bs
                tbl = np.asarray(table[fb : lb + 1], dtype=np.int64)
                pc.gather_idx = torch.from_numpy(
                    (self._block_base[:, :, None] + tbl[None, None, :]).reshape(-1)
                ).to(dev)
                pc.key_start = fb * bs
                pc.num_keys = c + n - fb * bs
                k_pos = np.arange(pc.key_start, c + n, dtype=np.int64)
                allowed = k_pos[None, :] <= q_pos[:, None]
                if W:
                    allowed &= k_pos[None, :] > q_pos[:, None] - W
                pc.mask = torch.from_numpy(allowed).to(dev)
            elif c == 0 and W and n > W:  # (also for the native path: a run without a cache)
                q_pos = np.arange(n, dtype=np.int64)
                allowed = (q_pos[None, :] <= q_pos[:, None]) & (q_pos[None, :] > q_pos[:, None] - W)
                pc.mask = torch.from_numpy(allowed).to(dev)
            meta.prefills.append(pc)
            start += n
        if not B:
            return 0
        first = (np.maximum(ctx - W + 1, 0) // bs) if W else np.zeros(B, dtype=np.int64)
        nblk = ctx // bs - first + 1
        if perm is None:  # native: one padded block table + key ranges
            nb = int(nblk.max())
            pad = np.zeros((B, nb), dtype=np.int64)
            for i, t in enumerate(d_tables):
                f = int(first[i])
                row = t[f : f + int(nblk[i])]
                pad[i, : len(row)] = row
            meta.native_decode = NativeDecode(
                start=P,
                end=P + B,
                table=torch.from_numpy(pad),
                kstart=torch.from_numpy(np.maximum(ctx - W + 1, 0) if W else np.zeros(B, dtype=np.int64)),
                kend=torch.from_numpy(ctx + 1),
            )
            return 0
        # torch path: one gather index + key mask per bucket of sorted rows
        need = 0
        b0 = 0
        for b1 in ends_b:
            idx = perm[b0:b1]
            nb = int(nblk[idx].max())
            pad = np.zeros((b1 - b0, nb), dtype=np.int64)
            for r, i in enumerate(idx):
                f = int(first[i])
                row = d_tables[i][f : f + int(nblk[i])]
                pad[r, : len(row)] = row
            gidx = self._block_base[:, None, :, None] + pad[None, :, None, :]  # [2, Bk, KH, nb]
            k_pos = first[idx, None] * bs + np.arange(nb * bs, dtype=np.int64)[None, :]
            allowed = k_pos <= ctx[idx, None]
            if W:
                allowed &= k_pos > (ctx[idx, None] - W)
            meta.decode_buckets.append(
                DecodeBucket(
                    start=P + b0,
                    end=P + b1,
                    gather_idx=torch.from_numpy(gidx.reshape(-1)).to(dev),
                    num_blocks=nb,
                    mask=torch.from_numpy(allowed).view(b1 - b0, 1, 1, nb * bs).to(dev),
                )
            )
            need = max(need, gidx.size * bs * self._head_dim)
            b0 = b1
        return need

    def _lora_slots(self, metadata: Seq[SequenceGroupMetadata]) -> dict[int, int] | None:
        """``lora_int_id`` -> device slot for the step's adapters (loaded into slots now), or
        None without a LoRA manager.

        Raises:
            ValueError: a group asks for an adapter while LoRA is not enabled.
        """
        reqs = [md.lora_request for md in metadata if md.lora_request is not None]
        if self.lora_manager is None:
            if reqs:
                raise ValueError(f"request asks for LoRA adapter {reqs[0].lora_name!r}; LoRA is not enabled")
            return None
        return self.lora_manager.activate(reqs)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def execute(
        self, metadata: Seq[SequenceGroupMetadata], kv_caches: list[torch.Tensor] | None
    ) -> list[CompletionSequenceGroupOutput]:
        """Forward all scheduled tokens, compute float32 logits for the sampled rows (and the
        prompt logprobs of the prompt positions of requests asking for them, in slices of
        ``PROMPT_LOGPROB_ROWS`` rows: see ``logits``), and sample. Returns one
        ``CompletionSequenceGroupOutput`` per metadata entry."""
        inp, hidden = self.forward(metadata, kv_caches)
        return self.sample(metadata, inp, hidden)

    @torch.inference_mode()
    def forward(
        self, metadata: Seq[SequenceGroupMetadata], kv_caches: list[torch.Tensor] | None
    ) -> tuple[ModelInput | None, torch.Tensor | None]:
        """Run the model over all scheduled tokens (K/V written to the cache). Returns the
        inputs (``seq_rows`` maps each sequence to its rows) and the final hidden states
        ``[T, hidden]``, or ``(None, None)`` when nothing is scheduled."""
        inp = self.prepare_inputs(metadata)
        if inp is None:
            return None, None
        return inp, self.model(inp.input_ids, inp.positions, kv_caches, inp.attn)

    @torch.inference_mode()
    def sample(
        self,
        metadata: Seq[SequenceGroupMetadata],
        inp: ModelInput | None,
        hidden: torch.Tensor | None,
    ) -> list[CompletionSequenceGroupOutput]:
        """Logits of the sampled rows (and prompt logprobs) of a ``forward``, sampled."""
        if inp is None or hidden is None:
            return self.sampler(None, list(metadata))
        logits, pl_entries = self.logits(inp, hidden)
        return self.sample_logits(metadata, inp, logits, pl_entries)

    def sample_logits(
        self,
        metadata: Seq[SequenceGroupMetadata],
        inp: ModelInput,
        logits: torch.Tensor | None,
        pl_entries: list[dict] | None,
    ) -> list[CompletionSequenceGroupOutput]:
        """``sample``'s second half: sample ``logits`` (``[N, vocab]`` float32, one row per
        sampled row of ``inp``, in order) and attach ``pl_entries`` (``logits``' second
        result: one prompt-logprob dict per row of ``inp.prompt_rows``)."""
        assert logits is not None, "only the driver rank samples"
        outputs = self.sampler(logits, list(metadata))
        if pl_entries is not None:
            entries = pl_entries
            row = 0
            for g, lo, count, _ in inp.prompt_spans:
                outputs[g].prompt_logprobs = entries[row : row + count]
                outputs[g].prompt_logprobs_start = lo + 1
                row += count
        return outputs

    @torch.inference_mode()
    def logits(
        self, inp: ModelInput, hidden: torch.Tensor, extra_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, list[dict] | None]:
        """float32 logits ``[N, vocab]`` of the sampled rows and the prompt logprobs of the
        ``Q`` prompt-logprob rows (``sampler.prompt_logprobs``: one ``{token_id: Logprob}``
        per row of ``inp.prompt_rows``; None without any) of a ``forward``. Under tensor
        parallelism every rank calls it after the same forward (the LM head's vocabulary
        slices meet in a gather per call, in this order); the other ranks get
        ``(None, None)``.

        Prompt-logprob rows go through the LM head ``PROMPT_LOGPROB_ROWS`` at a time, each
        slice reduced to its top-k before the next: the step holds at most one
        ``[PROMPT_LOGPROB_ROWS, vocab]`` float32 slice (and its temporaries) instead of
        ``[Q, vocab]`` (Q up to the step's token budget), and the work stays proportional to
        the step's prompt rows, which the token budget bounds.

        ``extra_rows``: int64 indices of more rows of ``hidden`` (a speculative step's verify
        positions) whose logits follow the sampled rows' in the same LM head call
        (``[N + E, vocab]``): the head's weights are read once a step, not once per kind of row
        (a second call would stream the whole head again, a visible share of a decode step).
        """
        rows = inp.sample_rows if extra_rows is None else torch.cat([inp.sample_rows, extra_rows])
        h = hidden.index_select(0, rows)
        logits = self.model.compute_logits(h)
        if logits is not None:
            # An RMS norm whose input's mean square overflowed returns exactly 0 for the whole
            # row (x * rsqrt(inf)): its logits are finite but meaningless (all equal). Such rows
            # become NaN, so the sampler fails their request instead of sampling them.
            n = int(inp.sample_rows.shape[0])
            collapsed = (h[:n] == 0).all(dim=1)
            if bool(collapsed.any()):
                logits[:n][collapsed] = float("nan")
        if inp.prompt_rows is None:
            return logits, None
        targets = inp.prompt_targets
        assert targets is not None, "set together with prompt_rows"
        ks = [k for _, _, count, k in inp.prompt_spans for _ in range(count)]
        entries: list[dict] = []
        for s in range(0, int(inp.prompt_rows.shape[0]), PROMPT_LOGPROB_ROWS):
            e = s + PROMPT_LOGPROB_ROWS
            part = self.model.compute_logits(hidden.index_select(0, inp.prompt_rows[s:e]))
            if part is not None:  # (the driver: every rank runs the same calls)
                entries.extend(prompt_logprobs(part, targets[s:e], ks[s:e]))
            del part
        return logits, entries if logits is not None else None

    @torch.inference_mode()
    def compute_logits(
        self, metadata: Seq[SequenceGroupMetadata], kv_caches: list[torch.Tensor] | None
    ) -> torch.Tensor | None:
        """float32 logits ``[N, vocab]`` for the sampled rows (``None`` if nothing is scheduled)."""
        inp = self.prepare_inputs(metadata)
        if inp is None:
            return None
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.attn)
        return self.model.compute_logits(hidden.index_select(0, inp.sample_rows))
