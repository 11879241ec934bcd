"""Checks shared by the model-family tests: a tiny random checkpoint of a family with the
default tokenizer, run through ``kvserve.LLM`` and compared with transformers' greedy tokens and
log-probabilities."""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams

#: The default tokenizer's vocabulary (every family test model uses it).
VOCAB = 49152

#: Engine settings of the checks: roomy defaults, and a cache so small that requests are
#: chunked, share prefix blocks and get preempted (by recompute or by swap).
ENGINE_SETTINGS = {
    "default": {},
    "tiny-recompute": dict(
        block_size=4,
        num_gpu_blocks=14,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        preemption_mode="recompute",
        watermark=0.0,
    ),
    "tiny-swap": dict(
        block_size=4,
        num_gpu_blocks=14,
        num_cpu_blocks=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        preemption_mode="swap",
        watermark=0.0,
    ),
}


def save_family(path, config, tokenizer_dir, seed: int = 0):
    """A random-weight transformers model of ``config`` saved (safetensors, float32) with the
    default tokenizer into ``path``; returns it (float32, eval). Norm weights are randomised
    (so their loading is tested) and the LM head scaled (decisive greedy choices, few near-ties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (one sequence, with its KV cache) and the
    log-probability of each chosen token (log_softmax of its float32 logits).

    Step by step with the model's own cache (one forward for the prompt, one per new token):
    ``generate`` itself drops a Phi-3 cache when the sequence first grows past
    ``original_max_position_embeddings`` and recomputes every key with the long LongRoPE
    factors, which a paged cache does not (``RotaryEmbedding``'s doc)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids, tokens, lps = torch.tensor([prompt]), [], []
        for _ in range(max_tokens):
            pos = torch.arange(len(prompt) + len(tokens) - ids.shape[1], len(prompt) + len(tokens))[None]
            logits = model(ids, cache=cache, use_cache=True, position_ids=pos).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            lps.append(torch.log_softmax(logits, -1)[tok].item())
            ids = torch.tensor([[tok]])
    return tokens, lps


def hf_generate(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """``hf_greedy`` through transformers' ``generate``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, lps


def prompts_of(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """``n`` prompts of token ids (lengths cycled from ``lengths``); the second of every pair
    repeats the first's first 8 tokens, so prefix caching has blocks to share."""
    g = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
        if i % 2 and len(out[-1]) >= 8 and len(ids) >= 8:
            ids[:8] = out[-1][:8]
        out.append(ids)
    return out


def check_against_hf(
    model_dir, hf, prompts: list[list[int]], max_tokens: int, settings: dict, atol: float = 1e-4, **llm_kw
) -> dict:
    """``LLM(model_dir, **settings)`` generates each prompt's greedy tokens exactly as transformers
    does, with each token's log-probability within ``atol`` of transformers'; all KV blocks are
    free after. Returns the engine's ``get_kv_cache_stats()`` (``num_preemptions``, prefix-cache
    hits) taken after the run."""
    expect = [hf_greedy(hf, p, max_tokens) for p in prompts]
    llm = LLM(model=str(model_dir), seed=0, **settings, **llm_kw)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
        for (tokens, lps), out in zip(expect, outs):
            c = out.outputs[0]
            assert list(c.token_ids) == tokens, (list(c.token_ids), tokens)
            assert c.logprobs is not None
            got = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
            err = max(abs(a - b) for a, b in zip(got, lps))
            assert err < atol, (err, got, lps)
        stats = llm.llm_engine.get_kv_cache_stats()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
        return stats
    finally:
        llm.shutdown()
