"""The embedded default model (SmolLM2-135M-Instruct): greedy equals transformers, chat works,
and stop strings that are not on token boundaries (B19)."""

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.test_e2e_tiny import assert_idle
from tests.golden import compare, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colours are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(kv_cache_memory_gib=0.25)


def test_default_model_greedy_equals_transformers(llm, default_hf_model):
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    near = sum(compare(o.outputs[0].token_ids, hf_greedy(default_hf_model, i, 32)) for o, i in zip(outs, ids))
    print(f"near-ties: {near} of {len(PROMPTS)}")
    assert outs[0].outputs[0].text.strip() != ""
    assert_idle(llm.llm_engine)


def test_chat_and_n_samples(llm):
    outs = llm.chat(
        [[{"role": "user", "content": "Name three colours."}]],
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24),
    )
    assert len(outs[0].outputs) == 2
    assert all(c.text for c in outs[0].outputs)
    again = llm.chat(
        [[{"role": "user", "content": "Name three colours."}]],
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24),
    )
    assert [c.text for c in again[0].outputs] == [c.text for c in outs[0].outputs]


def _greedy_run(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, **kw), use_tqdm=False)[
        0
    ].outputs[0]


@pytest.fixture(scope="module")
def b19_case(llm):
    """A prompt whose greedy output contains a whole-word token of >= 5 characters."""
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    base = _greedy_run(llm, prompt)
    pieces = [tok.decode([t]) for t in base.token_ids]
    idx = next(
        i for i, p in enumerate(pieces) if len(p.strip()) >= 5 and p.strip().isalpha() and i + 1 < len(pieces)
    )
    return prompt, base, pieces, idx


def test_B19_stop_string_inside_a_single_token(llm, b19_case):
    prompt, base, pieces, idx = b19_case
    word = pieces[idx]
    stop = word.strip()[:-1]  # e.g. "Pari" of " Paris"
    text_before = "".join(pieces[:idx])
    expect_cut = base.text.index(stop, len(text_before))
    out = _greedy_run(llm, prompt, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:expect_cut]
    assert len(out.token_ids) == idx + 1  # stopped at the first step whose text contains it
    inc = _greedy_run(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert inc.text == base.text[: expect_cut + len(stop)]
    assert_idle(llm.llm_engine)


def test_B19_stop_string_spanning_two_tokens(llm, b19_case):
    prompt, base, pieces, idx = b19_case
    stop = pieces[idx][-2:] + pieces[idx + 1][:2]
    out = _greedy_run(llm, prompt, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(stop)]


def test_B19_streaming_never_leaks_stop_characters(llm, b19_case):
    prompt, base, pieces, idx = b19_case
    stop = pieces[idx].strip()[:-1]
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    final = seen[-1]
    for partial in seen:
        assert final.startswith(partial), "streamed text must only grow"
        assert stop not in partial
    assert final == base.text[: base.text.index(stop)]
    assert_idle(engine)
