"""PEFT adapter reading and validation, and the CPU LRU + device slots of the manager."""

import math

import pytest
import torch
from transformers import LlamaConfig

from kvserve.config import LoRAConfig
from kvserve.lora.manager import LoRAManager
from kvserve.lora.peft import ModelShapes, load_peft_adapter
from kvserve.lora_request import LoRARequest
from kvserve.model_executor.models.llama import LlamaForCausalLM
from tests.lora.adapters import lora_tensors, write_adapter

CFG = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
SHAPES = ModelShapes.from_hf_config(CFG)


def _config(r=4, **kw):
    base = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
    }
    base.update(kw)
    return base


def _adapter(tmp_path, name="a", r=4, targets=("q_proj", "v_proj"), seed=0, **kw):
    return write_adapter(
        tmp_path / name,
        _config(r=r, target_modules=list(targets), **kw),
        lora_tensors(2, SHAPES.in_out, r, targets, seed=seed),
    )


def test_shapes_of_a_gqa_config():
    assert SHAPES.in_out["q_proj"] == (16, 16) and SHAPES.in_out["k_proj"] == (16, 8)
    assert SHAPES.in_out["down_proj"] == (24, 16) and SHAPES.num_layers == 2


def test_scaling_alpha_over_r_and_rslora(tmp_path):
    p = _adapter(tmp_path, "plain", r=4)
    m = load_peft_adapter(p, 1, SHAPES, 16)
    assert m.rank == 4 and m.scaling == pytest.approx(8 / 4)
    raw = lora_tensors(2, SHAPES.in_out, 4, ("q_proj", "v_proj"))
    a, b = m.weights[(1, "v_proj")]
    torch.testing.assert_close(a, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    torch.testing.assert_close(b, 2.0 * raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    rs = load_peft_adapter(_adapter(tmp_path, "rs", r=4, use_rslora=True), 2, SHAPES, 16)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_above_max_lora_rank_names_the_limit(tmp_path):
    with pytest.raises(ValueError, match="rank 8 .* above max_lora_rank=4"):
        load_peft_adapter(_adapter(tmp_path, r=8), 1, SHAPES, 4)


def test_missing_directory_and_files_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft_adapter(str(tmp_path / "nope"), 1, SHAPES, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.* has no adapter_config.json"):
        load_peft_adapter(str(tmp_path / "empty"), 1, SHAPES, 16)
    p = write_adapter(tmp_path / "noweights", _config(), None)
    with pytest.raises(ValueError, match=r"noweights.* has no adapter_model.safetensors"):
        load_peft_adapter(p, 1, SHAPES, 16)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("use_dora", True, "use_dora=True: DoRA"),
        ("bias", "all", "bias='all'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("target_modules", ["q_proj", "lm_head"], "target_modules has 'lm_head'"),
        ("peft_type", "IA3", "peft_type='IA3'"),
        ("r", 0, "r must be a positive integer"),
        ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(tmp_path, field, value, match):
    cfg = _config(**{field: value})
    p = write_adapter(tmp_path / "bad", cfg, lora_tensors(2, SHAPES.in_out, 4, ("q_proj",)))
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(p, 1, SHAPES, 16)


def test_bad_weights_are_refused_by_name(tmp_path):
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="lm_head.lora_A.weight' is not a LoRA weight"):
        load_peft_adapter(write_adapter(tmp_path / "w1", _config(), t), 1, SHAPES, 16)
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(12, 4)
    with pytest.raises(ValueError, match=r"layer 0 q_proj: lora_A \(4, 16\) / lora_B \(12, 4\)"):
        load_peft_adapter(write_adapter(tmp_path / "w2", _config(), t), 1, SHAPES, 16)
    t = lora_tensors(3, {**SHAPES.in_out}, 4, ("q_proj",))
    with pytest.raises(ValueError, match="layer 2; the model has 2"):
        load_peft_adapter(write_adapter(tmp_path / "w3", _config(), t), 1, SHAPES, 16)
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj",))
    del t["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(ValueError, match="lora_A without its pair"):
        load_peft_adapter(write_adapter(tmp_path / "w4", _config(), t), 1, SHAPES, 16)
    t = lora_tensors(2, SHAPES.in_out, 4, ("q_proj", "o_proj"))
    with pytest.raises(ValueError, match="targets o_proj, which target_modules does not list"):
        load_peft_adapter(
            write_adapter(tmp_path / "w5", _config(target_modules=["q_proj"]), t), 1, SHAPES, 16
        )


def _manager(max_loras=2, max_cpu_loras=3, rank=4):
    model = LlamaForCausalLM(CFG)
    return model, LoRAManager(model, LoRAConfig(max_loras, rank, max_cpu_loras), SHAPES)


def _req(tmp_path, i, **kw):
    return LoRARequest(f"l{i}", i, _adapter(tmp_path, f"a{i}", seed=i, **kw))


def test_cpu_lru_evicts_least_recently_used_and_reloads(tmp_path):
    _, mgr = _manager(max_loras=1, max_cpu_loras=2)
    r1, r2, r3 = (_req(tmp_path, i) for i in (1, 2, 3))
    assert mgr.add_lora(r1) and mgr.add_lora(r2)
    assert not mgr.add_lora(r1)  # already loaded: now the most recently used
    assert mgr.add_lora(r3)  # evicts 2, the least recently used
    assert mgr.list_loras() == {1, 3}
    assert mgr.add_lora(r2)  # read from disk again; evicts 1
    assert mgr.list_loras() == {2, 3}
    assert mgr.remove_lora(3) and not mgr.remove_lora(3)
    assert mgr.list_loras() == {2}


def test_same_id_with_another_path_is_refused(tmp_path):
    _, mgr = _manager()
    mgr.add_lora(_req(tmp_path, 1))
    other = LoRARequest("l1", 1, _adapter(tmp_path, "other"))
    with pytest.raises(ValueError, match="lora_int_id=1 is already loaded"):
        mgr.add_lora(other)


def test_slots_hold_fused_zero_padded_weights(tmp_path):
    model, mgr = _manager(max_loras=2, rank=4)
    r = LoRARequest("x", 7, _adapter(tmp_path, "x", r=2, targets=("k_proj", "up_proj")))
    slots = mgr.activate([r])
    s = slots[7]
    lm = mgr._cpu[7][1]
    a, b = model.layers[1].self_attn.lora_stacks["qkv"]
    la, lb = lm.weights[(1, "k_proj")]
    R = 4
    # k is part 1: rank columns [R, R + 2), output columns [q, q + kv)
    assert torch.equal(a[s, :, R : R + 2], la.t()) and torch.equal(b[s, R : R + 2, 16:24], lb.t())
    assert a[s, :, :R].abs().sum() == 0 and a[s, :, R + 2 :].abs().sum() == 0
    assert b[s, :, :16].abs().sum() == 0 and b[s, :, 24:].abs().sum() == 0
    ga, gb = model.layers[0].mlp.lora_stacks["gate_up"]
    ua, ub = lm.weights[(0, "up_proj")]
    assert torch.equal(ga[s, :, R : R + 2], ua.t()) and torch.equal(gb[s, R : R + 2, 24:], ub.t())
    assert model.layers[0].self_attn.lora_stacks["o"][0][s].abs().sum() == 0


def test_slots_keep_resident_adapters_and_replace_the_least_recently_used(tmp_path):
    _, mgr = _manager(max_loras=2, max_cpu_loras=4)
    r1, r2, r3 = (_req(tmp_path, i) for i in (1, 2, 3))
    first = mgr.activate([r1, r2, r1])
    assert sorted(first.values()) == [0, 1] and mgr.num_slot_loads == 2
    assert mgr.activate([r2]) == {2: first[2]} and mgr.num_slot_loads == 2  # resident: no copy
    got = mgr.activate([r3, r2])  # 1 was used least recently: its slot goes to 3
    assert got == {3: first[1], 2: first[2]} and mgr.num_slot_loads == 3
    with pytest.raises(RuntimeError, match="3 distinct LoRA adapters; max_loras=2"):
        mgr.activate([r1, r2, r3])


def test_reloading_an_id_from_another_path_after_eviction_refills_its_slot(tmp_path):
    model, mgr = _manager(max_loras=1, max_cpu_loras=1)
    r1 = _req(tmp_path, 1)
    mgr.activate([r1])
    mgr.add_lora(_req(tmp_path, 2))  # evicts 1 from the CPU cache; slot 0 still holds 1
    assert mgr.slot_of(1) == 0
    mgr.remove_lora(2)
    new1 = LoRARequest("l1", 1, _adapter(tmp_path, "new1", seed=99))
    mgr.activate([new1])
    a = model.layers[0].self_attn.lora_stacks["qkv"][0]
    new_a = mgr._cpu[1][1].weights[(0, "q_proj")][0]
    assert torch.equal(a[0, :, : new_a.shape[0]], new_a.t()) and mgr.num_slot_loads == 2


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_model_on_cpu_keeps_slots_in_the_slot_dtype_holding_the_validated_weights(
    tmp_path, monkeypatch, native
):
    """bfloat16 on CPU: slots in bfloat16 where the native kernel runs the op (it widens them
    exactly), else in float32 (the torch forms compute in it); either way filled from the
    adapter as validated in bfloat16, exactly; the slot memory check counts the slot dtype."""
    from kvserve.ops import lora as lora_kernel

    if native and not lora_kernel.available():
        pytest.skip(f"no native LoRA kernel: {lora_kernel.failure_reason()}")
    if not native:
        monkeypatch.setattr(lora_kernel, "available", lambda: False)
    want = torch.bfloat16 if native else torch.float32
    model = LlamaForCausalLM(CFG, dtype=torch.bfloat16)
    mgr = LoRAManager(model, LoRAConfig(1, 4, 1), SHAPES)
    assert mgr.dtype == torch.bfloat16 and mgr.slot_dtype == want
    r = LoRARequest("x", 3, _adapter(tmp_path, "x", r=2, targets=("q_proj",)))
    s = mgr.activate([r])[3]
    a, _ = model.layers[0].self_attn.lora_stacks["qkv"]
    la, _ = mgr._cpu[3][1].weights[(0, "q_proj")]
    assert a.dtype == want and la.dtype == torch.bfloat16
    assert torch.equal(a[s, :, :2], la.t().to(want))
    per_slot = LoRAManager.slot_bytes(SHAPES, 4, want)
    assert (
        sum(t.numel() * t.element_size() for st in mgr.stacks for ab in st.values() for t in ab) == per_slot
    )


def test_manager_gives_each_module_its_parts_column_bounds():
    model, mgr = _manager()
    q, kv = SHAPES.in_out["q_proj"][1], SHAPES.in_out["k_proj"][1]
    inter = SHAPES.in_out["gate_proj"][1]
    bounds = mgr.part_bounds[0]  # every layer's (a dense family)
    assert all(b == bounds for b in mgr.part_bounds) and len(mgr.part_bounds) == len(model.layers)
    assert bounds["qkv"] == (0, q, q + kv, q + 2 * kv)
    assert bounds["gate_up"] == (0, inter, 2 * inter)
    assert bounds["o"] == (0, SHAPES.in_out["o_proj"][1])
    assert model.layers[0].self_attn.lora_parts == {k: bounds[k] for k in ("qkv", "o")}
    assert model.layers[1].mlp.lora_parts == {k: bounds[k] for k in ("gate_up", "down")}


@pytest.mark.parametrize("native", [True, False])
def test_manager_slots_are_laid_out_for_the_op(tmp_path, monkeypatch, native):
    """Where the native kernel runs, every target's ``A`` is stored slot by slot (``[S, in, R]``
    contiguous: one block per slot for the kernel's stream); elsewhere it is the ``[S, in, R]``
    view of ``[in, S, R]`` storage, so the torch stacked form's ``A_cat``/``B_cat`` are views (no
    copy to keep in step) that see a slot as it is loaded. Either way ``stacked_views`` shows
    each slot as loaded."""
    from kvserve.model_executor.layers.lora import stacked_views
    from kvserve.ops import lora as lora_kernel

    if native and not lora_kernel.available():
        pytest.skip(f"no native LoRA kernel: {lora_kernel.failure_reason()}")
    monkeypatch.setattr(lora_kernel, "available", lambda: native)
    _, mgr = _manager()
    assert mgr.slot_major_a == native
    s = mgr.activate([_req(tmp_path, 1)])[1]
    for st in mgr.stacks:
        for a, b in st.values():
            a_cat, b_cat = stacked_views(a, b)
            w = a.shape[2]
            assert a.is_contiguous() == native and a[s].is_contiguous() == native
            assert (a_cat.data_ptr() == a.data_ptr()) != native and b_cat.data_ptr() == b.data_ptr()
            assert torch.equal(a_cat[:, s * w : (s + 1) * w], a[s])
            assert torch.equal(b_cat[s * w : (s + 1) * w], b[s])
    assert any(bool(a[s].abs().sum() > 0) for st in mgr.stacks for a, _ in st.values())
