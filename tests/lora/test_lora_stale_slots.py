"""Slots no row of a step uses must add exactly nothing. The stacked op runs every row through
slots ``0 .. k-1`` and zeroed the other slots' columns by multiplying with a 0/1 mask: a slot
whose ``x @ A`` overflows (an adapter with huge but finite weights, which load validation
accepts) gave ``inf * 0 = nan`` in every other row of the step, base rows included; and
``remove_lora`` left the removed adapter's weights in its slot, so such a slot kept poisoning
steps after the adapter was gone. Now the mask is a fill (an inf there becomes 0) and a freed
slot is zeroed."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.lora_request import LoRARequest
from kvserve.model_executor.layers.lora import LoRAMapping, add_lora
from tests.lora.adapters import lora_tensors, write_adapter
from tests.lora.test_lora_adapters import _manager, _req

#: finite in float32, but a row of ``x @ A`` over it overflows to inf
HUGE = 3.0e38


def _slot_weights(mgr, slot):
    return [t[slot] for st_ in mgr.stacks for ab in st_.values() for t in ab]


def test_remove_lora_zeroes_its_device_slot(tmp_path):
    _, mgr = _manager(max_loras=2)
    r1, r2 = _req(tmp_path, 1), _req(tmp_path, 2)
    slots = mgr.activate([r1, r2])
    assert any(bool(w.abs().sum() > 0) for w in _slot_weights(mgr, slots[1]))
    assert mgr.remove_lora(1)
    assert all(bool((w == 0).all()) for w in _slot_weights(mgr, slots[1]))
    assert any(bool(w.abs().sum() > 0) for w in _slot_weights(mgr, slots[2]))  # the other stays
    assert mgr.slot_of(1) is None and mgr.list_loras() == {2}


def test_reloading_an_evicted_id_zeroes_the_slot_its_old_copy_held(tmp_path):
    _, mgr = _manager(max_loras=1, max_cpu_loras=1)
    s = mgr.activate([_req(tmp_path, 1)])[1]
    mgr.add_lora(_req(tmp_path, 2))  # evicts 1 from the CPU cache; its slot still holds it
    mgr.add_lora(LoRARequest("l1", 1, _req(tmp_path, 9).lora_path))  # id 1 again, another path
    assert mgr.slot_of(1) is None
    assert all(bool((w == 0).all()) for w in _slot_weights(mgr, s))


@pytest.mark.parametrize("path", ["stacked", "segment"])
def test_a_slot_that_overflows_leaves_other_rows_exact(path):
    g = torch.Generator().manual_seed(0)
    T, fin, R, fout, S = 4, 16, 4, 8, 3
    x = torch.randn(T, fin, generator=g)
    out0 = torch.randn(T, fout, generator=g)
    a = torch.randn(S, fin, R, generator=g)
    b = torch.randn(S, R, fout, generator=g)
    a[0] = HUGE  # slot 0 (no row of the step uses it) overflows for every row
    b[0] = HUGE
    rows = [1, -1, 2, 1]
    out = out0.clone()
    add_lora(out, x, a, b, LoRAMapping.build(np.asarray(rows)), path=path)
    assert bool(torch.isfinite(out).all())
    for t, s in enumerate(rows):
        want = out0[t] if s < 0 else out0[t] + (x[t] @ a[s]) @ b[s]
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 3), min_size=1, max_size=12),
    poisoned=st.integers(0, 3),
    sign=st.sampled_from([1.0, -1.0]),
    seed=st.integers(0, 2**16),
)
def test_rows_of_other_slots_never_see_a_poisoned_slot(rows, poisoned, sign, seed):
    """Property: whichever slot overflows (used by some rows or by none), every row not on it
    gets exactly its own delta, in both forms of the op."""
    g = torch.Generator().manual_seed(seed)
    T, fin, R, fout, S = len(rows), 8, 2, 6, 4
    x = torch.randn(T, fin, generator=g)
    out0 = torch.randn(T, fout, generator=g)
    a = torch.randn(S, fin, R, generator=g)
    b = torch.randn(S, R, fout, generator=g)
    a[poisoned] = sign * HUGE
    b[poisoned] = HUGE
    mapping = LoRAMapping.build(np.asarray(rows))
    if mapping is None:
        return
    for path in ("stacked", "segment"):
        out = out0.clone()
        add_lora(out, x, a, b, mapping, path=path)
        for t, s in enumerate(rows):
            if s == poisoned:
                continue
            want = out0[t] if s < 0 else out0[t] + (x[t] @ a[s]) @ b[s]
            torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5, msg=f"{path} row {t}")


def test_removed_or_overflowing_adapter_never_changes_other_requests(tiny_llama_dir, tmp_path, monkeypatch):
    """Engine: an adapter of huge finite weights in slot 0 (the load probe, which refuses it,
    turned off: the op's row isolation is the line behind it), a normal one in slot 1. With it
    running, and after it is removed, the base model's and the normal adapter's greedy tokens
    are those of runs without it; every request ends one way."""
    from transformers import AutoConfig

    from kvserve import LLM, SamplingParams
    from kvserve.lora.manager import LoRAManager
    from kvserve.lora.peft import ModelShapes
    from tests.engine.test_e2e_tiny import assert_idle

    monkeypatch.setattr(LoRAManager, "_probe", lambda self, req, model: None)

    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "up_proj"]}
    t = lora_tensors(shapes.num_layers, shapes.in_out, 4, ("q_proj", "up_proj"))
    good = LoRARequest("good", 1, write_adapter(tmp_path / "good", cfg, t))
    huge_t = {k: torch.full_like(v, HUGE) if ".lora_A." in k else v for k, v in t.items()}
    huge = LoRARequest("huge", 2, write_adapter(tmp_path / "huge", cfg, huge_t))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    kw = dict(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=4, seed=0)

    def tokens(llm, prompts, loras):
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert all(o.finished for o in outs)
        return [o.outputs[0].token_ids for o in outs]

    ref = LLM(**kw)
    want = [tokens(ref, prompts[:1], None)[0], tokens(ref, prompts[1:], good)[0]]
    llm = LLM(**kw)
    tokens(llm, prompts[:1], huge)  # huge takes slot 0 (its own output is whatever it is)
    mgr = llm.llm_engine.executor.lora_manager
    assert mgr.slot_of(2) == 0
    # huge's requests in the same steps as a base and a good one (good in slot 1)
    got = tokens(llm, prompts * 2, [None, good, huge, huge])
    assert mgr.slot_of(1) == 1
    assert got[:2] == want
    assert llm.llm_engine.remove_lora(2)  # slot 0 freed; slot 1 stays the highest active
    assert tokens(llm, prompts, [None, good]) == want
    assert_idle(llm.llm_engine)
