"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' log-softmax over the
prompt positions on a tiny random-weight Llama: plain, chunked prefill, with a prefix-cache hit,
under recompute preemption, with n > 1, and at one token per chunk."""

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sequence import Logprob
from tests.engine.test_e2e_tiny import assert_idle, run_engine
from tests.golden import TEST_DEVICE

ENGINE = dict(device=TEST_DEVICE, dtype="float32")
K = 3
ATOL = 1e-4  # float32: different summation orders between the two implementations


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    ps = [[rng.randrange(3, 49152) for _ in range(n)] for n in (2, 9, 30, 45)]
    ps.append(ps[3][:32] + [rng.randrange(3, 49152) for _ in range(7)])  # shares 32 tokens
    return ps


@pytest.fixture(scope="module")
def hf_logprobs(tiny_hf_model, prompts):
    """Per prompt: float32 ``[len - 1, V]`` log-softmax of position i, scoring token i + 1."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            logits = tiny_hf_model(torch.tensor([p], device=tiny_hf_model.device)).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1)[:-1].cpu())
    return out


def check(prompt_logprobs, prompt, ref, k=K, tokenizer=None):
    """``prompt_logprobs`` (kvserve's) against ``ref`` (transformers' log-softmax rows); each
    entry's ``decoded_token`` against ``tokenizer`` when given."""
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = prompt_logprobs[i], ref[i - 1], prompt[i]
        check_entry(entry, row, tok, k, tokenizer)


def check_entry(entry, row, tok, k, tokenizer=None):
    """One position's ``{token_id: Logprob}`` against ``row`` (transformers' log-softmax) for
    the token ``tok`` that followed: its logprob and rank, the top ``k``, decoded texts."""
    assert tok in entry and isinstance(entry[tok], Logprob), entry
    assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=ATOL)
    # rank: 1 + tokens more likely (tokens within ATOL of it may fall either side)
    lo = int((row > row[tok] + ATOL).sum()) + 1
    hi = int((row > row[tok] - ATOL).sum()) + 1
    assert lo <= entry[tok].rank <= hi, (entry[tok], lo, hi)
    assert len(entry) in (k, k + 1)
    top = {t: lp for t, lp in entry.items() if len(entry) == k or t != tok}
    assert sorted(lp.rank for lp in top.values()) == list(range(1, k + 1))
    ref_top = row.topk(k).values.tolist() if k else []
    for t, lp in top.items():
        # the value at each rank, and the token really has it (a near-tie may swap tokens)
        assert lp.logprob == pytest.approx(ref_top[lp.rank - 1], abs=ATOL)
        assert float(row[t]) == pytest.approx(lp.logprob, abs=ATOL)
    if tokenizer is not None:
        assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items()), entry


CONFIGS = {
    "default": dict(),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "prefix": dict(enable_prefix_caching=True, block_size=8),
    "chunked_prefix_recompute": dict(
        block_size=4,
        num_gpu_blocks=20,
        num_cpu_blocks=64,
        preemption_mode="recompute",
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    ),
}


def test_output_logprobs_are_logprob_objects_equal_to_transformers(tiny_llama_dir, tiny_hf_model, prompts):
    """Each generated token's ``{token_id: Logprob}``: logprob, rank and decoded text of the
    sampled token and the top K, against transformers' log-softmax over prompt + output."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:3]], params, use_tqdm=False)
    for p, out in zip(prompts[1:3], outs):
        c = out.outputs[0]
        ids = p + c.token_ids
        with torch.inference_mode():
            logits = tiny_hf_model(torch.tensor([ids], device=tiny_hf_model.device)).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1).cpu()
        assert len(c.logprobs) == len(c.token_ids) == 6
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(entry, ref[len(p) - 1 + j], tok, K, llm.get_tokenizer())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, prompts, hf_logprobs, name):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, **CONFIGS[name])
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    finals = run_engine(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        out = finals[f"r{i}"]
        assert out.outcome == "finished"
        check(out.prompt_logprobs, p, hf_logprobs[i], tokenizer=llm.get_tokenizer())
    if name == "chunked_prefix_recompute":
        # a recompute preemption mid-way; the re-admission reuses the cached blocks of the
        # positions whose logprobs it already holds
        stats = engine.get_kv_cache_stats()
        assert stats["num_recompute_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats


def test_prompt_logprobs_with_a_prefix_cache_hit(tiny_llama_dir, prompts, hf_logprobs):
    """The second run of a prompt hits the prefix cache for a request without prompt logprobs;
    a request asking for them still gets every position (computed, not a short list)."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, enable_prefix_caching=True, block_size=4)
    engine = llm.llm_engine
    p = prompts[3]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    run_engine(engine, [("warm", p, plain)])
    run_engine(engine, [("hit", p, plain)])
    assert engine.get_kv_cache_stats()["prefix_cache_hits"] > 0
    hits_before = engine.get_kv_cache_stats()["prefix_cache_hits"]
    finals = run_engine(engine, [("pl", p, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K))])
    assert finals["pl"].num_cached_tokens == 0
    assert engine.get_kv_cache_stats()["prefix_cache_hits"] == hits_before
    check(finals["pl"].prompt_logprobs, p, hf_logprobs[3])
    # and its blocks were cached for the next plain request
    finals = run_engine(engine, [("after", p, plain)])
    assert finals["after"].num_cached_tokens > 0


