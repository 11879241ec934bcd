"""Slot turnover on the real engine (a tiny random Llama, real adapters): preempting a
straggler so its adapter's slot turns over never changes a greedy token."""

import pytest
from transformers import AutoConfig

from kvserve import LLM, SamplingParams
from kvserve.lora.peft import ModelShapes
from kvserve.lora_request import LoRARequest
from tests.engine.test_e2e_tiny import assert_idle
from tests.lora.adapters import lora_tensors, write_adapter


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_outputs_with_slot_turnover_equal_those_without(tiny_llama_dir, tmp_path, prefix_caching):
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))
    targets = ("q_proj", "v_proj", "down_proj")
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": list(targets)}
    loras = [
        LoRARequest(
            f"t{i}",
            i,
            write_adapter(
                tmp_path / f"t{i}", cfg, lora_tensors(shapes.num_layers, shapes.in_out, 4, targets, seed=i)
            ),
        )
        for i in (1, 2, 3)
    ]
    # per adapter: one long request (the straggler) and two short ones
    prompts, params, reqs = [], [], []
    for k in range(9):
        prompts.append({"prompt_token_ids": [3 + k, 9, 4 + k % 2, 7, 11 + k]})
        params.append(SamplingParams(max_tokens=14 if k % 3 == 0 else 3, temperature=0, ignore_eos=True))
        reqs.append(loras[k // 3])
    runs = {}
    for msp in (0, 1):
        llm = LLM(
            model=str(tiny_llama_dir),
            enable_lora=True,
            max_loras=1,
            max_cpu_loras=3,
            max_lora_rank=4,
            max_slot_preemptions=msp,
            enable_prefix_caching=prefix_caching,
        )
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=reqs)
        assert [o.outcome for o in outs] == ["finished"] * 9
        runs[msp] = [list(o.outputs[0].token_ids) for o in outs]
        sched = llm.llm_engine.scheduler
        assert (sched.num_slot_preemptions > 0) == (msp == 1), sched.num_slot_preemptions
        assert_idle(llm.llm_engine)
    assert runs[1] == runs[0]
    assert [len(t) for t in runs[1]] == [14 if k % 3 == 0 else 3 for k in range(9)]
