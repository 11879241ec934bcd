"""Paged attention over a block-structured KV cache (Kwon et al., SOSP'23), in plain torch ops.

KV-cache layout (one tensor per layer, see ``kvserve.worker.cache_engine``)::

    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]   # [0] = K, [1] = V

Token ``pos`` of a sequence with block table ``bt`` lives in block ``bt[pos // block_size]``
at offset ``pos % block_size``; its *slot* is ``bt[pos // bs] * bs + pos % bs``.

A batch is flattened (no padding of the token dimension) and ordered as built by the model
runner: first the *multi-token* chunks (prefills), one after the other, then the
*single-token* queries (decodes and 1-token prefill chunks), sorted by context length and
split into a few buckets; each bucket is attended with one masked
``scaled_dot_product_attention`` whose keys are gathered through a padded block-table index
(one ``index_select`` per bucket and layer for K and V together, into a reused workspace).
On CPU the native kernels replace these when the runner asks for them: ``paged_attention``
for the single-token queries (``meta.native_decode``) and ``prefill_attention`` for all
multi-token chunks at once, K/V read from the cache (``meta.native_prefill``).

A quantized cache (int8 / float8 storage dtype, ``layers.kv_quant``) has rows of ``head_dim + 2``
bytes (codes, then a float16 scale): new K/V are quantized on write (by torch, or by
``elementwise.rope_write_kv`` for int8), the torch paths gather the rows and dequantize them to
the query dtype before SDPA, the native decode and prefill kernels read the codes and scales in
place (a chunk's own K/V too, as stored).

The gather index is built so the gathered tensor is already ``[B, kv_heads, L, head_dim]``
contiguous: ``flat[s, b, h, n] = (s * kv_heads + h) * num_blocks + table[b, n]`` over the cache
viewed as ``[2 * kv_heads * num_blocks, block_size * head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model_executor.layers import kv_quant
from kvserve.ops.attention import paged_decode_attention
from kvserve.ops.prefill_attention import paged_prefill_attention


@dataclass
class PrefillChunk:
    """One multi-token chunk of one sequence.

    Attributes:
        start, end: token rows ``[start, end)`` of the flattened batch.
        context_start: position of the chunk's first token (tokens before it are in the cache).
        gather_idx: int64 flat block index (``[2 * kv_heads * n_blocks]``) to read positions
            ``0 .. context_start + n - 1`` back from the cache; ``None`` when
            ``context_start == 0`` (the fresh K/V are used directly).
        key_start: position of the first gathered key (> 0 only with a sliding window).
        mask: bool ``[n, n_keys]`` (True = attend) or ``None`` for plain causal.
    """

    start: int
    end: int
    context_start: int
    gather_idx: torch.Tensor | None = None
    key_start: int = 0
    num_keys: int = 0
    mask: torch.Tensor | None = None


@dataclass
class DecodeBucket:
    """Single-token queries of similar context length, attended together.

    Attributes:
        start, end: rows ``[start, end)`` of the flattened batch (``B = end - start``).
        gather_idx: int64 ``[2 * B * kv_heads * nb]`` flat block index (see module doc).
        num_blocks: ``nb``, the padded block-table width of the bucket.
        mask: bool ``[B, 1, 1, nb * block_size]`` (True = attend).
    """

    start: int
    end: int
    gather_idx: torch.Tensor
    num_blocks: int
    mask: torch.Tensor


@dataclass
class NativeDecode:
    """Inputs of the native decode kernel (``paged_attention``) for rows ``[start, end)``.

    Attributes:
        table: int64 ``[B, nb]``; row ``b`` = block ids from block index ``kstart[b] // bs``.
        kstart, kend: int64 ``[B]``; keys ``kstart <= pos < kend`` are attended.
    """

    start: int
    end: int
    table: torch.Tensor
    kstart: torch.Tensor
    kend: torch.Tensor


@dataclass
class NativePrefill:
    """Inputs of the native prefill kernel (``prefill_attention``) for all multi-token
    chunks (rows ``[0, num_prefill_tokens)``), built once per step and shared by all layers.

    Attributes:
        table: int64 ``[C, nb]``; row ``c`` = block ids from block index ``kstart[c] // bs``.
        q_start: int64 ``[C + 1]``; chunk ``c`` = rows ``q_start[c] .. q_start[c+1] - 1``.
        pos0: int64 ``[C]``; position of each chunk's first token (its cached context).
        kstart: int64 ``[C]``; first key position of each table row.
        window: sliding window in tokens, 0 for none.
    """

    table: torch.Tensor
    q_start: torch.Tensor
    pos0: torch.Tensor
    kstart: torch.Tensor
    window: int = 0


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers.

    Attributes:
        write_idx: int64 ``[2 * kv_heads * T]`` rows of the cache viewed as
            ``[2 * kv_heads * num_blocks * block_size, head_dim]`` that receive the new K/V
            (order ``(s, h, t)``); ``None`` only for a forward without a KV cache.
        slot_mapping: int64 ``[T]``: each token's cache slot ``block * block_size + offset``.
        prefills: the multi-token chunks, rows ``[0, num_prefill_tokens)``.
        num_prefill_tokens: rows taken by ``prefills``.
        native_prefill: when set (native CPU kernel), all ``prefills`` are attended by one
            kernel call per layer from the cache; their ``gather_idx`` / ``mask`` are then only
            built for chunks without cached context (the torch path of a run without a cache).
        num_decode: single-token queries (rows ``num_prefill_tokens ..``), split into
            ``decode_buckets`` of similar length (less padding) -- or all in
            ``native_decode`` when the native CPU kernel is used.
        workspace: flat buffer reused by every layer for gathered K/V (avoids allocating and
            page-faulting tens of MB per layer); ``None`` = allocate.
        lora: the step's ``kvserve.model_executor.layers.lora.LoRAMapping`` (rows per adapter slot), or ``None``
            when no row runs an adapter. (Carried here because every layer reads it.)
        window: the sliding window (tokens) these chunks, buckets and kernel inputs were built
            for; 0 for none.
        windowed: for a model whose layers differ in window (``layer_windows``), the same
            step's metadata built for each other window, keyed by it (same rows, slots and
            ``write_idx``); a layer takes its own with ``for_window``.
        long_prompt: bool ``[T]``: whether each row's sequence has a prompt longer than the
            model's LongRoPE ``original_max_position_embeddings`` (``RotaryEmbedding.lookup``);
            ``None`` for other models.
    """

    write_idx: torch.Tensor | None
    slot_mapping: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode: int = 0
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    native_decode: NativeDecode | None = None
    native_prefill: NativePrefill | None = None
    workspace: torch.Tensor | None = None
    lora: Any = None
    window: int = 0
    windowed: dict[int, AttentionMetadata] = field(default_factory=dict)
    long_prompt: torch.Tensor | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of this step for a layer attending with ``window`` tokens (``None`` /
        0: no window).

        Raises:
            ValueError: the step was not built for that window (the runner builds one variant
                per distinct window of the model's ``layer_windows``).
        """
        w = int(window or 0)
        if w == self.window:
            return self
        variant = self.windowed.get(w)
        if variant is None:
            raise ValueError(
                f"attention metadata built for windows {sorted({self.window, *self.windowed})}, "
                f"a layer asks for window {w}"
            )
        return variant


class PagedAttention:
    """Writes new K/V into the paged cache and attends through block tables.

    Args:
        num_heads, num_kv_heads, head_dim: attention shape (``num_heads % num_kv_heads == 0``).
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        softcap: attention logit soft-cap ``c`` (Gemma 2): scores ``s`` become
            ``c * tanh(s / c)`` before the mask and softmax; ``None`` for none. The native
            kernels do not cap: a capped layer takes the torch paths only (the runner builds
            no native metadata for a model with ``attn_softcap``), with the scores computed
            explicitly instead of by SDPA.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float | None = None
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.softcap = float(softcap) if softcap else None

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, gqa: bool
    ) -> torch.Tensor:
        """``scaled_dot_product_attention(q, k, v)`` (causal when ``mask`` is None; ``q``
        ``[..., Hq, n, D]``, ``k``/``v`` ``[..., Hk, L, D]``), soft-capped when ``softcap`` is
        set: then the scores are formed explicitly, capped, masked and softmaxed in float32."""
        if self.softcap is None:
            if mask is None:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa
                )
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        rep = q.shape[-3] // k.shape[-3]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        s = torch.tanh(s / self.softcap) * self.softcap
        if mask is None:
            n, L = s.shape[-2], s.shape[-1]
            mask = torch.ones(n, L, dtype=torch.bool, device=s.device).tril(L - n)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v)

    @staticmethod
    def _cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache`` as something ``index_select`` takes: its int8 bytes when quantized."""
        return kv_cache.view(torch.int8) if kv_quant.is_quantized(kv_cache.dtype) else kv_cache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """Attention for a flattened batch.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (any strides).
            kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` or ``None``
                (profiling run without a cache: only fresh prefills are allowed); quantized:
                ``[..., head_dim + 2]`` of int8 / float8 (``layers.kv_quant``).
            meta: the step's ``AttentionMetadata``.
            kv_written: ``k`` and ``v`` are already in the cache (``elementwise.rope_write_kv``).
        Returns:
            ``[T, num_heads * head_dim]`` in ``q``'s dtype.
        """
        T = q.shape[0]
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
        quant = kv_cache is not None and kv_quant.is_quantized(kv_cache.dtype)
        rows = None
        if kv_cache is not None and not kv_written:
            assert meta.write_idx is not None, "metadata for a step with a KV cache sets write_idx"
            src = torch.stack((k, v)).transpose(1, 2).reshape(-1, D)  # (s, h, t) order
            if quant:
                rows = kv_quant.quantize(src, kv_cache.dtype)
                flat = kv_cache.view(torch.int8).view(-1, D + kv_quant.SCALE_BYTES)
                flat.index_copy_(0, meta.write_idx, rows)
            else:
                kv_cache.view(-1, D).index_copy_(0, meta.write_idx, src)
        if quant and meta.native_prefill is None and any(pc.gather_idx is None for pc in meta.prefills):
            # a fresh chunk attends its own keys as stored, as a later chunk or a prefix hit
            # reads them: the answer does not depend on where chunks are cut (the native
            # prefill kernel reads them back from the cache). Quantizing is deterministic, so
            # rows written by rope_write_kv are these rows.
            assert kv_cache is not None
            if rows is None:
                rows = kv_quant.quantize(torch.stack((k, v)).transpose(1, 2).reshape(-1, D), kv_cache.dtype)
            deq = kv_quant.dequantize(rows, kv_cache.dtype, k.dtype).view(2, KH, T, D)
            k, v = deq[0].transpose(0, 1), deq[1].transpose(0, 1)
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        npf = meta.native_prefill if kv_cache is not None else None
        if self.softcap is not None and (npf is not None or meta.native_decode is not None):
            raise ValueError(
                "a soft-capped attention layer runs on the torch paths only (no native metadata)"
            )
        if npf is not None and kv_cache is not None:  # (npf is only set with a cache)
            P = meta.num_prefill_tokens
            qp = q[:P]
            if qp.stride(2) != 1 or qp.stride(1) != D:  # the kernel takes any row stride
                qp = qp.contiguous()
            paged_prefill_attention(
                qp,
                kv_cache,
                npf.table,
                npf.q_start,
                npf.pos0,
                npf.kstart,
                self.scale,
                npf.window,
                out=out[:P],
            )
        for pc in meta.prefills if npf is None else ():
            qs = q[pc.start : pc.end].transpose(0, 1)  # [H, n, D]
            # a gather index is only built for a chunk with cached context (context_start > 0)
            if pc.gather_idx is None or kv_cache is None:
                if pc.context_start > 0:  # native metadata without a cache: nothing to read it from
                    raise ValueError(
                        f"a chunk at position {pc.context_start} needs the KV cache for its context"
                    )
                ks = k[pc.start : pc.end].transpose(0, 1)
                vs = v[pc.start : pc.end].transpose(0, 1)
            else:
                bs, W = kv_cache.shape[3], kv_cache.shape[4]
                g = self._cache_rows(kv_cache).view(-1, bs * W).index_select(0, pc.gather_idx)
                g = g.view(2, KH, -1, W)
                if quant:
                    g = kv_quant.dequantize(g, kv_cache.dtype, q.dtype)
                ks = g[0, :, : pc.num_keys]
                vs = g[1, :, : pc.num_keys]
            # A batch dimension of 1: torch's CPU flash kernel takes only 4-D inputs (3-D ones
            # go to the much slower unfused math path).
            qs, ks, vs = qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0)
            o = self._sdpa(qs, ks, vs, pc.mask, self.group > 1)
            out[pc.start : pc.end] = o[0].transpose(0, 1)
        nd = meta.native_decode
        if nd is not None:
            assert kv_cache is not None, "single-token queries read their context from the KV cache"
            B = nd.end - nd.start
            qd = q[nd.start : nd.end]
            if qd.stride(2) != 1 or qd.stride(1) != D:  # the kernel takes any row stride
                qd = qd.contiguous()
            qd = qd.view(B, KH, self.group, D)
            paged_decode_attention(
                qd,
                kv_cache,
                nd.table,
                nd.kstart,
                nd.kend,
                self.scale,
                out=out[nd.start : nd.end].view(B, KH, self.group, D),
            )
        if meta.decode_buckets:
            assert kv_cache is not None, "single-token queries read their context from the KV cache"
            bs, W = kv_cache.shape[3], kv_cache.shape[4]
            rows = self._cache_rows(kv_cache).view(-1, bs * W)
            for b in meta.decode_buckets:
                B = b.end - b.start
                n = b.gather_idx.numel()
                if quant:  # (the workspace is of the model dtype)
                    g = kv_quant.dequantize(
                        rows.index_select(0, b.gather_idx).view(-1, W), kv_cache.dtype, q.dtype
                    )
                elif meta.workspace is not None:
                    g = torch.index_select(
                        rows, 0, b.gather_idx, out=meta.workspace[: n * bs * D].view(n, bs * D)
                    )
                else:
                    g = rows.index_select(0, b.gather_idx)
                g = g.reshape(2, B, KH, b.num_blocks * bs, D)
                qd = q[b.start : b.end].reshape(B, KH, self.group, D)
                o = self._sdpa(qd, g[0], g[1], b.mask, False)
                out[b.start : b.end] = o.reshape(B, H, D)  # CUDA SDPA may return a transposed layout
        return out.view(T, H * D)
