"""vLLM's request fields ``bad_words``, ``allowed_token_ids``, ``truncate_prompt_tokens``,
``detokenize``, ``output_kind`` and ``best_of`` (sampling), each applied, measured against a
reference: transformers' logits on the same weights with the field's rule applied by hand."""

import pytest
import torch

from kvserve import LLM, RequestOutputKind, SamplingParams
from kvserve.engine.input_processor import bad_words_token_ids

ENGINE = dict(block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=64, max_num_seqs=8, seed=0)
PROMPT = [1, 504, 3458, 314, 4476, 10, 1204, 77]
MAX_NEW = 10


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


def _idle(llm):
    eng = llm.llm_engine
    st = eng.get_kv_cache_stats()
    assert not eng.has_unfinished_requests()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]


@torch.no_grad()
def hf_greedy(model, prompt, max_new, mask_fn=None):
    """Greedy tokens from transformers' logits, ``mask_fn(logits [V], output so far)`` applied
    before each argmax (it returns the masked logits)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if mask_fn is not None:
            logits = mask_fn(logits, out)
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
    return out


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **kw)


def test_allowed_token_ids_greedy_is_argmax_over_the_allowed_subset(llm, tiny_hf_model):
    plain = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW)
    g = torch.Generator().manual_seed(1)
    allowed = sorted(set(torch.randint(3, 49152, (40,), generator=g).tolist()) - set(plain))
    keep = torch.zeros(49152, dtype=torch.bool)
    keep[allowed] = True
    ref = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW, lambda x, _: x.masked_fill(~keep, float("-inf")))
    out = llm.generate([PROMPT], _greedy(allowed_token_ids=allowed, logprobs=1), use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    assert toks == ref
    assert set(toks) <= set(allowed) and not set(toks) & set(plain)
    # logprobs are of the masked distribution: the allowed tokens share all the mass
    first = out.outputs[0].logprobs[0]
    logits = tiny_hf_model(torch.tensor([PROMPT])).logits[0, -1].float().detach()
    want = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)[toks[0]].item()
    assert first[toks[0]].logprob == pytest.approx(want, abs=1e-3)
    _idle(llm)


def test_allowed_token_ids_outside_the_vocab_is_a_value_error(llm):
    with pytest.raises(ValueError, match=r"^allowed_token_ids must be token ids in \[0, 49152\)"):
        llm.generate([PROMPT], _greedy(allowed_token_ids=[5, 49152]), use_tqdm=False)
    _idle(llm)


def test_bad_words_token_sequences_with_and_without_a_leading_space(llm):
    tok = llm.get_tokenizer()
    seqs = bad_words_token_ids(["hello world"], tok, 49152)
    assert tok("hello world", add_special_tokens=False).input_ids in seqs
    assert tok(" hello world", add_special_tokens=False).input_ids in seqs
    with pytest.raises(ValueError, match="^bad_words tokenize to ids outside"):
        bad_words_token_ids(["hello"], tok, 10)


def test_bad_words_mask_the_last_token_where_the_output_ends_with_the_rest(llm, tiny_hf_model):
    tok = llm.get_tokenizer()
    plain = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW)
    # a one-token word (the 2nd greedy token) and a two-token word (the 4th and 5th greedy tokens)
    words = [tok.decode([plain[1]]), tok.decode(plain[3:5])]
    seqs = bad_words_token_ids(words, tok, 49152)
    assert any(len(s) == 1 for s in seqs) and any(len(s) > 1 for s in seqs)

    def mask(x, out):
        x = x.clone()
        for s in seqs:
            if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1 :] == s[:-1]):
                x[s[-1]] = float("-inf")
        return x

    ref = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW, mask)
    assert ref != plain
    out = llm.generate([PROMPT], _greedy(bad_words=words), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref
    for s in seqs:  # no banned sequence occurs in the output
        assert all(out.token_ids[i : i + len(s)] != s for i in range(len(out.token_ids)))
    _idle(llm)


def test_truncate_prompt_tokens_keeps_the_last_k(llm, tiny_hf_model):
    long_prompt = list(range(100, 160))  # 60 tokens: with 10 new ones past max_model_len 64
    out = llm.generate([long_prompt], _greedy(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-6:]
    assert out.outputs[0].token_ids == hf_greedy(tiny_hf_model, long_prompt[-6:], MAX_NEW)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be -1 or an integer in \[1, 64\]"):
        llm.generate([long_prompt], _greedy(truncate_prompt_tokens=65), use_tqdm=False)
    # -1: the last max_model_len tokens, which leave no room to generate
    with pytest.raises(ValueError, match="^prompt has 64 tokens"):
        llm.generate([list(range(100, 200))], _greedy(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)
    _idle(llm)


def test_detokenize_false_returns_the_same_tokens_and_no_text(llm):
    on = llm.generate([PROMPT], _greedy(logprobs=1), use_tqdm=False)[0].outputs[0]
    off = llm.generate([PROMPT], _greedy(logprobs=1, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert on.text and off.text == ""
    assert off.token_ids == on.token_ids
    assert all(lp.decoded_token is None for entry in off.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="^stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    _idle(llm)


def _run(engine, params, rid):
    engine.add_request(rid, {"prompt_token_ids": PROMPT}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def test_output_kind_delta_and_final_only(llm):
    engine = llm.llm_engine
    kw = dict(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)
    cumulative = _run(engine, SamplingParams(**kw), "cum")
    delta = _run(engine, SamplingParams(output_kind=RequestOutputKind.DELTA, **kw), "delta")
    final = _run(engine, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kw), "final")
    whole = cumulative[-1].outputs[0]
    assert len(cumulative) == len(delta) == MAX_NEW
    # each delta output carries exactly the step's new token (and its logprob entry)
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in whole.token_ids]
    assert [len(o.outputs[0].logprobs) for o in delta] == [1] * MAX_NEW
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == whole.token_ids and final[0].outputs[0].text == whole.text
    # LLM.generate returns whole completions whatever the kind
    got = llm.generate([PROMPT], SamplingParams(output_kind=RequestOutputKind.DELTA, **kw), use_tqdm=False)
    assert got[0].outputs[0].token_ids == whole.token_ids
    _idle(llm)


@torch.no_grad()
def _hf_cumulative_logprob(model, prompt, output):
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(output).unsqueeze(1)).sum().item()


def test_best_of_returns_the_n_most_likely_of_best_of_samples(llm, tiny_hf_model):
    kw = dict(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    every = llm.generate([PROMPT], SamplingParams(n=5, **kw), use_tqdm=False)[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, **kw), use_tqdm=False)[0].outputs
    assert len(best) == 2 and [c.index for c in best] == [0, 1]
    # the same seed draws the same 5 samples; the 2 returned are the 2 most likely of them
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) > 2
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    for c in best:  # their cumulative logprobs are the model's
        assert c.cumulative_logprob == pytest.approx(
            _hf_cumulative_logprob(tiny_hf_model, PROMPT, c.token_ids), abs=1e-2
        )
    with pytest.raises(ValueError, match=r"^best_of must be >= n \(3\)"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"^best_of must be <= max_num_seqs \(8\), got 9"):
        llm.generate([PROMPT], SamplingParams(n=1, best_of=9, **kw), use_tqdm=False)
    _idle(llm)


@pytest.mark.parametrize("keys", [{"5": 1.0, "05": 2.0}, {5: 1.0, "5": 2.0}])
def test_logit_bias_naming_a_token_twice_is_a_value_error(keys):
    with pytest.raises(ValueError, match=r"^logit_bias names token 5 twice"):
        SamplingParams(logit_bias=keys)


def test_masks_that_leave_no_token_fail_that_request_only(llm, tiny_hf_model):
    tok = llm.get_tokenizer()
    word = tok.decode([1000])
    assert [1000] in bad_words_token_ids([word], tok, 49152)
    bad = SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=[1000], bad_words=[word])
    outs = llm.generate([PROMPT, PROMPT], [bad, _greedy()], use_tqdm=False)
    assert outs[0].outcome == "failed" and "leave no token to sample" in outs[0].error
    assert outs[1].outcome == "finished"
    assert outs[1].outputs[0].token_ids == hf_greedy(tiny_hf_model, PROMPT, MAX_NEW)
    _idle(llm)


def test_best_of_above_n_with_greedy_decoding_is_refused():
    """Greedy samples are identical: best_of > n would choose among copies (vLLM refuses it too)."""
    with pytest.raises(ValueError, match=r"best_of \(3\) > n \(2\) needs sampling"):
        SamplingParams(n=2, best_of=3, temperature=0)
    assert SamplingParams(n=2, best_of=2, temperature=0).best_of == 2
