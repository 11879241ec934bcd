"""Reference greedy decoding with Hugging Face transformers, and the comparison rule.

Float summation order differs between batch shapes, so a comparison may stop at the first step
where the reference's top-two logits are within ``NEAR_TIE`` of each other (a near-tie); every
other difference is a mismatch. Tests report how many near-ties they met.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

NEAR_TIE = 1e-4


@dataclass
class Reference:
    token_ids: List[int]
    # First step whose top-2 logits are within NEAR_TIE (None: no near-tie).
    near_tie_step: Optional[int]


def hf_greedy(model, prompt_ids: List[int], max_new_tokens: int, eos_token_id=None) -> Reference:
    """Greedy ``generate`` of one prompt (batch of one: no padding), with the per-step logits."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if eos_token_id is None else 0,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=eos_token_id, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    near = None
    for step, logits in enumerate(out.logits):
        top2 = torch.topk(logits[0].float(), 2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            near = step
            break
    return Reference(tokens, near)


def compare(ours: List[int], ref: Reference) -> bool:
    """True when equal up to the first near-tie (inclusive of lengths up to there). Asserts
    otherwise, with a message showing where they diverge."""
    limit = len(ref.token_ids) if ref.near_tie_step is None else ref.near_tie_step
    assert ours[:limit] == ref.token_ids[:limit], (
        f"greedy mismatch before any near-tie:\n ours={ours[:limit]}\n  ref={ref.token_ids[:limit]}")
    if ref.near_tie_step is None:
        assert len(ours) == len(ref.token_ids), (len(ours), len(ref.token_ids))
    return ref.near_tie_step is not None
