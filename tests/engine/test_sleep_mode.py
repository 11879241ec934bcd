"""Sleep mode: ``LLM.sleep(level)`` frees the KV cache (level 1: the weights stay in host
memory; level 2: they are dropped and read from the checkpoint at ``wake_up``); requests are
refused while asleep, sleeping with requests in flight is refused, and after ``wake_up`` the
prefix cache is empty and greedy outputs equal those before the sleep."""

import gc
import weakref

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import EngineSleepingError

PROMPTS = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (9, 17, 30)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_gpu_blocks=48,
        block_size=4,
        enable_prefix_caching=True,
        enable_sleep_mode=True,
    )
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_outputs_after_wake_up_equal_those_before_and_the_prefix_cache_is_empty(llm, level):
    before = _tokens(llm)
    engine = llm.llm_engine
    assert engine.get_kv_cache_stats()["num_cached_gpu_blocks"] > 0
    worker = engine.executor
    model = weakref.ref(worker.model)
    llm.sleep(level)
    assert llm.is_sleeping() and worker.cache_engine is None
    if level == 2:
        gc.collect()
        assert worker.model is None and model() is None, "level 2 kept the weights"
    else:
        assert worker.model is model()  # on CPU the weights stay where they are
    with pytest.raises(EngineSleepingError, match=rf"asleep \(sleep mode, level {level}"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert engine.get_num_unfinished_requests() == 0
    llm.wake_up()
    assert not llm.is_sleeping()
    stats = engine.get_kv_cache_stats()
    assert stats["num_cached_gpu_blocks"] == 0 and stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert worker.cache_engine is not None and not worker.cache_engine.device_cache.any()
    if level == 2:
        assert worker.model is not None and worker.model is not model()
    assert _tokens(llm) == before


def test_wake_up_by_tags_takes_requests_once_both_are_back(llm):
    before = _tokens(llm)
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and llm.llm_engine.asleep == {"kv_cache"}
    with pytest.raises(EngineSleepingError, match="kv_cache put away"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    llm.wake_up()  # awake: a no-op
    assert _tokens(llm) == before


def test_bad_levels_tags_and_a_second_sleep_are_refused(llm):
    for level in (0, 3, True):
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            llm.sleep(level)
    with pytest.raises(ValueError, match=r"wake_up tags must be among \['weights', 'kv_cache'\]"):
        llm.wake_up(["optimizer"])
    llm.sleep(1)
    try:
        with pytest.raises(ValueError, match=r"asleep already \(level 1\)"):
            llm.sleep(2)
    finally:
        llm.wake_up()


def test_sleep_with_a_request_in_flight_is_refused(llm):
    engine = llm.llm_engine
    engine.add_request("in-flight", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=r"1 request\(s\) in flight"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(1)
    llm.wake_up()


def test_sleep_mode_off_refuses_sleep(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks=16, block_size=4)
    try:
        with pytest.raises(ValueError, match=r"sleep mode is off: .*enable_sleep_mode=True"):
            llm.sleep(1)
        with pytest.raises(ValueError, match="sleep mode is off"):
            llm.wake_up()
    finally:
        llm.shutdown()


def test_sleep_mode_with_speculation_or_data_parallelism_is_refused():
    from kvserve.config import EngineArgs

    with pytest.raises(ValueError, match="enable_sleep_mode is not supported with speculative_config"):
        EngineArgs(
            enable_sleep_mode=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="enable_sleep_mode is not supported with data_parallel_size > 1"):
        EngineArgs(enable_sleep_mode=True, data_parallel_size=2)
