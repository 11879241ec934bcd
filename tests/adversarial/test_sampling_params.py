"""Adversarial SamplingParams input: every bad value is a ValueError naming the field, before
anything is queued (never garbage output, never a TypeError / KeyError from deep inside)."""

import math

import pytest

from kvserve import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("ignore_eos", "false"),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", None),
        ("top_p", math.nan),
        ("top_p", True),
        ("min_p", math.nan),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -math.inf),
        ("seed", 2**70),
        ("seed", -(2**63) - 1),
        ("stop", 5),
        ("stop", {"a": 1}),
        ("stop_token_ids", 5),
        ("logit_bias", [1, 2]),
        ("logit_bias", {-1: 5}),
        ("logit_bias", {"-3": 5}),
        ("logit_bias", {"abc": 5}),
        ("logit_bias", {1.7: 5}),
        ("logit_bias", {"1.5": 5}),
        ("logit_bias", {True: 5}),
        ("logit_bias", {"\u0663": 5}),
        ("logit_bias", {3: math.nan}),
    ],
)
def test_bad_sampling_field_is_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_string_keys_become_token_ids():
    p = SamplingParams(logit_bias={"17": 5, 3: -1.5})
    assert p.logit_bias == {17: 5, 3: -1.5}
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
