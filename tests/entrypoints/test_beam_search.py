"""``LLM.beam_search`` equals transformers' ``generate(num_beams=B, do_sample=False)`` on a
tiny random-weight Llama (same hypotheses, same order, same scores)."""

import random

import pytest
import torch

from kvserve import LLM, BeamSearchParams
from tests.golden import TEST_DEVICE

EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), device=TEST_DEVICE, dtype="float32", enable_prefix_caching=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 11, 23)]


def hf_beams(model, prompt, B, max_new, length_penalty, early_stopping, eos):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            num_beams=B,
            num_return_sequences=B,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seqs = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = row[len(prompt) :]
        if eos in gen:  # padding after EOS
            gen = gen[: gen.index(eos) + 1]
        seqs.append((gen, score))
    return seqs


@pytest.mark.parametrize(
    "B,max_new,length_penalty,early_stopping",
    [(2, 6, 1.0, False), (3, 8, 0.0, True), (4, 5, 2.0, "never"), (2, 7, -0.5, True)],
)
def test_beam_search_equals_transformers(
    llm, tiny_hf_model, prompts, B, max_new, length_penalty, early_stopping
):
    params = BeamSearchParams(
        beam_width=B, max_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        ref = hf_beams(tiny_hf_model, p, B, max_new, length_penalty, early_stopping, EOS)
        ours = [(s.output_token_ids, s.score) for s in out.sequences]
        assert [t for t, _ in ours] == [t for t, _ in ref]
        # transformers keeps beam scores in float32 and a negative length penalty multiplies
        # them by sqrt(length): compare relative to the score's size, not absolutely
        for (_, a), (_, b) in zip(ours, ref):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-4)
        for s in out.sequences:
            assert s.tokens == p + s.output_token_ids
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == EOS else "length")
    st = llm.llm_engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]


def test_beam_search_with_eos_in_the_beams(llm, tiny_hf_model, prompts):
    """EOS made likely (the top token after the first step): finished hypotheses enter the
    pool early, as in transformers."""
    p = prompts[1]
    first = llm.beam_search([{"prompt_token_ids": p}], BeamSearchParams(beam_width=2, max_tokens=1))[0]
    eos = first.sequences[1].output_token_ids[0]  # the second-best first token acts as EOS
    llm.llm_engine.eos_token_id = eos
    try:
        # length_penalty 0: raw sums, so the one-token EOS hypothesis beats the longer ones
        params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0)
        out = llm.beam_search([{"prompt_token_ids": p}], params)[0]
    finally:
        llm.llm_engine.eos_token_id = EOS
    ref = hf_beams(tiny_hf_model, p, 2, 6, 0.0, False, eos)
    assert [s.output_token_ids for s in out.sequences] == [t for t, _ in ref]
    assert any(s.finish_reason == "stop" for s in out.sequences)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=11), "beam_width"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_beam_search_params_errors_name_the_field(kw, field):
    base = dict(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{**base, **kw})


def test_beam_search_reuses_the_beams_blocks_without_prefix_caching(tiny_llama_dir, tiny_hf_model, prompts):
    """On an engine without ``enable_prefix_caching`` each step's beams still continue their
    parents' blocks (``cache_prefix``): the hypotheses equal transformers' and the tokens fed
    through the model are far fewer than re-prefilling prompt + beam for every beam each
    step, which the same search does when its requests do not reuse blocks."""
    import dataclasses

    from kvserve.entrypoints import beam_search as bs_mod

    llm = LLM(model=str(tiny_llama_dir), device=TEST_DEVICE, dtype="float32", block_size=4)
    engine = llm.llm_engine
    assert not engine.cache_config.enable_prefix_caching
    B, max_new = 3, 8
    params = BeamSearchParams(beam_width=B, max_tokens=max_new)
    lens: list[int] = []
    add = engine.add_request

    def recording(request_id, prompt, sp, *a, **kw):
        lens.append(len(prompt["prompt_token_ids"]))
        return add(request_id, prompt, sp, *a, **kw)

    engine.add_request = recording

    def run():
        lens.clear()
        before = engine.stats.num_batched_tokens
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        return outs, engine.stats.num_batched_tokens - before, list(lens)

    reused_outs, reused, reused_lens = run()
    for p, out in zip(prompts, reused_outs):
        ref = hf_beams(tiny_hf_model, p, B, max_new, 1.0, False, EOS)
        assert [s.output_token_ids for s in out.sequences] == [t for t, _ in ref]
        for s, (_, score) in zip(out.sequences, ref):
            assert s.score == pytest.approx(score, abs=1e-4)
    assert engine.get_kv_cache_stats()["prefix_cache_hits"] > 0
    # the first step prefills each prompt; every later beam request computes only what follows
    # its parent's last full block (at most block_size tokens)
    first = sum(len(p) for p in prompts)
    assert reused <= first + sum(min(n, 4) for n in reused_lens[len(prompts) :])

    engine.reset_prefix_cache()
    orig = bs_mod.BeamSearch.sampling_params
    bs_mod.BeamSearch.sampling_params = lambda self: dataclasses.replace(orig(self), cache_prefix=False)
    try:
        plain_outs, plain, plain_lens = run()
    finally:
        bs_mod.BeamSearch.sampling_params = orig
    assert plain_lens == reused_lens
    assert plain == sum(plain_lens)  # every beam's prompt + tokens prefilled again
    assert reused * 3 < plain
    for a, b in zip(reused_outs, plain_outs):
        # same hypotheses; scores agree to float32 rounding (a cached context is attended to
        # from the cache instead of within one prefill chunk)
        assert [s.output_token_ids for s in a.sequences] == [s.output_token_ids for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-5)
    st = engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
