"""max_loras=1, max_cpu_loras=1, three adapters and the base model on a tiny KV cache (so
requests are preempted by swap or recompute) with aborts mid-run: every request ends and says
how, the blocks all come back, and the survivors' tokens equal their solo runs."""

import pytest
from transformers import AutoConfig

from kvserve import LLM, SamplingParams
from kvserve.lora.peft import ModelShapes
from kvserve.lora_request import LoRARequest
from tests.engine.test_e2e_tiny import assert_idle
from tests.lora.adapters import lora_tensors, write_adapter

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "mode, dtype",
    [("swap", "float32"), ("recompute", "float32"), ("swap", "bfloat16"), ("recompute", "bfloat16")],
)
def test_one_slot_many_adapters_tiny_cache_with_aborts_every_request_ends(
    tiny_llama_dir, tmp_path, mode, dtype
):
    """bfloat16 too: its adapters' slots and deltas are float32 (the swapped / recomputed
    requests must get the same float32 deltas back)."""
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}
    loras = [
        LoRARequest(
            f"l{i}",
            i,
            write_adapter(
                tmp_path / f"l{i}",
                cfg,
                lora_tensors(shapes.num_layers, shapes.in_out, 4, ("q_proj", "down_proj"), seed=i),
            ),
        )
        for i in (1, 2, 3)
    ]
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype=dtype,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=4,
        block_size=4,
        num_gpu_blocks=10,
        num_cpu_blocks=64,
        preemption_mode=mode,
        enable_prefix_caching=True,
    )
    eng = llm.llm_engine
    reqs = []
    for k in range(8):
        lora = None if k % 4 == 3 else loras[k % 4 % 3]
        prompt = {"prompt_token_ids": [3 + k, 4, 5, 6, 7, 8 + k % 3]}
        reqs.append((f"r{k}", prompt, lora))
        eng.add_request(f"r{k}", prompt, PARAMS, lora_request=lora)
    aborted = {"r2", "r5"}
    ends: dict[str, object] = {}
    for step in range(400):
        if not eng.has_unfinished_requests():
            break
        if step == 3:
            eng.abort_request(sorted(aborted))
        for out in eng.step():
            if out.finished:
                assert out.request_id not in ends
                ends[out.request_id] = out
    assert not eng.has_unfinished_requests(), "a request never ended"
    assert eng.scheduler.num_preemptions > 0  # the tiny cache did preempt
    assert set(ends) == {r[0] for r in reqs}
    assert_idle(eng)
    for rid, prompt, lora in reqs:
        out = ends[rid]
        if rid in aborted and out.outcome == "aborted":
            continue
        assert out.outcome == "finished", (rid, out.outcome, out.error)
        solo = llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids, rid
    assert_idle(eng)


def test_prefix_cache_never_serves_one_adapters_blocks_to_another(tiny_llama_dir, tmp_path):
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 64, "target_modules": ["k_proj", "v_proj"]}
    loras = [
        LoRARequest(
            f"p{i}",
            i,
            write_adapter(
                tmp_path / f"p{i}",
                cfg,
                lora_tensors(shapes.num_layers, shapes.in_out, 4, ("k_proj", "v_proj"), seed=i),
            ),
        )
        for i in (1, 2)
    ]
    prompt = {"prompt_token_ids": list(range(20, 37))}  # 4 full blocks of 4 and one token
    kw = dict(model=str(tiny_llama_dir), enable_lora=True, max_loras=1, max_lora_rank=4, block_size=4)
    cached = LLM(enable_prefix_caching=True, **kw)
    got = {}
    for lora in [None, loras[0], loras[1], None, loras[0]]:
        out = cached.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0]
        got.setdefault(lora and lora.lora_name, []).append(out.outputs[0].token_ids)
    assert cached.llm_engine.get_kv_cache_stats()["prefix_cache_hit_rate"] > 0  # it did reuse
    plain = LLM(enable_prefix_caching=False, **kw)
    for lora in [None, loras[0], loras[1]]:
        ref = plain.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
        assert all(t == ref for t in got[lora and lora.lora_name]), lora
    assert len({tuple(v[0]) for v in got.values()}) == 3  # the adapters do change the output


def test_an_unloaded_id_naming_another_adapter_never_hits_the_old_adapters_blocks(tiny_llama_dir, tmp_path):
    """remove_lora, then the same lora_int_id for another adapter (allowed once no request
    holds it): the blocks the first adapter left in the prefix cache were keyed by the id
    alone, so the second one's prompt hit all of them and decoded from the first adapter's
    K/V. Same prompt, same id: the second adapter's tokens equal a cache-free run."""
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 64, "target_modules": ["k_proj", "v_proj"]}
    first, second = (
        LoRARequest(
            name,
            7,
            write_adapter(
                tmp_path / name,
                cfg,
                lora_tensors(shapes.num_layers, shapes.in_out, 4, ("k_proj", "v_proj"), seed=seed),
            ),
        )
        for name, seed in (("first", 1), ("second", 2))
    )
    prompt = {"prompt_token_ids": list(range(20, 37))}  # 4 full blocks of 4 and one token
    kw = dict(model=str(tiny_llama_dir), enable_lora=True, max_loras=1, max_lora_rank=4, block_size=4)
    cached = LLM(enable_prefix_caching=True, **kw)
    cached.generate([prompt], PARAMS, use_tqdm=False, lora_request=first)
    assert cached.llm_engine.remove_lora(7)
    out = cached.generate([prompt], PARAMS, use_tqdm=False, lora_request=second)[0]
    assert out.num_cached_tokens == 0  # nothing of the first adapter's was reused
    again = cached.generate([prompt], PARAMS, use_tqdm=False, lora_request=second)[0]
    assert again.num_cached_tokens == 16  # the second adapter's own blocks are
    plain = LLM(enable_prefix_caching=False, **kw)
    ref = plain.generate([prompt], PARAMS, use_tqdm=False, lora_request=second)[0].outputs[0].token_ids
    plain.llm_engine.remove_lora(7)
    first_ref = plain.generate([prompt], PARAMS, use_tqdm=False, lora_request=first)[0].outputs[0].token_ids
    assert ref != first_ref  # the adapters do change the output
    assert out.outputs[0].token_ids == ref and again.outputs[0].token_ids == ref
    assert_idle(cached.llm_engine)
