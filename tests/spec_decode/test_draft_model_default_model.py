"""The default model (SmolLM2-135M-Instruct) as its own draft model: greedy output equals
speculation off token for token, and (near-)every draft is accepted: the only differences left
are float summation orders between the draft's single-token steps and the verify chunk."""

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_default_model_as_its_own_draft(default_model_dir):
    llm = LLM(
        kv_cache_memory_gib=0.25,
        speculative_config={
            "method": "draft_model",
            "model": str(default_model_dir),
            "num_speculative_tokens": 4,
            # fixed k: the target as its own draft costs a full step per draft, which the dynamic
            # policy may rightly refuse; this test is about the verify path
            "dynamic": False,
        },
    )
    prompts = ["The capital of France is", "Write a short poem about the sea.\n"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    on = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    s = engine.stats
    assert s.spec_num_draft_tokens > 0
    assert s.spec_num_accepted_tokens >= 0.95 * s.spec_num_draft_tokens, s.spec_acceptance_rate
    engine.scheduler.num_lookahead_slots = 0  # the same engine with speculation off
    off = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(on, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    print(f"acceptance {s.spec_acceptance_rate:.3f}, mean accepted length {s.spec_mean_accepted_length:.2f}")
