"""Input validation: bad requests raise ValueError naming the field and the limit (B05, B06)."""

import pytest

from kvserve.config import CacheConfig, EngineArgs, SchedulerConfig
from kvserve.engine.input_processor import tokenize_prompt, validate_request
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_sampling_params_reject_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_B05_empty_prompt_rejected_in_every_form():
    for prompt in ("", [], {"prompt_token_ids": []}, {"prompt": ""}):
        with pytest.raises(ValueError, match="prompt must contain at least 1 token"):
            tokenize_prompt(prompt, tokenizer=None)


def test_prompt_token_ids_must_be_ints():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tokenize_prompt([1, 2.5], tokenizer=None)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        validate_request([1, 99], SamplingParams(), vocab_size=50, max_model_len=64, max_num_seqs=4)


def test_B06_max_tokens_against_max_model_len():
    ids = list(range(8))
    # (d) exactly fills the context: accepted.
    assert (
        validate_request(ids, SamplingParams(max_tokens=24), vocab_size=100, max_model_len=32, max_num_seqs=4)
        == 24
    )
    # (e) one over: rejected with both numbers.
    with pytest.raises(
        ValueError, match=r"prompt \(8 tokens\) \+ max_tokens \(25\) = 33 > max_model_len \(32\)"
    ):
        validate_request(ids, SamplingParams(max_tokens=25), vocab_size=100, max_model_len=32, max_num_seqs=4)
    # (f) omitted: defaults to the rest of the context.
    assert (
        validate_request(
            ids, SamplingParams(max_tokens=None), vocab_size=100, max_model_len=32, max_num_seqs=4
        )
        == 24
    )


def test_n_above_max_num_seqs_rejected():
    with pytest.raises(ValueError, match="max_num_seqs"):
        validate_request([1], SamplingParams(n=5), vocab_size=None, max_model_len=32, max_num_seqs=4)


def test_group_wider_than_the_step_token_budget_is_rejected_not_hung():
    """Adversarial find: n=3 with max_num_batched_tokens=2 prefilled, then its 3 sequences
    (one decode token each per step) never fitted a step again: the engine spun forever.
    Such a request is now refused at add time, naming n and the budget."""
    from tests.core.simutil import Harness, configs, prompt_of

    with pytest.raises(ValueError, match=r"n must be <= max_num_batched_tokens \(2\)"):
        validate_request(
            [1, 2, 3],
            SamplingParams(n=3),
            vocab_size=None,
            max_model_len=32,
            max_num_seqs=4,
            max_num_batched_tokens=2,
        )
    cc, sc = configs(BS=4, G=16, S=4, T=2, L=64, CP=True)
    h = Harness(cc, sc)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        h.add("wide", prompt_of(0, 3), SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1))
    h.add(
        "fits", prompt_of(1, 3), SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    )
    h.run(max_steps=200)
    h.assert_idle()
    assert [len(t) for t in h.tokens("fits")] == [4, 4]


def test_configs_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="sometimes")
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(max_model_len=10_000).create_configs(model_max_len=8192)
    with pytest.raises(ValueError, match="device"):
        EngineArgs(device="tpu").create_configs(model_max_len=8192)


def test_cpu_default_is_chunked_prefill_with_2048_token_steps():
    """Unset ``enable_chunked_prefill`` on CPU: chunked, 2,048-token budget (vLLM's CPU
    default); explicit settings are kept as given (V0 default: whole prompt fits a step)."""
    _, _, sc = EngineArgs(device="cpu").create_configs(model_max_len=8192)
    assert sc.chunked_prefill_enabled and sc.max_num_batched_tokens == 2048
    _, _, sc = EngineArgs(device="cpu", max_num_batched_tokens=256).create_configs(model_max_len=8192)
    assert sc.chunked_prefill_enabled and sc.max_num_batched_tokens == 256
    _, _, sc = EngineArgs(device="cpu", enable_chunked_prefill=False).create_configs(model_max_len=8192)
    assert not sc.chunked_prefill_enabled and sc.max_num_batched_tokens == 8192
    _, _, sc = EngineArgs(device="cpu", enable_chunked_prefill=True).create_configs(model_max_len=8192)
    assert sc.chunked_prefill_enabled and sc.max_num_batched_tokens == 2048
    # fair: short steps (a tenant returning to a flood waits for the step in flight)
    _, _, sc = EngineArgs(device="cpu", policy="fair").create_configs(model_max_len=8192)
    assert sc.chunked_prefill_enabled and sc.max_num_batched_tokens == 256
    _, _, sc = EngineArgs(device="cpu", policy="fair", max_num_batched_tokens=1024).create_configs(8192)
    assert sc.max_num_batched_tokens == 1024


