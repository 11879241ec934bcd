"""LoRA through the engine and the offline API: bad adapters and bad arguments are clear
errors of their own request; the engine keeps serving; every request ends and says how."""

import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.lora.peft import ModelShapes, load_peft_adapter
from kvserve.lora_request import LoRARequest
from tests.engine.test_e2e_tiny import assert_idle
from tests.lora.adapters import lora_tensors, write_adapter

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]


@pytest.fixture(scope="module")
def shapes(tiny_llama_dir):
    from transformers import AutoConfig

    return ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))


def _cfg(r=4, **kw):
    return {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"], **kw}


def _good(tmp_path, shapes, name="good", r=4, seed=0):
    t = lora_tensors(shapes.num_layers, shapes.in_out, r, ("q_proj", "down_proj"), seed=seed)
    return write_adapter(tmp_path / name, _cfg(r), t)


@pytest.fixture(scope="module")
def good(tmp_path_factory, shapes):
    return LoRARequest("good", 1, _good(tmp_path_factory.mktemp("good"), shapes))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run_to_end(eng, max_steps=100):
    """Step ``eng`` until no request is left (at most ``max_steps``); request_id -> final output."""
    finals = {}
    for _ in range(max_steps):
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    return finals


def test_lora_request_without_enable_lora_is_refused(tiny_llama_dir, tmp_path, shapes):
    plain = LLM(model=str(tiny_llama_dir))
    req = LoRARequest("a", 1, _good(tmp_path, shapes))
    with pytest.raises(ValueError, match="LoRA is not enabled.*enable_lora=True"):
        plain.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=req)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.llm_engine.add_request("x", PROMPTS[0], PARAMS, lora_request=req)
    assert plain.llm_engine.list_loras() == set()
    assert_idle(plain.llm_engine)


def test_lora_request_list_must_match_the_prompts(llm, good):
    req = good
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[req])
    with pytest.raises(ValueError, match="lora_request entries must be LoRARequest or None, got str"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=["a", None])
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize(
    "kind,match",
    [
        ("rank", "rank 16 .*above max_lora_rank=8"),
        ("no-weights", "has no adapter_model.safetensors"),
        ("no-config", "has no adapter_config.json"),
        ("target", "target_modules has 'embed_tokens'"),
        ("dora", "use_dora=True"),
    ],
)
def test_bad_adapter_fails_its_call_and_the_engine_keeps_serving(llm, good, tmp_path, shapes, kind, match):
    before = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[good, None]))
    path = str(tmp_path / kind)
    if kind == "rank":
        write_adapter(path, _cfg(16), lora_tensors(shapes.num_layers, shapes.in_out, 16, ("q_proj",)))
    elif kind == "no-weights":
        write_adapter(path, _cfg(), None)
    elif kind == "no-config":
        os.makedirs(path)
    elif kind == "target":
        write_adapter(path, _cfg(target_modules=["q_proj", "embed_tokens"]), {})
    else:
        write_adapter(path, _cfg(use_dora=True), {})
    bad = LoRARequest(f"bad-{kind}", 9, path)
    with pytest.raises(ValueError, match=match) as e:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[good, bad])
    if kind in ("no-weights", "no-config"):
        assert path in str(e.value)
    assert 9 not in llm.llm_engine.list_loras()
    assert_idle(llm.llm_engine)
    after = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[good, None]))
    assert after == before


def test_bad_adapter_while_others_run_ends_only_its_request(llm, good, tmp_path):
    eng = llm.llm_engine
    ref = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=[good, None]))
    eng.add_request("r0", PROMPTS[0], PARAMS, lora_request=good)
    eng.add_request("r1", PROMPTS[1], PARAMS)
    eng.step()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        eng.add_request("r2", PROMPTS[0], PARAMS, lora_request=LoRARequest("x", 5, str(tmp_path)))
    finals = _run_to_end(eng)
    assert set(finals) == {"r0", "r1"}
    assert [finals["r0"].outputs[0].token_ids, finals["r1"].outputs[0].token_ids] == ref
    assert_idle(eng)


def test_adapter_vanishing_from_disk_after_eviction_fails_only_its_request(llm, tmp_path, shapes):
    """Evicted from the CPU cache and its slot, then deleted: the reload in its step fails;
    fault isolation ends that request (failed, naming the path), the others finish."""
    eng = llm.llm_engine
    a, b, c = (LoRARequest(f"n{i}", 20 + i, _good(tmp_path, shapes, f"n{i}", seed=i)) for i in range(3))
    eng.add_request("victim", PROMPTS[0], PARAMS, lora_request=a)
    for r in (b, c):  # max_cpu_loras=2: a is evicted from the CPU cache
        eng.add_lora(r)
    assert 20 not in eng.list_loras()
    shutil.rmtree(a.lora_path)
    eng.add_request("ok", PROMPTS[1], PARAMS, lora_request=b)
    finals = _run_to_end(eng)
    assert finals["victim"].outcome == "failed" and a.lora_path in finals["victim"].error
    assert finals["ok"].outcome == "finished" and len(finals["ok"].outputs[0].token_ids) == 6
    assert_idle(eng)


