"""LoRA adapters on the mixture-of-experts families: PEFT adapters made with peft on each tiny
model target the attention linears and, where a model has them, the dense layers' MLP linears
(``mlp_only_layers`` / ``decoder_sparse_step``) and the shared expert's; served in one batch with
the base model, greedy tokens equal transformers + peft's (unmerged), log-probabilities within
1e-4. Adapters on the routed experts or the routers are refused naming the family and the
target."""

from __future__ import annotations

import re

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.lora.peft import ModelShapes, load_peft_adapter
from kvserve.lora_request import LoRARequest
from kvserve.model_executor.models.moe import MoeBlock
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter, peft_reference, write_adapter
from tests.model_executor.family_checks import hf_greedy, prompts_of, save_family
from tests.model_executor.test_family_moe import _config

pytest.importorskip("peft")

#: kind -> (adapter targets, whether it runs in the quick tier). Qwen2-MoE: attention, a dense
#: layer and shared experts. On the others peft (with transformers' stacked experts) turns MLP
#: target names into expert ``target_parameters``, which are refused (below): attention only.
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
KINDS = {
    "qwen2_moe_shared": (ALL_TARGETS, True),
    "qwen3_moe": (ATTENTION, False),
    "mixtral_top2": (ATTENTION, False),
    "olmoe": (ATTENTION, False),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def made(tmp_path_factory, default_tokenizer_dir):
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"lora-{kind}")
            hf = save_family(path, _config(kind), default_tokenizer_dir)
            adapter = make_peft_adapter(
                hf, tmp_path_factory.mktemp(f"adapter-{kind}"), 4, KINDS[kind][0], alpha=8.0, seed=1
            )
            cache[kind] = (path, hf, adapter, peft_reference(hf, adapter))
        return cache[kind]

    return get


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=() if q else pytest.mark.slow) for k, (_, q) in KINDS.items()]
)
def test_moe_adapter_and_base_rows_in_one_batch_equal_transformers_and_peft(made, kind):
    path, hf, adapter, ref = made(kind)
    prompts = prompts_of(4, [13, 37, 22, 9])
    lora = LoRARequest(f"{kind}-adapter", 1, adapter)
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
        model = llm.llm_engine.executor.model
        for i, layer in enumerate(model.layers):
            mlp = model.lora_mlp(i)
            want_mlp = layer.mlp.shared_expert if isinstance(layer.mlp, MoeBlock) else layer.mlp
            assert mlp is want_mlp
            assert (mlp is not None and mlp.lora_stacks is not None) == (mlp is not None)
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


def test_moe_adapter_shapes_follow_each_layer():
    """Qwen2-MoE with ``mlp_only_layers=[1]``: layer 1's MLP linears are the dense
    ``intermediate_size``, layers 0 and 2 the shared expert's; Qwen3-MoE's sparse layer has
    none."""
    shapes = ModelShapes.from_hf_config(_config("qwen2_moe_shared"))
    assert shapes.family == "Qwen2MoeForCausalLM"
    assert shapes.mlp == {0: ("mlp.shared_expert", 48), 1: ("mlp", 80), 2: ("mlp.shared_expert", 48)}
    assert shapes.layer_in_out(1, "down_proj") == (80, 64)
    assert shapes.layer_in_out(2, "up_proj") == (64, 48)
    q3 = ModelShapes.from_hf_config(_config("qwen3_moe"))
    assert q3.mlp_parent(1) is None and q3.mlp_parent(0) == "mlp"


def _write(tmp_path, name: str, targets, tensors: dict) -> str:
    return write_adapter(tmp_path / name, dict(r=2, lora_alpha=4, target_modules=targets), tensors)


def test_adapters_on_experts_or_routers_are_refused_naming_the_family_and_target(tmp_path):
    a, p = torch.randn(2, 64), "base_model.model.model.layers.0."
    mixtral = ModelShapes.from_hf_config(_config("mixtral_top2"))
    path = _write(tmp_path, "w1", ["w1"], {})
    with pytest.raises(
        ValueError, match=r"target_modules has 'w1'.*MixtralForCausalLM takes LoRA adapters on its"
    ):
        load_peft_adapter(path, 1, mixtral, 8)
    cases = [
        (mixtral, "block_sparse_moe.experts.0.w1", "MixtralForCausalLM"),
        (mixtral, "mlp.experts.3.gate_proj", "MixtralForCausalLM"),
        (
            ModelShapes.from_hf_config(_config("qwen2_moe_shared")),
            "mlp.shared_expert_gate",
            "Qwen2MoeForCausalLM",
        ),
        (ModelShapes.from_hf_config(_config("olmoe")), "mlp.gate", "OlmoeForCausalLM"),
    ]
    for i, (shapes, target, family) in enumerate(cases):
        t = {p + target + ".lora_A.weight": a, p + target + ".lora_B.weight": torch.randn(8, 2)}
        path = _write(tmp_path, f"case{i}", "all-linear", t)
        with pytest.raises(ValueError, match=re.escape(f"targets {target}: {family} takes LoRA")):
            load_peft_adapter(path, 1, shapes, 8)
    # a dense-MLP target on an expert-only layer (Qwen3-MoE's layer 1) names what the layer has
    q3 = ModelShapes.from_hf_config(_config("qwen3_moe"))
    t = {
        "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight": a,
        "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight": torch.randn(80, 2),
    }
    with pytest.raises(ValueError, match="layer 1 of Qwen3MoeForCausalLM has only routed experts"):
        load_peft_adapter(_write(tmp_path, "sparse", ["gate_proj"], t), 1, q3, 8)


@pytest.mark.slow
def test_peft_expert_adapter_is_refused_naming_the_family(tmp_path, default_tokenizer_dir):
    """peft makes MLP target names on Qwen3-MoE expert ``target_parameters``: refused when read."""
    from transformers import AutoModelForCausalLM

    cfg = _config("qwen3_moe")
    hf = AutoModelForCausalLM.from_config(cfg)
    path = make_peft_adapter(hf, tmp_path / "experts", 4, ALL_TARGETS)
    with pytest.raises(ValueError, match="target_parameters=.*Qwen3MoeForCausalLM takes LoRA adapters"):
        load_peft_adapter(path, 1, ModelShapes.from_hf_config(cfg), 8)