def test_min_tokens_is_checked_against_the_effective_max_when_max_tokens_is_null():
    """min_tokens used to be ignored when max_tokens was null: with 8 prompt tokens and
    max_model_len 32 at most 24 tokens can be generated, so min_tokens=25 can never hold."""
    ids = list(range(8))
    ok = SamplingParams(max_tokens=None, min_tokens=24)
    assert validate_request(ids, ok, vocab_size=100, max_model_len=32, max_num_seqs=4) == 24
    with pytest.raises(ValueError, match=r"min_tokens \(25\) must be <= the effective max_tokens 24"):
        validate_request(
            ids,
            SamplingParams(max_tokens=None, min_tokens=25),
            vocab_size=100,
            max_model_len=32,
            max_num_seqs=4,
        )


def test_top_k_above_the_vocabulary_names_the_vocabulary_size():
    assert validate_request([1], SamplingParams(top_k=100), vocab_size=100, max_model_len=32, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"top_k must be .*\[1, 100\]"):
        validate_request([1], SamplingParams(top_k=101), vocab_size=100, max_model_len=32, max_num_seqs=4)


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 2**63),
        ("max_tokens", 2**63),
        ("min_tokens", 10**30),
        ("top_k", 2**63),
        ("top_k", 10**30),
        ("seed", 2**64),
        ("logprobs", 21),
        ("temperature", 3.5e38),
        ("repetition_penalty", 1e308),
        ("stop_token_ids", [2**63]),
        ("logit_bias", {2**63: 1.0}),
    ],
)
def test_every_numeric_field_has_an_upper_bound_named_in_the_error(field, value):
    from kvserve.field_limits import LIMITS

    with pytest.raises(ValueError, match=field) as ei:
        SamplingParams(**{field: value})
    limit = LIMITS["token_id"] if field in ("stop_token_ids", "logit_bias") else LIMITS[field]
    assert limit.rule() in str(ei.value)


def test_http_schema_constraints_are_the_shared_limits():
    """One source: every numeric field of the request models accepts exactly LIMITS' range
    (the bound itself passes the schema, one step past it is a 400 naming the field)."""
    import json

    from pydantic import ValidationError

    from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from kvserve.entrypoints.openai.serving_engine import api_error_from_validation
    from kvserve.field_limits import LIMITS

    checked = set()
    for model, base in (
        (CompletionRequest, {"prompt": "x"}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        for name in model.model_fields:
            if (
                name not in LIMITS
                or name == "logit_bias"
                or (model is ChatCompletionRequest and name == "logprobs")
            ):
                continue
            lim = LIMITS[name]
            step = 1 if lim.integer else max(abs(lim.hi) * 1e-6, 1e-6)
            model.model_validate_json(json.dumps({**base, name: lim.hi}))
            for bad in (lim.hi + step, min([lim.lo, *lim.special]) - step):
                with pytest.raises(ValidationError) as ei:
                    model.model_validate_json(json.dumps({**base, name: bad}))
                err = api_error_from_validation(ei.value)
                assert err.param == name and lim.rule() in err.message, (name, bad, err.message)
            checked.add(name)
    assert {"n", "max_tokens", "max_completion_tokens", "top_k", "seed", "temperature"} <= checked
    assert {"priority", "top_logprobs", "best_of", "min_tokens", "repetition_penalty"} <= checked


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop": ["x"] * 65}, "stop must have at most 64"),
        ({"stop": ["x" * 1025]}, "stop strings must be at most 1024"),
        ({"stop_token_ids": [1] * 1025}, "stop_token_ids must have at most 1024"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias must have at most 1024"),
        ({"repetition_penalty": 1e-38}, "repetition_penalty"),
        ({"logit_bias": {"1_0": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"+5": 1.0}}, "logit_bias keys"),
        ({"logit_bias": {" 5": 1.0}}, "logit_bias keys"),
    ],
)
def test_list_fields_are_bounded_and_tiny_penalties_refused(kwargs, field):
    """Adversarial finds: 400k stop strings or a 49k-entry logit_bias made a neighbour's request
    100-290x slower (scanned per step); repetition_penalty 1e-38 passed and gave NaN logprobs
    (0 in the float32 sampler); logit_bias key "1_0" was taken as token 10."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_list_fields_at_their_limits_are_accepted():
    SamplingParams(stop=["x"] * 64, stop_token_ids=[1] * 1024, logit_bias={i: 1.0 for i in range(1024)})
    SamplingParams(repetition_penalty=1e-6, logit_bias={"05": 1.0})
