"""Greedy output of batches mixing LoRA adapters and the base model equals transformers + peft,
per request, token for token (up to near-ties: ``tests/golden.py``)."""

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.lora_request import LoRARequest
from kvserve.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from tests.engine.test_e2e_tiny import assert_idle
from tests.golden import TEST_DEVICE, compare, hf_greedy
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter, peft_reference

pytest.importorskip("peft")

MAX_NEW = 12
ENGINE = dict(device=TEST_DEVICE, dtype="float32", enable_lora=True, max_lora_rank=8, max_cpu_loras=4)
#: (rank, target modules, rsLoRA) of the three adapters
SPECS = [
    (4, ["q_proj", "v_proj"], False),
    (8, ALL_TARGETS, True),
    (2, ["k_proj", "o_proj", "gate_proj", "down_proj"], False),
]


@pytest.fixture(scope="module")
def adapters(tiny_hf_model, tmp_path_factory):
    base = tiny_hf_model.cpu()
    out = []
    for i, (r, targets, rs) in enumerate(SPECS, start=1):
        path = make_peft_adapter(base, tmp_path_factory.mktemp(f"lora{i}"), r, targets, rslora=rs, seed=i)
        out.append(LoRARequest(f"adapter{i}", i, path))
    tiny_hf_model.to(TEST_DEVICE)
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 19, 33, 11, 26, 7, 40, 14)]


@pytest.fixture(scope="module")
def references(tiny_hf_model, adapters, prompts):
    """Per prompt ``i``: the reference of adapter ``i % 4`` (3 = the base model)."""
    models = [peft_reference(tiny_hf_model, a.lora_path).to(TEST_DEVICE) for a in adapters] + [tiny_hf_model]
    return [hf_greedy(models[i % 4], p, MAX_NEW) for i, p in enumerate(prompts)]


def _lora_of(adapters, i):
    return adapters[i % 4] if i % 4 < 3 else None


@pytest.mark.parametrize(
    "mode",
    [
        dict(),  # native decode + native prefill kernels (CPU)
        dict(enable_chunked_prefill=True, max_num_batched_tokens=24),  # prefill chunks mixed with decodes
        "module-path",  # no native decode: every step on the module path, MLP in row chunks
        "torch-lora-op",  # the LoRA op's torch forms instead of its kernel at every size
    ],
    ids=["default", "chunked", "module-path", "torch-lora-op"],
)
def test_mixed_adapters_equal_peft(tiny_llama_dir, adapters, prompts, references, mode, monkeypatch):
    if mode == "torch-lora-op":
        from kvserve.model_executor.layers import lora as ops

        monkeypatch.setattr(ops, "NATIVE_MAX_ROWS", 0)
        mode = dict()
    if mode == "module-path":
        monkeypatch.setattr(LlamaForCausalLM, "use_native_decode", False)
        monkeypatch.setattr(LlamaMLP, "CHUNK_ROWS", 16)  # the MLP's row chunks slice the slot map
        mode = dict()
    llm = LLM(model=str(tiny_llama_dir), max_loras=3, **ENGINE, **mode)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[_lora_of(adapters, i) for i in range(len(prompts))],
    )
    near = sum(compare(o.outputs[0].token_ids, ref) for o, ref in zip(outs, references))
    print(f"near-ties: {near} of {len(prompts)}")
    assert llm.llm_engine.list_loras() == {1, 2, 3}
    assert_idle(llm.llm_engine)


def test_torch_decode_path_equals_peft(tiny_llama_dir, adapters, prompts, references, monkeypatch):
    """The torch decode path sorts decode rows by length: the slot map must follow."""
    from kvserve.worker import model_runner

    orig = model_runner.ModelRunner.__init__

    def no_native(self, *a, **kw):
        kw["use_native"] = False
        orig(self, *a, **kw)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", no_native)
    llm = LLM(model=str(tiny_llama_dir), max_loras=3, **ENGINE)
    assert not llm.llm_engine.executor.runner.use_native
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[_lora_of(adapters, i) for i in range(len(prompts))],
    )
    for o, ref in zip(outs, references):
        compare(o.outputs[0].token_ids, ref)


