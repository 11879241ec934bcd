"""The default model (SmolLM2-135M-Instruct) with two random adapters and the base model in one
batch: greedy equals transformers + peft per request."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.lora_request import LoRARequest
from tests.engine.test_e2e_tiny import assert_idle
from tests.golden import compare, hf_greedy
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter, peft_reference

pytestmark = pytest.mark.slow

pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
MAX_NEW = 8


def test_default_model_two_adapters_and_base_equal_peft(default_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    specs = [(8, ["q_proj", "v_proj", "o_proj"], False, 1), (16, ALL_TARGETS, True, 2)]
    reqs = []
    for r, targets, rs, seed in specs:
        path = make_peft_adapter(base, tmp_path / f"a{seed}", r, targets, alpha=r / 4, rslora=rs, seed=seed)
        reqs.append(LoRARequest(f"a{seed}", seed, path))
    llm = LLM(kv_cache_memory_gib=0.25, enable_lora=True, max_loras=2, max_lora_rank=16)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[*reqs, None],
    )
    models = [peft_reference(base, r.lora_path) for r in reqs] + [base]
    refs = [hf_greedy(m, i, MAX_NEW) for m, i in zip(models, ids)]
    near = sum(compare(o.outputs[0].token_ids, ref) for o, ref in zip(outs, refs))
    print(f"near-ties: {near} of {len(PROMPTS)}")
    plain = [hf_greedy(base, i, MAX_NEW).token_ids for i in ids[:2]]
    for ref, p in zip(refs, plain):
        assert ref.token_ids != p  # each adapter changes the answer
    assert_idle(llm.llm_engine)
