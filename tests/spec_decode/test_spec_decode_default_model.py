"""The default model (SmolLM2-135M-Instruct) with n-gram speculation on input-grounded prompts:
greedy output equals speculation off token for token, and drafts are accepted."""

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PASSAGE = (
    "The scheduler keeps three queues: waiting, running and swapped. Each step it admits new "
    "prompts while the token budget allows, decodes the running sequences and preempts the "
    "lowest ranked group when the KV cache is full."
)
PROMPTS = [
    f"Repeat the following text exactly.\n\nText: {PASSAGE}\n\nRepeated text: The scheduler keeps",
    f"{PASSAGE}\n\nQuestion: what are the three queues called?\nAnswer: The three queues are",
]


def test_default_model_ngram_speculation_equals_off():
    llm = LLM(
        kv_cache_memory_gib=0.25,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    )
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    on = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.stats.spec_num_accepted_tokens > 0
    assert all(o.spec_num_draft_tokens > 0 for o in on)
    engine.scheduler.num_lookahead_slots = 0  # the same engine with speculation off
    drafted = engine.stats.spec_num_draft_tokens
    off = llm.generate(PROMPTS, params, use_tqdm=False)
    assert engine.stats.spec_num_draft_tokens == drafted
    for a, b in zip(on, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids) == 40
    print(
        f"acceptance {engine.stats.spec_acceptance_rate:.2f}, "
        f"mean accepted length {engine.stats.spec_mean_accepted_length:.2f}"
    )
