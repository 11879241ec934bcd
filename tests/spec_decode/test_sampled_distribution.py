"""Sampling through speculation keeps the target's distribution, end to end: on a tiny model
with a 16-token vocabulary, the 2nd and 3rd sampled tokens of many seeded requests (the first
ones that go through verification) follow the exact marginals transformers computes, with an
unrelated random draft model (rejection sampling with draft probabilities), with n-gram lookup
(a point mass), and without speculation (which checks the test itself). Chi-square goodness of
fit at significance 1e-4 (seeded, so repeatable)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams

V = 16
N = 3000
PROMPT = [3, 5, 3, 5, 3]  # repetitive, so prompt lookup proposes


def _save(path, seed, tokenizer_dir, scale):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # the target peaked but not degenerate; the draft more peaked, on other tokens
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_tokenizer_dir):
    target_dir, draft_dir = tmp_path_factory.mktemp("v16-target"), tmp_path_factory.mktemp("v16-draft")
    target = _save(target_dir, 0, default_tokenizer_dir, 4.0)
    _save(draft_dir, 1, default_tokenizer_dir, 10.0)
    return target_dir, draft_dir, target


def _marginals(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact P(token 2) and P(token 3) after PROMPT (float64 [V] each)."""
    with torch.no_grad():
        p1 = model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)  # [V]
        x = torch.tensor([PROMPT + [a] for a in range(V)])
        p2 = model(x).logits[:, -1].double().softmax(-1)  # [V(t1), V(t2)]
        x = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = model(x).logits[:, -1].double().softmax(-1).view(V, V, V)  # [t1, t2, t3]
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - the regularised lower gamma P(df/2, x/2) (series)."""
    a, z = df / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-16 * total and n < 10_000:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))


def _p_value(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs * len(tokens)
    small = expected < 5  # pool the rare tokens into one cell
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


@pytest.mark.parametrize("method", ["off", "draft_model", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(models, method):
    target_dir, draft_dir, target = models
    spec = None
    if method == "draft_model":
        spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    elif method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        }
    if spec:
        spec["disable_below_acceptance_rate"] = 0.0
        spec["dynamic"] = False  # every step drafts: acceptance must be exercised
    llm = LLM(
        model=str(target_dir), device="cpu", dtype="float32", speculative_config=spec, num_gpu_blocks=4096
    )
    # 5 tokens: the first decode verifies 3 drafts, so tokens 2 and 3 go through acceptance,
    # the residual and the bonus
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=i, ignore_eos=True) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 5 for t in toks)
    m2, m3 = _marginals(target)
    p2, p3 = _p_value([t[1] for t in toks], m2), _p_value([t[2] for t in toks], m3)
    s = llm.llm_engine.stats
    print(
        f"{method}: p-values {p2:.3g} {p3:.3g}; drafts {s.spec_num_draft_tokens} accepted {s.spec_num_accepted_tokens}"
    )
    assert p2 > 1e-4 and p3 > 1e-4, (p2, p3)
    if method == "draft_model":
        assert s.spec_num_draft_tokens >= 3 * N  # every request verified 3 drafts at least once
    if spec:
        assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
