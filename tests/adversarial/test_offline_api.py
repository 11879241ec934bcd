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
    outs = llm.generate([[5, 6, 7], [8, 9]], p, priority=[0, 0], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


@pytest.mark.parametrize("priority", ["3", 2.5, {"a": 1}, True])
def test_priority_of_another_type_is_value_error_naming_it(llm, priority):
    with pytest.raises(ValueError, match="^priority must be an int or a list of ints"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), priority=priority, use_tqdm=False)
    _idle(llm)


def test_one_int_priority_applies_to_every_prompt(llm):
    p = SamplingParams(max_tokens=2, temperature=0)
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[5, 6, 7], [8, 9]], p, priority=0)] == [2, 2]
    with pytest.raises(ValueError, match=r"^priority 3 needs the 'priority' or 'fair' policy"):
        llm.generate([[5, 6, 7], [8, 9]], p, priority=3, use_tqdm=False)
    _idle(llm)


def test_a_nonzero_priority_under_fcfs_is_value_error(llm):
    """fcfs never reads a priority: a non-zero one is refused (as the server's 400), not run
    in arrival order as if it had been honoured."""
    p = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(
        ValueError, match=r"^priority -3 needs the 'priority' or 'fair' policy; this LLM runs 'fcfs'"
    ):
        llm.generate([[5, 6, 7], [8, 9]], p, priority=[0, -3], use_tqdm=False)
    _idle(llm)


@pytest.mark.parametrize("ids", [5, None, "abc", {"a": 1}, 2.5])
def test_prompt_token_ids_not_a_list_is_value_error(llm, ids):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), use_tqdm=False)
    _idle(llm)


def test_nan_temperature_never_reaches_the_engine(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=float("nan")), use_tqdm=False)
    _idle(llm)


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_priority_is_taken_under_the_policies_that_read_it(tiny_llama_dir, policy):
    """One sequence a step: the lowest priority value runs first, the prompts' order aside."""
    llm = LLM(
        model=str(tiny_llama_dir),
        block_size=4,
        num_gpu_blocks=32,
        max_model_len=64,
        max_num_seqs=1,
        policy=policy,
    )
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11]], p, priority=[2, 0, 1], use_tqdm=False)
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < first[2] < first[0], first
    llm.shutdown()
