"""The shape of one engine step: what its cost depends on, read from an ``ExecuteModelRequest``.

One function, ``step_shape``, is used both by the profiler (on the requests the real worker
runs) and by the simulated executor (on the requests the same scheduler gives it), so the cost
model is fitted and applied to exactly the same quantities.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.sequence import ExecuteModelRequest


@dataclass
class StepShape:
    """Counts describing one step (all >= 0).

    Attributes:
        prefill_tokens: query tokens of prompt chunks (chunked prefill or whole prompts).
        prefill_seqs: prompt chunks in the step.
        prefill_attn_pairs: (query, key) pairs the prompt chunks attend over, in units of
            1,000 pairs: a chunk of ``q`` tokens after ``c`` computed ones attends
            ``q * c + q * (q + 1) / 2`` pairs (causal).
        decode_seqs: decoding sequences (one query token each).
        context_tokens: KV positions the decodes read (sum of their lengths).
        sampled_rows: rows that get a token sampled (decodes plus prompt chunks that end).
        swapped_blocks: blocks swapped in plus swapped out.
        copied_blocks: copy-on-write block copies.
        verify_tokens: speculative drafts verified (query tokens beyond each decode's one).
        loras: distinct LoRA adapters the step's groups run with.
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attn_pairs: float = 0.0
    decode_seqs: int = 0
    context_tokens: int = 0
    sampled_rows: int = 0
    swapped_blocks: int = 0
    copied_blocks: int = 0
    verify_tokens: int = 0
    loras: int = 0

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0 and self.swapped_blocks == 0

    @property
    def shape_class(self) -> str:
        """``prefill`` | ``decode`` | ``mixed`` (prompt chunks and decodes) | ``swap`` (a step
        that moves blocks) | ``empty``: the classes the fit reports its error for."""
        if self.swapped_blocks:
            return "swap"
        if self.prefill_tokens and self.decode_seqs:
            return "mixed"
        if self.prefill_tokens:
            return "prefill"
        if self.decode_seqs:
            return "decode"
        return "empty"

    def as_dict(self) -> dict:
        return asdict(self)


def step_shape(req: ExecuteModelRequest) -> StepShape:
    """The ``StepShape`` of ``req`` (token counts from each group's sequences, as the worker
    sees them before the step: ``num_computed_tokens`` is where the chunk starts)."""
    s = StepShape()
    for meta in req.seq_group_metadata_list:
        chunk = meta.token_chunk_size
        for data in meta.seq_data.values():
            if meta.is_prompt:
                c = data.get_num_computed_tokens()
                s.prefill_tokens += chunk
                s.prefill_seqs += 1
                s.prefill_attn_pairs += (chunk * c + chunk * (chunk + 1) / 2) / 1000.0
                if meta.do_sample:
                    s.sampled_rows += max(1, meta.num_samples)
            else:
                s.decode_seqs += 1
                s.context_tokens += data.get_len()
                s.sampled_rows += 1
    s.swapped_blocks = len(req.blocks_to_swap_in) + len(req.blocks_to_swap_out)
    s.copied_blocks = sum(len(v) for v in req.blocks_to_copy.values())
    s.loras = len({meta.lora_int_id for meta in req.seq_group_metadata_list} - {0})
    return s
