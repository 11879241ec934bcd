"""LoRA adapters on the families beyond Llama (Qwen3, Phi-3, Gemma 2, Gemma 3): PEFT adapters made
with peft on each tiny model, on attention and dense MLP linears (Phi-3's fused ``qkv_proj`` /
``gate_up_proj``, what peft names them), served in one batch with the base model: greedy tokens
equal transformers + peft's, log-probabilities within 1e-4."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.lora.peft import ModelShapes, load_peft_adapter
from kvserve.lora_request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter, peft_reference
from tests.model_executor.family_checks import hf_greedy, prompts_of, save_family
from tests.model_executor.test_family_gemma import _gemma2, _gemma3
from tests.model_executor.test_family_phi3 import CONFIGS as PHI3_CONFIGS
from tests.model_executor.test_family_phi3 import phi3_config
from tests.model_executor.test_family_qwen3 import CONFIGS as QWEN3_CONFIGS
from tests.model_executor.test_family_qwen3 import qwen3_config

pytest.importorskip("peft")

#: family -> (config, the adapter's target modules)
FAMILIES = {
    "qwen3": (lambda: qwen3_config(**QWEN3_CONFIGS["gqa-untied"]), ALL_TARGETS),
    # peft's names for Phi-3's fused linears ("all-linear" picks the same four)
    "phi3": (
        lambda: phi3_config(**PHI3_CONFIGS["gqa-longrope"]),
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    ),
    "gemma3": (lambda: _gemma3(), ALL_TARGETS),
    "gemma2": (lambda: _gemma2(), ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, default_tokenizer_dir):
    """(family, checkpoint dir, transformers model, adapter dir, its peft reference model)."""
    name = request.param
    make_config, targets = FAMILIES[name]
    path = tmp_path_factory.mktemp(f"lora-{name}")
    hf = save_family(path, make_config(), default_tokenizer_dir)
    adapter = make_peft_adapter(hf, tmp_path_factory.mktemp(f"adapter-{name}"), 4, targets, alpha=8.0, seed=1)
    return name, path, hf, adapter, peft_reference(hf, adapter)


def _scaled_copy(adapter: str, path, factor: float) -> str:
    """A copy of PEFT directory ``adapter`` with every weight multiplied by ``factor``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, path)
    w = f"{path}/adapter_model.safetensors"
    save_file({k: v * factor for k, v in load_file(w).items()}, w)
    return str(path)


def test_adapter_and_base_rows_in_one_batch_equal_transformers_and_peft(family, tmp_path):
    name, path, hf, adapter, ref = family
    prompts = prompts_of(4, [13, 37, 22, 9])  # Phi-3: the second prompt passes LongRoPE's 32
    lora = LoRARequest(f"{name}-adapter", 1, adapter)
    use = [lora, None, lora, lora]
    want = [hf_greedy(ref if r else hf, p, MAX_TOKENS) for p, r in zip(prompts, use)]
    llm = LLM(model=str(path), dtype="float32", seed=0, enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
            lora_request=use,
        )
        # the load probe runs this family's forward (Gemma: per-window metadata, offset norms):
        # the same adapter with weights 1e15 times larger is refused by name
        huge = _scaled_copy(adapter, tmp_path / "huge", 1e15)
        with pytest.raises(ValueError, match=r"LoRA adapter 'huge' .*probe forward of 8 tokens"):
            llm.llm_engine.add_lora(LoRARequest("huge", 2, huge))
    finally:
        llm.shutdown()
    for out, (tokens, lps) in zip(outs, want):
        c = out.outputs[0]
        assert list(c.token_ids) == tokens, (list(c.token_ids), tokens)
        got = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, (got, lps)
    # the adapter changed the answers (the check is not base vs base)
    base_tokens, base_lps = hf_greedy(hf, prompts[0], MAX_TOKENS)
    assert want[0][0] != base_tokens or max(abs(a - b) for a, b in zip(want[0][1], base_lps)) > 1e-2


def test_phi3_fused_adapter_is_stored_per_part_with_a_shared_a(tmp_path, default_tokenizer_dir):
    """A ``qkv_proj`` LoRA is the q, k and v parts' LoRAs with one ``A`` and ``B``'s rows of each
    part; an adapter on ``qkv_proj`` and ``q_proj`` both adapts q twice: refused, naming both."""
    from tests.lora.adapters import write_adapter

    cfg = phi3_config(**PHI3_CONFIGS["gqa-longrope"], num_hidden_layers=1)
    shapes = ModelShapes.from_hf_config(cfg)
    assert shapes.fused and shapes.in_out["k_proj"] == (64, 32)
    a, b = torch.randn(2, 64), torch.randn(64 + 32 + 32, 2)
    p = "base_model.model.model.layers.0.self_attn."
    conf = dict(r=2, lora_alpha=4, target_modules=["qkv_proj", "q_proj"])
    path = write_adapter(
        tmp_path / "ok", conf, {p + "qkv_proj.lora_A.weight": a, p + "qkv_proj.lora_B.weight": b}
    )
    model = load_peft_adapter(path, 1, shapes, 8)
    for part, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)), ("v_proj", slice(96, 128))):
        la, lb = model.weights[(0, part)]
        torch.testing.assert_close(la, a)
        torch.testing.assert_close(lb, b[rows] * 2.0)
    twice = {
        p + "qkv_proj.lora_A.weight": a,
        p + "qkv_proj.lora_B.weight": b,
        p + "q_proj.lora_A.weight": a.clone(),
        p + "q_proj.lora_B.weight": b[:64].clone(),
    }
    path = write_adapter(tmp_path / "twice", conf, twice)
    with pytest.raises(ValueError, match="q_proj is adapted twice, by qkv_proj and by q_proj"):
        load_peft_adapter(path, 1, shapes, 8)
    # a model whose linears are not fused has no qkv_proj
    llama_shapes = ModelShapes.from_hf_config(qwen3_config())
    with pytest.raises(ValueError, match="qkv_proj; supported target modules of this model"):
        load_peft_adapter(tmp_path / "ok", 1, llama_shapes, 8)