def test_an_id_reused_for_another_adapter_while_requests_hold_it_is_refused(llm, tmp_path, shapes):
    """Once an id is evicted from the CPU cache, the cache would read another adapter under
    it; a request queued with the first adapter would then run with the second's weights,
    or fail in its step. The engine refuses the second while the first's requests live
    (add_request and add_lora alike), and takes it once they have ended."""
    eng = llm.llm_engine
    first = LoRARequest("first", 41, _good(tmp_path, shapes, "first", seed=11))
    other = LoRARequest("other", 41, _good(tmp_path, shapes, "other", seed=12))
    ref = _tokens(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=first))[0]
    eng.remove_lora(41)  # out of its device slot too
    eng.add_request("held", PROMPTS[0], PARAMS, lora_request=first)
    for i in (42, 43):  # max_cpu_loras=2: id 41 is evicted from the CPU cache
        eng.add_lora(LoRARequest(f"e{i}", i, _good(tmp_path, shapes, f"e{i}", seed=i)))
    assert 41 not in eng.list_loras()
    with pytest.raises(ValueError, match=r"lora_int_id=41 is in use by 1 live request\(s\) with 'first'"):
        eng.add_request("thief", PROMPTS[1], PARAMS, lora_request=other)
    with pytest.raises(ValueError, match=r"lora_int_id=41 is in use .*use another id for 'other'"):
        eng.add_lora(other)
    eng.add_request("same", PROMPTS[0], PARAMS, lora_request=first)  # the same adapter is fine
    finals = _run_to_end(eng)
    assert set(finals) == {"held", "same"}
    assert all(f.outcome == "finished" and f.outputs[0].token_ids == ref for f in finals.values())
    assert_idle(eng)
    assert eng._live_loras == {}
    # no request holds id 41 now: once unloaded it may name another adapter again
    eng.remove_lora(41)
    assert len(_tokens(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=other))[0]) == 6
    assert eng._live_loras == {}


def test_remove_lora_unloads_and_a_later_request_reloads(llm, tmp_path, shapes):
    eng = llm.llm_engine
    r = LoRARequest("rm", 30, _good(tmp_path, shapes, "rm", seed=3))
    first = _tokens(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=r))
    assert 30 in eng.list_loras()
    assert eng.remove_lora(30) and not eng.remove_lora(30)
    assert 30 not in eng.list_loras()
    assert _tokens(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=r)) == first
    assert eng.add_lora(LoRARequest("rm2", 31, r.lora_path)) is True
    assert eng.add_lora(LoRARequest("rm2", 31, r.lora_path)) is False


_FIELDS = {
    "r": st.one_of(st.integers(-2, 40), st.none(), st.text(max_size=3), st.floats(allow_nan=True)),
    "lora_alpha": st.one_of(st.integers(-4, 64), st.floats(allow_nan=True), st.none(), st.booleans()),
    "target_modules": st.one_of(
        st.lists(
            st.sampled_from(["q_proj", "o_proj", "down_proj", "lm_head", "x.k_proj", "mlp"]), max_size=4
        ),
        st.sampled_from(["all-linear", "q_proj", ".*proj", "nothing"]),
        st.none(),
        st.integers(),
    ),
    "use_dora": st.booleans(),
    "use_rslora": st.booleans(),
    "bias": st.sampled_from(["none", "all", "lora_only", None]),
    "peft_type": st.sampled_from(["LORA", "lora", "IA3"]),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fields=st.fixed_dictionaries({}, optional=_FIELDS),
    weights=st.sampled_from(["ok", "none", "garbage", "rank16", "extra"]),
)
def test_fuzzed_adapter_dirs_load_or_raise_value_error(tmp_path_factory, shapes, fields, weights):
    """Whatever the config and weights file hold, loading returns or raises ValueError."""
    path = tmp_path_factory.mktemp("fuzz")
    t = lora_tensors(shapes.num_layers, shapes.in_out, 16 if weights == "rank16" else 4, ("q_proj",))
    if weights == "extra":
        t["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = t[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        ].clone()
    write_adapter(path, fields, None if weights in ("none", "garbage") else t)
    if weights == "garbage":
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    try:
        json.dumps(fields)
    except ValueError:
        return  # a NaN written as NaN: still JSON to Python; nothing else to skip
    try:
        m = load_peft_adapter(str(path), 1, shapes, 8)
    except ValueError:
        return
    assert m.rank == 4 and m.weights


def test_async_engine_streams_with_an_adapter_and_reports_a_bad_one(llm, good, tmp_path):
    """The server's engine front passes ``lora_request`` through; a bad adapter is the
    caller's ValueError and the loop keeps serving."""
    import asyncio

    from kvserve.engine.async_llm_engine import AsyncLLMEngine

    ref = _tokens(llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False, lora_request=good))[0]

    async def main():
        ae = AsyncLLMEngine(llm.llm_engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="has no adapter_config.json"):
                async for _ in ae.generate(
                    PROMPTS[0], PARAMS, "bad", lora_request=LoRARequest("b", 77, str(tmp_path))
                ):
                    pass
            last = None
            async for out in ae.generate(PROMPTS[0], PARAMS, "ok", lora_request=good):
                last = out
            return last
        finally:
            ae.shutdown()

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].token_ids == ref


def test_lora_with_tensor_parallelism_is_refused_at_start(tiny_llama_dir):
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel_size"):
        LLM(model=str(tiny_llama_dir), enable_lora=True, tensor_parallel_size=2)