def test_adapters_change_the_output_and_merged_peft_agrees(tiny_hf_model, adapters, prompts, references):
    """The test above could not pass by ignoring the adapters: each changes the greedy output;
    and peft's merged model gives the same reference."""
    base = [hf_greedy(tiny_hf_model, p, MAX_NEW).token_ids for p in prompts[:3]]
    for i in range(3):
        assert references[i].token_ids != base[i], f"adapter {i + 1} does not change prompt {i}"
    merged = peft_reference(tiny_hf_model, adapters[1].lora_path, merged=True).to(TEST_DEVICE)
    compare(references[1].token_ids, hf_greedy(merged, prompts[1], MAX_NEW))


def test_slots_cycle_when_adapters_outnumber_max_loras(tiny_llama_dir, adapters, prompts, references):
    """One adapter at a time in one slot: each batch reloads the slot; outputs stay exact."""
    llm = LLM(model=str(tiny_llama_dir), max_loras=1, **ENGINE)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i in (0, 1, 2, 4, 3):
        out = llm.generate(
            [{"prompt_token_ids": prompts[i]}], params, use_tqdm=False, lora_request=_lora_of(adapters, i)
        )
        compare(out[0].outputs[0].token_ids, references[i])
    mgr = llm.llm_engine.executor.lora_manager
    assert mgr.num_slot_loads == 4  # 1, 2, 3, then 1 again (the base run needs no slot)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bfloat16_adapters_run_and_differ_from_base(tiny_llama_dir, adapters, prompts, dtype):
    """bfloat16 (no token-exact reference): every request finishes, adapters change outputs,
    and the base request equals a run without LoRA."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_dir), **{**ENGINE, "dtype": dtype}, max_loras=3)
    ps = [{"prompt_token_ids": p} for p in prompts[:4]]
    with_lora = llm.generate(ps, params, use_tqdm=False, lora_request=[*adapters, None])
    plain = llm.generate(ps, params, use_tqdm=False)
    assert all(o.outcome == "finished" for o in with_lora)
    assert with_lora[3].outputs[0].token_ids == plain[3].outputs[0].token_ids
    assert any(w.outputs[0].token_ids != p.outputs[0].token_ids for w, p in zip(with_lora[:3], plain[:3]))


def test_speculative_decoding_with_adapters_equals_peft(tiny_llama_dir, adapters, prompts, references):
    """Verify chunks run the request's adapter too: n-gram speculation keeps greedy output."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec["dynamic"] = False  # every step drafts: the check needs verify chunks to run
    llm = LLM(model=str(tiny_llama_dir), max_loras=3, speculative_config=spec, **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[_lora_of(adapters, i) for i in range(len(prompts))],
    )
    for o, ref in zip(outs, references):
        compare(o.outputs[0].token_ids, ref)
    assert llm.llm_engine.stats.spec_num_draft_tokens > 0  # verify chunks did run
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("alpha, rslora", [(0.0, False), (-16.0, False), (-3.5, True)])
def test_zero_and_negative_alpha_equal_peft(tiny_hf_model, tiny_llama_dir, prompts, tmp_path, alpha, rslora):
    """lora_alpha 0 (the adapter adds nothing) and negative (it subtracts) are valid PEFT
    configs: served as PEFT computes them, not refused and not clamped."""
    base = tiny_hf_model.cpu()
    path = make_peft_adapter(
        base, tmp_path / "a", 4, ["q_proj", "v_proj", "gate_proj"], alpha, rslora, seed=9
    )
    ref_model = peft_reference(base, path).to(TEST_DEVICE)
    tiny_hf_model.to(TEST_DEVICE)
    refs = [hf_greedy(ref_model, p, MAX_NEW) for p in prompts[:3]]
    llm = LLM(model=str(tiny_llama_dir), max_loras=1, **ENGINE)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=LoRARequest("a", 1, path),
    )
    for o, ref in zip(outs, refs):
        compare(o.outputs[0].token_ids, ref)
    if alpha == 0.0:  # scale 0: exactly the base model
        plain = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:3]],
            SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert_idle(llm.llm_engine)
