"""Tensor parallelism (TP=2, gloo ranks on CPU) on the mixture-of-experts families: Mixtral,
Qwen2-MoE (shared expert and its gate, a dense layer, q/k/v bias), Qwen3-MoE (per-head q/k norms,
dense layers) and OLMoE (q/k norms over the whole projection, summed over the ranks;
``clip_qkv``). Experts and the shared expert are split by intermediate columns, one all-reduce
per MoE block: greedy tokens equal transformers', log-probabilities within 1e-4, with the default
settings and under a tiny cache (chunked prefill, prefix caching, swap preemption)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model_executor.models.moe import MoeBlock
from tests.golden import TEST_DEVICE
from tests.model_executor.family_checks import ENGINE_SETTINGS, hf_greedy, prompts_of, save_family
from tests.model_executor.test_family_moe import _config

pytestmark = [pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU"), pytest.mark.slow]

KINDS = ["mixtral_top2", "qwen2_moe_shared", "qwen3_moe", "olmoe"]
MAX_TOKENS = 10


@pytest.fixture(autouse=True)
def _one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "1")


@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory, default_tokenizer_dir):
    """(checkpoint dir, config, prompts, transformers' greedy tokens and logprobs for each)."""
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    cfg = _config(request.param)
    hf = save_family(path, cfg, default_tokenizer_dir)
    prompts = prompts_of(4, [13, 37, 22, 9])
    return path, cfg, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("settings", ["default", "tiny-swap"])
def test_moe_tp2_greedy_and_logprobs_equal_transformers(family, settings):
    path, cfg, prompts, want = family
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
        assert model.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2
        sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoeBlock)]
        assert sparse and all(
            m.experts.inter * 2 == int(getattr(cfg, model.family.inter_field)) for m in sparse
        )
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
            assert llm.llm_engine.get_kv_cache_stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def test_moe_tp2_int8_equals_tp1_int8(tmp_path, default_tokenizer_dir):
    """``quantization="int8"`` at T=2 on Qwen2-MoE whose every rank shard is whole 32-column blocks
    (expert, shared-expert and dense intermediate sizes 64, 64, 128): each rank quantizes its
    slices, the same blocks as at T=1, so greedy tokens equal T=1's and logprobs agree within
    1e-4 (the all-reduce only changes the summation order)."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    save_family(tmp_path, cfg, default_tokenizer_dir)
    prompts = prompts_of(4, [13, 37, 22, 9])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    results = []
    for t in (1, 2):
        llm = LLM(
            model=str(tmp_path),
            device="cpu",
            dtype="float32",
            seed=0,
            tensor_parallel_size=t,
            quantization="int8",
        )
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.shutdown()
        results.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    for (tok1, lp1), (tok2, lp2) in zip(*results):
        assert tok2 == tok1
        err = max(abs(a[t].logprob - b[t].logprob) for a, b, t in zip(lp1, lp2, tok1))
        assert err < 1e-4, err
