"""Tensor parallelism (TP=2, gloo ranks on CPU) on Qwen3 (per-head q/k norms held whole by every
rank), Phi-3 (fused checkpoint tensors split part by part, LongRoPE), Gemma 3 (q/k norms, per-layer windows, two rotary bases) and Gemma 2 (attention and final
soft-caps over the vocab-parallel LM head): greedy tokens equal transformers', log-probabilities
within 1e-4, with the default settings and under a tiny cache (chunked prefill, prefix caching,
swap preemption)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.golden import TEST_DEVICE
from tests.model_executor.family_checks import ENGINE_SETTINGS, hf_greedy, prompts_of, save_family
from tests.model_executor.test_family_gemma import _gemma2, _gemma3
from tests.model_executor.test_family_gemma import _hf_greedy as hf_greedy_uncached
from tests.model_executor.test_family_phi3 import CONFIGS as PHI3_CONFIGS
from tests.model_executor.test_family_phi3 import phi3_config
from tests.model_executor.test_family_qwen3 import CONFIGS as QWEN3_CONFIGS
from tests.model_executor.test_family_qwen3 import qwen3_config

pytestmark = [pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU"), pytest.mark.slow]

FAMILIES = {
    # GQA 4:2 -> 2 heads and 1 KV head per rank, head_dim 32 != hidden / heads
    "qwen3": lambda: qwen3_config(**QWEN3_CONFIGS["gqa-untied"]),
    # multi-head 2:2 with q/k/v bias
    "qwen3-bias": lambda: qwen3_config(**QWEN3_CONFIGS["mha-bias"]),
    # GQA 4:2, LongRoPE past position 32 (the second prompt is longer)
    "phi3": lambda: phi3_config(**PHI3_CONFIGS["gqa-longrope"]),
    "gemma3": lambda: _gemma3(),
    # 6 heads, 2 KV heads: 3 and 1 per rank
    "gemma2": lambda: _gemma2(),
}
MAX_TOKENS = 10


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, default_tokenizer_dir):
    """(checkpoint dir, prompts, transformers' greedy tokens and logprobs for each)."""
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf = save_family(path, FAMILIES[request.param](), default_tokenizer_dir)
    prompts = prompts_of(4, [13, 37, 22, 9])
    # Gemma's reference: uncached forwards (as its family test), the sliding windows applied by
    # transformers' masks over the whole sequence
    ref = hf_greedy_uncached if request.param.startswith("gemma") else hf_greedy
    return path, prompts, [ref(hf, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("settings", ["default", "tiny-swap"])
def test_tp2_greedy_and_logprobs_equal_transformers(family, settings):
    path, prompts, want = family
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        seed=0,
        tensor_parallel_size=2,
        **ENGINE_SETTINGS[settings],
    )
    try:
        model = llm.llm_engine.executor.model
        assert model.tp_size == 2
        cfg = model.config
        assert model.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2
        assert model.layers[0].mlp.inter == cfg.intermediate_size // 2
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
        for out, (tokens, lps) in zip(outs, want):
            assert out.outcome == "finished", (out.outcome, out.error)
            c = out.outputs[0]
            assert list(c.token_ids) == tokens, (list(c.token_ids), tokens)
            got = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
            assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, (got, lps)
        if settings != "default":
            stats = llm.llm_engine.get_kv_cache_stats()
            assert stats["num_preemptions"] > 0
    finally:
        llm.shutdown()
