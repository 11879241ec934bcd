"""Structured outputs offline, on the tiny random model: every constrained output validates
(random JSON schemas and regexes) under every kind of scheduling pressure."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.structured_output import allowed_tokens
from tests.structured_output.strategies import JSON_SCHEMAS, max_tokens_for, satisfiable
from tests.structured_output.strategies import REGEXES as RANDOM_REGEXES

ENGINE = dict(device="cpu", dtype="float32")

# Scheduling modes: a tiny KV cache (forces preemption by recompute, or by swap), prefix
# caching, chunked prefill with small steps.
MODES = {
    "plain": dict(num_gpu_blocks=128),
    # 40 blocks of 4 tokens: one sequence of the longest allowed output fits, a batch does not
    "recompute": dict(num_gpu_blocks=40, block_size=4, preemption_mode="recompute", max_num_seqs=8),
    "swap": dict(num_gpu_blocks=40, block_size=4, num_cpu_blocks=256, preemption_mode="swap", max_num_seqs=8),
    "prefix_chunked": dict(
        num_gpu_blocks=128,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    ),
}


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    return {name: LLM(model=str(tiny_llama_dir), **ENGINE, seed=0, **kw) for name, kw in MODES.items()}


def _leaf():
    return st.one_of(
        st.just({"type": "boolean"}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(
            lambda vals: {"enum": vals},
            st.lists(st.sampled_from(["a", "b", 1, 2.5, None]), min_size=1, max_size=3, unique=True),
        ),
        st.just({"type": "null"}),
    )


def _schema(children):
    obj = st.dictionaries(st.sampled_from(["a", "bb", "c_d", "x"]), children, min_size=1, max_size=3).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )
    arr = st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, children, st.integers(0, 2))
    return st.one_of(obj, arr)


#: Bounded JSON schemas (strings, arrays, numbers bounded) so a random model can finish them.
SCHEMAS = st.recursive(_leaf(), _schema, max_leaves=3)
REGEXES = st.sampled_from(
    # ASCII classes: the grammar engine's regexes are Rust's, whose \d and \w follow a newer
    # Unicode than Python's ``re`` (a digit there may not be one here).
    [
        r"[a-c]{2,5}",
        r"[0-9]{3}-[0-9]{2}",
        r"(yes|no|maybe)",
        r"[A-Z][a-z]{0,4}( [A-Z][a-z]{0,4}){0,2}",
        r"0x[0-9a-f]{1,4}",
        r"(ab){1,4}c?",
    ]
)


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


#: Longest output a generated schema may need (tokens): the prompt plus it fits the tiny cache.
MAX_SCHEMA_TOKENS = 120


def _generated(schemas: list) -> list:
    return [x for x in schemas if max_tokens_for(x) <= MAX_SCHEMA_TOKENS]


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    hand=st.lists(SCHEMAS, min_size=1, max_size=2).map(_generated),
    generated=st.lists(JSON_SCHEMAS, min_size=4, max_size=7).map(_generated),
    regexes=st.lists(st.one_of(REGEXES, RANDOM_REGEXES), min_size=2, max_size=4),
    seed=st.integers(0, 1000),
)
def test_random_schemas_and_regexes_always_validate(llms, mode, hand, generated, regexes, seed):
    """Many random constraints in one engine run (greedy and sampled, n = 1 and 2, beside
    unconstrained requests that fill the cache): every constrained output validates (jsonschema,
    re.fullmatch) and ends ``stop``; a schema llguidance refuses is a ValueError naming the field
    before anything is queued (only unsatisfiable schemas are refused); nothing leaks."""
    llm = llms[mode]
    eng = llm.llm_engine
    prompts, params, checks = [], [], []
    for i, schema in enumerate(hand + generated):
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        try:
            eng.structured_output.compile(so)
        except ValueError as e:
            assert "structured_outputs.json" in str(e)
            assert not satisfiable(schema), (schema, str(e))
            with pytest.raises(ValueError, match=re.escape("structured_outputs.json")):
                llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
            continue
        prompts.append(f"J{i}")
        params.append(
            SamplingParams(
                max_tokens=max_tokens_for(schema),  # enough for any instance: never ends "length"
                temperature=0 if i % 2 == 0 else 1.0,
                seed=seed + i,
                n=1 if i % 3 else 2,
                # no free whitespace: a random model favours blank tokens and would spend its
                # budget on them (the default whitespace is checked elsewhere)
                structured_outputs=so,
            )
        )
        checks.append(lambda t, s=schema: _check_json(t, s))
    for j, rx in enumerate(regexes):
        prompts.append(f"Match {j}:")
        params.append(
            SamplingParams(
                max_tokens=60,
                temperature=0.8 if j % 2 else 0,
                seed=seed,
                n=2 if j % 2 else 1,
                structured_outputs=StructuredOutputsParams(regex=rx),
            )
        )
        checks.append(lambda t, rx=rx: re.fullmatch(rx, t) or pytest.fail(f"{t!r} does not match {rx!r}"))
    # Unconstrained neighbours that hold blocks for ~100 tokens: the tiny caches must preempt.
    for k in range(3):
        prompts.append(f"free {k}")
        params.append(SamplingParams(max_tokens=100, temperature=1.0, seed=seed + k, ignore_eos=True))
        checks.append(None)
    preempted = eng.get_kv_cache_stats()["num_preemptions"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, check in zip(outs, checks):
        assert out.outcome == "finished", out.error
        for c in out.outputs:
            if check is None:
                assert len(c.token_ids) == 100
                continue
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(c.text)
    assert eng.structured_output.num_live == 0
    st_ = eng.get_kv_cache_stats()
    assert st_["num_free_gpu_blocks"] == st_["num_gpu_blocks"]
    if mode in ("recompute", "swap"):
        assert st_["num_preemptions"] > preempted


def test_choice_grammar_and_json_object(llms):
    llm = llms["plain"]
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=1.0,
            seed=1,
            n=3,
            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue sky"]),
        ),
        SamplingParams(
            max_tokens=40,
            temperature=0,
            structured_outputs=StructuredOutputsParams(grammar='root ::= "id=" [0-9]{1,3} ";"'),
        ),
        SamplingParams(
            max_tokens=40,
            temperature=0,
            structured_outputs=StructuredOutputsParams(grammar='start: "k" ab ab? "!"\nab: "a" | "b"'),
        ),
        SamplingParams(
            max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
    ]
    outs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
    assert all(c.text in ("red", "green", "blue sky") for c in outs[0].outputs)
    assert re.fullmatch(r"id=[0-9]{1,3};", outs[1].outputs[0].text)
    assert re.fullmatch(r"k[ab]{1,2}!", outs[2].outputs[0].text)
    c = outs[3].outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    assert c.text.startswith("{")


def test_max_tokens_mid_structure_finishes_length(llms):
    out = llms["plain"].generate(
        ["x"],
        SamplingParams(
            max_tokens=3, temperature=0, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{20}")
        ),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert re.fullmatch(r"[a-z]{1,19}", c.text)


def test_bad_constraint_is_a_value_error_naming_the_field_and_the_engine_keeps_serving(llms):
    llm = llms["plain"]
    cases = [
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(json='{"type": '), "structured_outputs.json"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for so, field in cases:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    out = llm.generate(
        ["x"],
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(regex="ok+")),
        use_tqdm=False,
    )[0]
    assert re.fullmatch("ok+", out.outputs[0].text)
    assert llm.llm_engine.structured_output.num_live == 0


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_compiled_once_per_constraint(llms):
    llm = llms["plain"]
    comp = llm.llm_engine.structured_output.compiler
    so = StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["q"],
            "additionalProperties": False,
        },
        disable_any_whitespace=True,
    )
    llm.generate(["x"], SamplingParams(max_tokens=30, structured_outputs=so), use_tqdm=False)
    before = comp.num_compiled
    same = StructuredOutputsParams(json=json.dumps(so.json), disable_any_whitespace=True)
    outs = llm.generate(
        ["y", "z"], [SamplingParams(max_tokens=30, structured_outputs=same)] * 2, use_tqdm=False
    )
    assert comp.num_compiled == before
    for o in outs:
        assert 0 <= json.loads(o.outputs[0].text)["q"] <= 9


def test_allowed_tokens_bit_layout():
    import torch

    mask = torch.tensor([[0b101, -(2**31)], [0, 1]], dtype=torch.int32)
    a = allowed_tokens(mask, 66)
    assert a.shape == (2, 66)
    assert a[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert a[1].nonzero().flatten().tolist() == [32]


def test_fused_greedy_mask_gives_the_tokens_and_logprobs_of_the_torch_mask(llms, monkeypatch):
    """The sampler's fused path (mask inside the greedy kernel) against masking in torch, on a
    batch mixing constrained, unconstrained and n = 2 greedy rows."""
    from kvserve.ops import bitmask

    if not bitmask.available():
        pytest.skip("native bitmask kernels not built")
    llm = llms["plain"]
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["a", "n"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(
            max_tokens=30, temperature=0, n=2, structured_outputs=StructuredOutputsParams(regex="[a-f]{3,9}")
        ),
    ]

    def run():
        outs = llm.generate(["p", "q", "r"], params, use_tqdm=False)
        return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]

    calls = []
    real = bitmask.greedy_sample_masked
    monkeypatch.setattr(bitmask, "greedy_sample_masked", lambda *a: calls.append(1) or real(*a))
    fused = run()
    assert calls, "the fused path did not run"
    monkeypatch.setattr(bitmask, "supported", lambda *a: False)
    unfused = run()
    assert [[t for t, _ in o] for o in fused] == [[t for t, _ in o] for o in unfused]
    for fo, uo in zip(fused, unfused):
        for (_, flp), (_, ulp) in zip(fo, uo):
            assert flp == pytest.approx(ulp, rel=1e-5, abs=1e-4)
