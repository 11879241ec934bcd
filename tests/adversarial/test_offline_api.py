"""Adversarial calls of the offline API: bad arguments are ValueErrors, nothing is queued, and
the engine stays usable."""

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, max_model_len=64)


def _idle(llm):
    eng = llm.llm_engine
    st = eng.get_kv_cache_stats()
    assert not eng.has_unfinished_requests()
    assert st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
    assert st["num_free_cpu_blocks"] == st["num_cpu_blocks"]


@pytest.mark.parametrize("priority", [[1], [1, 2, 3], []])
def test_priority_list_of_wrong_length_is_value_error(llm, priority):
    p = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5, 6, 7], [8, 9]], p, priority=priority, use_tqdm=False)
    _idle(llm)
    outs = llm.generate([[5, 6, 7], [8, 9]], p, priority=[1, 0], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


@pytest.mark.parametrize("ids", [5, None, "abc", {"a": 1}, 2.5])
def test_prompt_token_ids_not_a_list_is_value_error(llm, ids):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), use_tqdm=False)
    _idle(llm)


def test_nan_temperature_never_reaches_the_engine(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=float("nan")), use_tqdm=False)
    _idle(llm)
