"""Faults at TP=2: a request whose sampling raises on the driver ends ``failed`` and the others
are token for token as without it; a fault inside the driver's forward (its peers left waiting
in an all-reduce) ends in a bounded time with a clear error, never a hang."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.test_step_faults_real_model import POISON, PoisonedModel, poisoned_sampler
from tests.golden import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU")

ENGINE = dict(block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=64, tensor_parallel_size=2)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 41))]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=9, ignore_eos=True),
]
BAD = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2_llm(tiny_llama_dir):
    """One TP=2 engine for the module (a start costs ~10 s on 2 cores): the poisoned-sampling
    test leaves it serving (it checks that), the forward-fault test, last, breaks and stops it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_NUM_THREADS", "1")  # two ranks on 2 cores: one OpenMP thread each
        llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_tp2_poisoned_sampling_fails_only_that_request(tp2_llm, monkeypatch):
    llm = tp2_llm
    clean = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    runner = llm.llm_engine.executor.runner
    monkeypatch.setattr(runner, "sampler", poisoned_sampler(runner.sampler))
    outs = llm.generate(
        PROMPTS[:1] + [[POISON, 3, 4]] + PROMPTS[1:], PARAMS[:1] + [BAD] + PARAMS[1:], use_tqdm=False
    )
    bad = outs.pop(1)
    assert bad.outcome == "failed" and "poisoned" in (bad.error or "")
    assert [o.outcome for o in outs] == ["finished"] * 3
    assert _tokens(outs) == clean
    st = llm.llm_engine.get_kv_cache_stats()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
    monkeypatch.undo()
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == clean


def test_tp2_fault_inside_the_drivers_forward_is_bounded_and_clear(tp2_llm, monkeypatch):
    from kvserve.worker import tp_executor, worker

    monkeypatch.setattr(worker, "PEER_SETTLE_S", 2.0)  # keep the test short: the bound, not its size
    monkeypatch.setattr(tp_executor, "STOP_GRACE_S", 1.0)
    llm = tp2_llm
    procs = list(llm.llm_engine.executor.peers._procs)
    try:
        runner = llm.llm_engine.executor.runner
        monkeypatch.setattr(runner, "model", PoisonedModel(runner.model))
        t = time.monotonic()
        outs = llm.generate([[POISON, 3, 4]] + PROMPTS[:2], [BAD] + PARAMS[:2], use_tqdm=False)
        assert time.monotonic() - t < 60  # a hang waits out the 120 s collective timeout
        assert all(o.outcome == "failed" for o in outs)
        assert any("out of step" in (o.error or "") for o in outs)
        st = llm.llm_engine.get_kv_cache_stats()
        assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
        # later requests fail at once with the same cause
        again = llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)[0]
        assert again.outcome == "failed" and "restart the engine" in (again.error or "")
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in procs)
