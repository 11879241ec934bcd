"""Gemma 2 and Gemma 3 (text) against transformers on tiny random models: greedy tokens equal,
logprobs within 1e-4, with per-layer sliding windows shorter than the prompts, under the default
settings and under a tiny KV cache with chunked prefill, prefix caching and each preemption mode."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

VOCAB = 49152  # the default tokenizer's
MAX_TOKENS = 24


def _gemma3(**kw):
    from transformers import Gemma3TextConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads
        query_pre_attn_scalar=24,
        sliding_window=7,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    base.update(kw)
    return Gemma3TextConfig(**base)


def _gemma2(**kw):
    from transformers import Gemma2Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        attn_logit_softcapping=1.5,  # small, so that capping changes the answer
        final_logit_softcapping=8.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    base.update(kw)
    return Gemma2Config(**base)


CONFIGS = {
    # GQA 2:1, head_dim 32 with hidden 64, windows of 7 around one global layer, scaled global rope
    "gemma3-gqa2": lambda: _gemma3(),
    # GQA 4:1 (one KV head, as the 270M checkpoint), global first layer, window 5
    "gemma3-mqa": lambda: _gemma3(
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=5,
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        tie_word_embeddings=False,
    ),
    # Gemma 2: alternating layers (sliding first), attention and final soft-caps, GQA 3:1
    "gemma2-softcap": lambda: _gemma2(),
}


def _save(path, config, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights, decisive logits (fewer near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model.eval()


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of full (uncached) forwards and each chosen token's float32 logprob."""
    ids = list(prompt)
    lps = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(torch.argmax(logits))
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return ids[len(prompt) :], lps


PROMPTS = [
    [5 + (37 * i) % 2000 for i in range(23)],
    [900 + (11 * i) % 700 for i in range(17)],
    # shares its first 16 tokens (two blocks of 8) with the first: a prefix-cache hit
    [5 + (37 * i) % 2000 for i in range(16)] + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory, default_tokenizer_dir):
    path = tmp_path_factory.mktemp(request.param)
    model = _save(path, CONFIGS[request.param](), default_tokenizer_dir)
    ref = [_hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return path, ref


def _run(path, **kw) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model=str(path), dtype="float32", seed=0, **kw)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
        res = []
        for o in outs:
            assert o.outcome == "finished", (o.outcome, o.error)
            c = o.outputs[0]
            res.append(
                (
                    list(c.token_ids),
                    [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                )
            )
        return res
    finally:
        llm.shutdown()


def _check(got, ref):
    for (toks, lps), (rtoks, rlps) in zip(got, ref):
        assert toks == rtoks
        assert max(abs(a - b) for a, b in zip(lps, rlps)) < 1e-4


def test_default_settings_match_transformers(family):
    path, ref = family
    _check(_run(path), ref)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_cache_chunked_prefix_cached_preempted_matches_transformers(family, mode):
    path, ref = family
    got = _run(
        path,
        block_size=8,
        num_gpu_blocks=12,  # under the three sequences' 3 * 6 blocks: preemptions
        num_cpu_blocks=16,
        enable_chunked_prefill=True,
        max_num_batched_tokens=10,
        enable_prefix_caching=True,
        preemption_mode=mode,
        max_model_len=64,
        watermark=0.0,
    )
    _check(got, ref)
