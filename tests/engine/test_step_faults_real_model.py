"""Fault injection on the real executor (tiny random Llama): one request whose forward or
sampling raises ends ``failed``; the others' tokens equal a run without it, token for token
(greedy, seeded random, n > 1), every block comes back, and the engine keeps serving."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

POISON = 4242  # a prompt holding this token id makes the patched model or sampler raise


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=64)


class PoisonedModel:
    """The runner's model, raising for any batch that feeds the POISON token."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("poisoned forward")
        return self._model(input_ids, *args, **kwargs)


def poisoned_sampler(real):
    """Samples first (a seeded request's generator is advanced), then raises when a row's
    sequence holds the POISON token."""

    def sample(logits, metadata):
        out = real(logits, metadata)
        for md in metadata:
            if md.do_sample and any(POISON in d.prompt_token_ids for d in md.seq_data.values()):
                raise RuntimeError("poisoned sampler")
        return out

    return sample


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 41)), [50, 51]]
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=9, ignore_eos=True),
]
BAD = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _assert_idle(llm):
    eng = llm.llm_engine
    st = eng.get_kv_cache_stats()
    assert not eng.has_unfinished_requests()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
    assert st["num_free_cpu_blocks"] == st["num_cpu_blocks"]
    eng.scheduler.block_manager.check_invariants()


@pytest.mark.parametrize("where", ["model", "sampler"])
@pytest.mark.parametrize("bad_prompt", [[POISON, 3, 4], list(range(60, 80)) + [POISON]])
def test_one_poisoned_request_leaves_the_others_token_for_token(llm, monkeypatch, where, bad_prompt):
    clean = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    runner = llm.llm_engine.executor.runner
    if where == "model":
        monkeypatch.setattr(runner, "model", PoisonedModel(runner.model))
    else:
        monkeypatch.setattr(runner, "sampler", poisoned_sampler(runner.sampler))
    prompts = PROMPTS[:2] + [bad_prompt] + PROMPTS[2:]
    params = PARAMS[:2] + [BAD] + PARAMS[2:]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs.pop(2)
    assert bad.outcome == "failed"
    assert bad.outputs[0].finish_reason == "error"
    assert bad.request_id in bad.error and "poisoned" in bad.error
    assert [o.outcome for o in outs] == ["finished"] * 4
    assert _tokens(outs) == clean
    _assert_idle(llm)
    monkeypatch.undo()
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == clean


def test_params_made_invalid_after_validation_are_rejected_naming_the_field(llm):
    """The issue's case with validation bypassed (a value that overflows the sampler's int64
    tensor): the request is rejected with the field named, the others are untouched."""
    eng = llm.llm_engine
    good = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    clean = _tokens(llm.generate([[5, 6, 7]], good, use_tqdm=False))
    bad = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    eng.add_request("good", [5, 6, 7], good)
    eng.add_request("bad", [8, 9], bad)
    bad.top_k = 2**63  # after validation
    final = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    assert final["bad"].outcome == "rejected"
    assert "top_k" in final["bad"].error
    assert final["good"].outcome == "finished"
    assert _tokens([final["good"]]) == clean
    _assert_idle(llm)


def test_llm_stays_usable_after_a_scheduler_fault(llm, monkeypatch):
    """A fault outside any request (the scheduler) makes generate raise, but nothing of the
    call stays queued or holds blocks, and the next generate works."""
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    clean = _tokens(llm.generate(PROMPTS, p, use_tqdm=False))
    sched = llm.llm_engine.scheduler
    real = sched.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(sched, "schedule", schedule)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        llm.generate(PROMPTS, p, use_tqdm=False)
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, p, use_tqdm=False)) == clean
    _assert_idle(llm)
