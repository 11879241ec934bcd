"""Reference greedy decoding with Hugging Face transformers, and the comparison rule.

Float summation order differs between batch shapes, so a comparison may stop at the first step
where the reference's top-two logits are within ``NEAR_TIE`` of each other (a near-tie); every
other difference is a mismatch. Tests report how many near-ties they met.

``TEST_DEVICE`` (``$KVSERVE_TEST_DEVICE``, default ``cpu``) is where the golden tests run both
the engine and the transformers reference (float32 on both sides): ``cuda`` checks the CUDA
path, e.g. ``KVSERVE_TEST_DEVICE=cuda pytest tests/engine/test_e2e_tiny.py tests/worker/test_model_runner.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4

TEST_DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"KVSERVE_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}")


@dataclass
class Reference:
    token_ids: list[int]
    # First step whose top-2 logits are within NEAR_TIE (None: no near-tie).
    near_tie_step: int | None


def hf_greedy_logits(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ``generate`` of one prompt (batch of one: no padding): the new token ids and each
    step's logits (``[vocab]`` float32, on the CPU)."""
    with torch.inference_mode():
        dev = model.device
        out = model.generate(
            torch.tensor([prompt_ids], device=dev),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if eos_token_id is None else 0,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt_ids) :].tolist(), [lg[0].float().cpu() for lg in out.logits]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> Reference:
    """Greedy ``generate`` of one prompt (``hf_greedy_logits``) with its first near-tie step."""
    tokens, logits = hf_greedy_logits(model, prompt_ids, max_new_tokens, eos_token_id)
    near = None
    for step, lg in enumerate(logits):
        top2 = torch.topk(lg, 2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            near = step
            break
    return Reference(tokens, near)


def compare(ours: list[int], ref: Reference) -> bool:
    """True when equal up to the first near-tie (inclusive of lengths up to there). Asserts
    otherwise, with a message showing where they diverge."""
    limit = len(ref.token_ids) if ref.near_tie_step is None else ref.near_tie_step
    assert ours[:limit] == ref.token_ids[:limit], (
        f"greedy mismatch before any near-tie:\n ours={ours[:limit]}\n  ref={ref.token_ids[:limit]}"
    )
    if ref.near_tie_step is None:
        assert len(ours) == len(ref.token_ids), (len(ours), len(ref.token_ids))
    return ref.near_tie_step is not None
