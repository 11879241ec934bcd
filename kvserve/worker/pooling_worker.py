"""The executor of a pooling engine: whole prompts in, one vector per request out.

A pooling step is prefill only: every scheduled group is a whole prompt (the pooling engine
runs without chunked prefill or prefix caching), its tokens are laid one sequence after
another in one forward, and no K/V is written anywhere (the block manager's blocks for the
group are bookkeeping of the step's token budget, freed when the group ends in the same step).
Encoders (``BertModel``) attend bidirectionally within each sequence; a decoder converted to
embeddings (``convert='embed'``) runs its causal prefill without a cache. The pooler
(``layers.pooler``) then takes one vector per sequence; the engine truncates and normalises.
A cross-encoder (``score`` task) gives its classifier's logits instead of a pooled vector.
"""

from __future__ import annotations

import torch

from kvserve.model_executor.layers.attention import AttentionMetadata, PrefillChunk
from kvserve.model_executor.layers.pooler import PoolerConfig, pool
from kvserve.sequence import CompletionSequenceGroupOutput, ExecuteModelRequest
from kvserve.worker.cpu_malloc import keep_freed_memory


class PoolingWorker:
    """Runs pooling steps on ``model``.

    Args:
        model: a ``BertModel`` (``is_encoder``) or a decoder (``LlamaForCausalLM`` family) whose
            ``forward(ids, positions, None, meta)`` gives final hidden states.
        pooler_config: the model's ``PoolerConfig``.
        device: where the model lives.
    """

    def __init__(self, model, pooler_config: PoolerConfig, device: str = "cpu"):
        self.model = model
        self.pooler_config = pooler_config
        self.device = device
        self.is_encoder = bool(getattr(model, "is_encoder", False))
        if device == "cpu":
            keep_freed_memory()  # no page faults on every step's activations (see cpu_malloc)

    def hidden_states(
        self, token_ids: list[list[int]], token_type_ids: list[list[int] | None] | None = None
    ) -> torch.Tensor:
        """Final hidden states ``[sum(len), hidden]`` of the sequences, one after another;
        ``token_type_ids`` per sequence (None, or a None entry: all 0) for an encoder."""
        lens = [len(t) for t in token_ids]
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(self.device)
        types = None
        if token_type_ids is not None and any(t is not None for t in token_type_ids):
            flat = [x for t, n in zip(token_type_ids, lens) for x in (t if t is not None else [0] * n)]
            types = torch.tensor(flat, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            if self.is_encoder:
                return self.model(ids, positions, lens, types)
            chunks, start = [], 0
            for n in lens:
                chunks.append(PrefillChunk(start=start, end=start + n, context_start=0))
                start += n
            meta = AttentionMetadata(write_idx=None, prefills=chunks, num_prefill_tokens=start)
            return self.model(ids, positions, None, meta)

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int] | None] | None = None
    ) -> torch.Tensor:
        """Pooled float32 vectors ``[len(token_ids), hidden]`` (not normalised), or a
        cross-encoder's logits ``[len(token_ids), num_labels]`` (before its activation)."""
        hidden = self.hidden_states(token_ids, token_type_ids)
        lens = [len(t) for t in token_ids]
        if self.pooler_config.task == "score":
            with torch.inference_mode():
                return self.model.score_logits(hidden, lens).cpu()
        return pool(hidden, lens, self.pooler_config.pooling_type).cpu()

    def execute_model(self, req: ExecuteModelRequest) -> list[CompletionSequenceGroupOutput]:
        """One pooled vector per scheduled group (``CompletionSequenceGroupOutput.pooled``).

        Raises:
            ValueError: a group that is not one whole fresh prompt (a chunk, a cached prefix, a
                decode, several sequences): a pooling engine never schedules one.
        """
        token_ids = []
        token_types: list[list[int] | None] = []
        for md in req.seq_group_metadata_list:
            (data,) = md.seq_data.values()
            prompt = data.prompt_token_ids
            if not md.is_prompt or data.get_num_computed_tokens() != 0 or md.token_chunk_size != len(prompt):
                raise ValueError(
                    f"request {md.request_id}: a pooling step runs whole prompts only "
                    f"(chunk of {md.token_chunk_size} of {len(prompt)} tokens)"
                )
            token_ids.append(list(prompt))
            token_types.append(getattr(md.pooling_params, "token_type_ids", None))
        if not token_ids:
            return []
        vecs = self.embed(token_ids, token_types)
        return [CompletionSequenceGroupOutput(pooled=v) for v in vecs]

    def shutdown(self) -> None:
        """Nothing to release (no peers, no cache)."""
