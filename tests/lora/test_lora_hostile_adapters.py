"""Hostile PEFT adapter directories: each is refused at load with a ValueError naming the file."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.lora.peft import load_peft_adapter
from tests.lora.adapters import lora_tensors, write_adapter
from tests.lora.test_lora_adapters import SHAPES, _adapter, _config

Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("key", [Q_A, Q_B])
def test_non_finite_lora_weights_are_refused_naming_the_tensor(tmp_path, bad, key):
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    t[key][0, 0] = bad
    p = write_adapter(tmp_path / "nf", _config(target_modules=["q_proj"]), t)
    with pytest.raises(ValueError, match=r"q_proj: .*not finite"):
        load_peft_adapter(p, 1, SHAPES, 16)


def test_huge_alpha_that_overflows_the_scaled_weights_is_refused(tmp_path):
    # finite alpha, but alpha / r times B overflows float32 (and any lower dtype)
    p = _adapter(tmp_path, "big", r=4, lora_alpha=1e300)
    with pytest.raises(ValueError, match=r"not finite"):
        load_peft_adapter(p, 1, SHAPES, 16)
    # bfloat16 has float32's range, float16 does not: 1e5 * 0.1-sized B fits float32 only
    p = _adapter(tmp_path, "mid", r=4, lora_alpha=4e6)
    load_peft_adapter(p, 1, SHAPES, 16, torch.float32)
    with pytest.raises(ValueError, match=r"not finite"):
        load_peft_adapter(p, 1, SHAPES, 16, torch.float16)


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "not readable JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"peft_type": "LORA", "target_modules": ["q_proj"]}', "r must be a positive integer"),
        ('{"r": "4", "target_modules": ["q_proj"]}', "r must be a positive integer"),
        ('{"r": 4, "lora_alpha": "8", "target_modules": ["q_proj"]}', "lora_alpha must be a finite"),
        ('{"r": 4, "target_modules": 5}', "target_modules must be a list"),
        ('{"r": 4}', "target_modules is missing"),
    ],
)
def test_malformed_adapter_config_is_refused_naming_the_file(tmp_path, text, match):
    p = write_adapter(tmp_path / "c", _config(), lora_tensors(2, SHAPES.in_out, 4, ("q_proj",)))
    with open(os.path.join(p, "adapter_config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(p, 1, SHAPES, 16)


@pytest.mark.parametrize("keep", [0, 7, 100, -50])
def test_truncated_safetensors_is_refused_naming_the_file(tmp_path, keep):
    p = _adapter(tmp_path, "t")
    w = os.path.join(p, "adapter_model.safetensors")
    data = open(w, "rb").read()
    with open(w, "wb") as f:
        f.write(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_peft_adapter(p, 1, SHAPES, 16)


def test_integer_and_wrong_rank_weights_are_refused(tmp_path):
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    t = {k: (v * 100).to(torch.int32) for k, v in t.items()}
    p = write_adapter(tmp_path / "i", _config(target_modules=["q_proj"]), t)
    with pytest.raises(ValueError, match="floating point"):
        load_peft_adapter(p, 1, SHAPES, 16)
    t = lora_tensors(2, SHAPES.in_out, 2, ("q_proj",))  # rank 2 weights, config says 4
    p = write_adapter(tmp_path / "r", _config(target_modules=["q_proj"]), t)
    with pytest.raises(ValueError, match="rank 2 differs"):
        load_peft_adapter(p, 1, SHAPES, 16)


def test_nan_adapter_is_refused_before_queueing_and_the_engine_keeps_serving(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    from kvserve import LLM, SamplingParams
    from kvserve.lora.peft import ModelShapes
    from kvserve.lora_request import LoRARequest
    from tests.engine.test_e2e_tiny import assert_idle

    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]}
    t = lora_tensors(shapes.num_layers, shapes.in_out, 4, ("q_proj",))
    good = LoRARequest("good", 1, write_adapter(tmp_path / "good", cfg, t))
    t = {k: v.clone() for k, v in t.items()}
    next(iter(t.values()))[0, 0] = float("nan")
    nan = LoRARequest("nan", 2, write_adapter(tmp_path / "nan", cfg, t))
    llm = LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=1, max_lora_rank=4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    before = [
        o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=good)
    ]
    with pytest.raises(ValueError, match=r"q_proj: lora_A is not finite"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=nan)
    assert 2 not in llm.llm_engine.list_loras()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=good)]
    assert after == before and all(len(x) == 5 for x in after)
    assert_idle(llm.llm_engine)


def test_max_loras_whose_slots_exceed_memory_is_a_value_error_naming_the_fields(monkeypatch):
    """The device slots are allocated up front: a max_loras / max_lora_rank whose slots do not
    fit in memory is refused naming both and the bytes, not left to the allocator (or the OOM
    killer)."""
    import psutil

    from kvserve.config import LoRAConfig
    from kvserve.lora.manager import LoRAManager
    from kvserve.model_executor.models.llama import LlamaForCausalLM
    from tests.lora.test_lora_adapters import CFG

    model = LlamaForCausalLM(CFG)
    avail = psutil.virtual_memory().available
    # 16-wide hidden, 2 layers, rank 512: ~0.5 MB per slot; enough slots to pass the RAM free now
    per_slot = LoRAManager.slot_bytes(SHAPES, 512, torch.float32)
    n = avail // per_slot + 10
    with pytest.raises(ValueError, match=r"max_loras=\d+ .*max_lora_rank=512.* bytes"):
        LoRAManager(model, LoRAConfig(n, 512, n), SHAPES)
    small = LoRAManager(model, LoRAConfig(2, 4, 2), SHAPES)
    assert small.stacks[0]["qkv"][0].shape[0] == 2
    allocated = sum(t.nbytes for st in small.stacks for ab in st.values() for t in ab)
    assert allocated == 2 * LoRAManager.slot_bytes(SHAPES, 4, torch.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    poison=st.lists(
        st.tuples(
            st.integers(0, 3), st.integers(0, 63), st.sampled_from([float("nan"), float("inf"), -3e38])
        ),
        max_size=3,
    ),
    alpha=st.sampled_from([1.0, 16.0, 1e6, 1e30, 1e300]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_fuzzed_non_finite_weights_and_alpha_load_finite_or_raise(tmp_path_factory, poison, alpha, dtype):
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj", "v_proj"))
    keys = sorted(t)
    for k, i, v in poison:
        flat = t[keys[k]].view(-1)
        flat[i % flat.numel()] = v
    p = write_adapter(tmp_path_factory.mktemp("fz"), _config(lora_alpha=alpha), t)
    try:
        m = load_peft_adapter(p, 1, SHAPES, 16, dtype)
    except ValueError as e:
        where = ("adapter_model.safetensors: layer", "adapter_config.json: lora_alpha=")
        assert "not finite" in str(e) and any(w in str(e) for w in where), str(e)
        return
    for a, b in m.weights.values():
        assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())


def test_config_nested_past_the_parsers_depth_is_a_value_error(tmp_path):
    p = _adapter(tmp_path, "deep")
    with open(os.path.join(p, "adapter_config.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"adapter_config.json: not readable JSON"):
        load_peft_adapter(p, 1, SHAPES, 16)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("alora_invocation_tokens", [1, 2], "activated LoRA"),
        ("layer_replication", [[0, 2], [0, 2]], "replicated layers"),
        ("use_qalora", True, "QA-LoRA"),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}, "BD-LoRA"),
        ("trainable_token_indices", [3, 4], "trained token embeddings"),
        ("target_parameters", ["mlp.experts.gate_up_proj"], "LoRA on parameters"),
        ("arrow_config", {"top_k": 2}, "Arrow"),
        ("kasa_config", {}, None),  # empty: off
        ("monteclora_config", {"n": 4}, "MonteCLoRA"),
    ],
)
def test_peft_options_that_change_the_forward_are_refused_by_name(tmp_path, field, value, match):
    """Plain A / B weights but a config whose forward is not ``scale * B(A(x))`` on every
    token (aLoRA only adapts tokens after its invocation, ...): serving them as a plain LoRA
    would give other outputs than PEFT without a word."""
    p = _adapter(tmp_path, "v", **{field: value})
    if match is None:
        load_peft_adapter(p, 1, SHAPES, 16)
        return
    with pytest.raises(ValueError, match=rf"{field}=.*{match}"):
        load_peft_adapter(p, 1, SHAPES, 16)


def test_two_weights_for_one_lora_matrix_are_refused(tmp_path):
    """``...lora_A.weight`` and ``...lora_A.default.weight`` of one linear: the second used to
    replace the first silently."""
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    t[key.replace("lora_A.weight", "lora_A.default.weight")] = t[key] * 5
    p = write_adapter(tmp_path / "dup", _config(target_modules=["q_proj"]), t)
    with pytest.raises(ValueError, match=r"layer 0 q_proj has more than one lora_A"):
        load_peft_adapter(p, 1, SHAPES, 16)