def test_prompt_logprobs_one_token_chunks(tiny_llama_dir, prompts, hf_logprobs):
    """One-token chunks go down the decode path of the runner."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=1)
    engine = llm.llm_engine
    p = prompts[1]
    finals = run_engine(engine, [("r", p, SamplingParams(max_tokens=2, prompt_logprobs=0))])
    check(finals["r"].prompt_logprobs, p, hf_logprobs[1], k=0)
    assert all(len(e) == 1 for e in finals["r"].prompt_logprobs[1:])


def test_prompt_logprobs_with_n_score_the_prompt_once(tiny_llama_dir, prompts, hf_logprobs):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    engine = llm.llm_engine
    p = prompts[2]
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=0, prompt_logprobs=K)
    finals = run_engine(engine, [("r", p, params)])
    assert len(finals["r"].outputs) == 3
    check(finals["r"].prompt_logprobs, p, hf_logprobs[2])
    assert_idle(engine)


def test_prompt_logprobs_absent_unless_asked(tiny_llama_dir, prompts):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.0, "3"])
def test_prompt_logprobs_out_of_range_names_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_in_row_slices_equal_transformers(tiny_llama_dir, prompts, hf_logprobs, monkeypatch):
    """The runner sends prompt-logprob rows through the LM head a slice at a time (bounded
    memory): with 7-row slices, which cut the step's prompts mid-way, every position still
    equals transformers', and no slice holds more than 7 rows."""
    from kvserve.model_executor import sampler
    from kvserve.worker import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 7)
    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", 3)
    slices = []
    real = model_runner.prompt_logprobs

    def recording(logits, targets, ks):
        slices.append(logits.shape[0])
        return real(logits, targets, ks)

    monkeypatch.setattr(model_runner, "prompt_logprobs", recording)
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    finals = run_engine(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        check(finals[f"r{i}"].prompt_logprobs, p, hf_logprobs[i], k=K)
    # every prompt position that scores a next token went through exactly one slice
    assert sum(slices) == sum(len(p) - 1 for p in prompts)
    assert max(slices) == 7 and len(slices) > len(prompts)
    assert_idle(engine)


@pytest.mark.parametrize("native", [True, False])
def test_prompt_logprobs_function_slices_match_one_pass(monkeypatch, native):
    """``sampler.prompt_logprobs`` in slices of 5 rows equals a whole-matrix log-softmax
    reference (values, ranks and top-k ids) on random logits with ties, with the native
    kernel and with torch."""
    from kvserve.model_executor import sampler
    from kvserve.ops import elementwise

    if native and not elementwise.available():
        pytest.skip(f"native kernels unavailable: {elementwise.failure_reason()}")
    if not native:
        monkeypatch.setattr(elementwise, "supported", lambda *t: False)

    g = torch.Generator().manual_seed(0)
    Q, V = 23, 301
    logits = torch.randn(Q, V, generator=g) * 4
    logits[:, 7] = logits[:, 11]  # a tie in every row
    targets = torch.randint(0, V, (Q,), generator=g)
    ks = [int(x) for x in torch.randint(0, 6, (Q,), generator=g)]
    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", 5)
    got = sampler.prompt_logprobs(logits, targets, ks)
    logp = torch.log_softmax(logits, dim=-1)
    assert len(got) == Q
    for i in range(Q):
        t = int(targets[i])
        assert got[i][t].logprob == pytest.approx(float(logp[i, t]), abs=1e-5)
        assert got[i][t].rank == int((logits[i] > logits[i, t]).sum()) + 1
        top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in got[i].items() if lp.rank <= ks[i]))
        ref_vals = logp[i].topk(ks[i]).values.tolist() if ks[i] else []
        assert [r for r, _, _ in top] == list(range(1, ks[i] + 1))
        for (_, tid, v), ref in zip(top, ref_vals):
            assert v == pytest.approx(ref, abs=1e-5) and float(logp[i, tid]) == pytest.approx(v, abs=1e-5)


def test_native_prompt_logprob_stats_edges():
    """The kernel on a vocabulary that is not a multiple of 16, NaN and -inf logits, ties,
    k = 0 and k = V, against torch on the same rows (NaN read as -inf)."""
    from kvserve.ops import elementwise

    if not elementwise.available():
        pytest.skip(f"native kernels unavailable: {elementwise.failure_reason()}")
    g = torch.Generator().manual_seed(1)
    V = 37
    x = torch.randn(4, V, generator=g)
    x[0, 3] = float("nan")
    x[1, :] = float("-inf")
    x[1, 30] = 2.5
    x[2, 5] = x[2, 36] = x[2].max() + 1  # a tie at the top, one of them in the tail
    targets = torch.tensor([1, 30, 36, 0])
    ref = torch.nan_to_num(x, nan=float("-inf"))
    for k in (0, 4, V - 1):
        lse, rank, vals, ids = elementwise.prompt_logprob_stats(x, targets, k)
        assert lse.tolist() == pytest.approx(ref.logsumexp(-1).tolist(), abs=1e-5)
        expect_rank = (ref > ref.gather(1, targets[:, None])).sum(1) + 1
        assert rank.tolist() == expect_rank.tolist()
        assert vals.shape == (4, k) and ids.shape == (4, k)
        if k:
            finite = ref[[0, 2, 3]]
            assert vals[[0, 2, 3]].tolist() == finite.topk(k).values.tolist()
            assert torch.equal(ref.gather(1, ids)[[0, 2, 3]], vals[[0, 2, 3]])
            assert vals[1, 0] == 2.5 and ids[1, 0] == 30  # the only finite logit of row 1
    _, _, _, ids = elementwise.prompt_logprob_stats(x, targets, 2)
    assert ids[2].tolist() == [5, 36]  # a tie: the lower id first
    with pytest.raises(ValueError, match="targets"):
        elementwise.prompt_logprob_stats(x, torch.tensor([0, 1, 2, V]), 2)
