"""``quantization="int8"`` / ``"int4"`` on the mixture-of-experts families (Mixtral, Qwen2-MoE with
its shared expert and a dense layer, Qwen3-MoE, OLMoE): attention, dense and expert linears
quantized at load (experts one weight each), routers float; greedy tokens equal transformers',
log-probabilities within 1e-4, when transformers runs on the same weights dequantized."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvserve.model_executor.layers.fused_moe import FusedMoE
from kvserve.model_executor.model_loader import load_model, quantized_weight_types
from kvserve.model_executor.models.moe import MoeBlock
from kvserve.ops import quant
from tests.model_executor.family_checks import hf_greedy, save_family
from tests.model_executor.test_family_quantization import VOCAB, _greedy_with_logprobs, _set
from tests.model_executor.test_gguf_quantized import prefill_logits

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def moe_config(kind: str):
    """Tiny configs whose linears all take 32-weight blocks (hidden and every intermediate size
    a multiple of 32)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "mixtral":
        return MixtralConfig(**BASE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(
            **{**BASE, "num_hidden_layers": 3},
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**BASE, "num_hidden_layers": 3},
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        )
    if kind == "olmoe":
        return OlmoeConfig(
            **BASE,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=3.0,
        )
    raise KeyError(kind)


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
#: Family x method pairs of the quick tier (both methods; Qwen2-MoE's shared expert and dense
#: layer, OLMoE's whole-projection norms); the others are in the slow tier.
QUICK = {("qwen2_moe", "int8"), ("olmoe", "int4")}
MAX_TOKENS = 10


@pytest.fixture(autouse=True, scope="module")
def float_activations():
    """The references are float-activation results (as ``test_family_quantization``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.ACT_ENV, "float")
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory, default_tokenizer_dir):
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"moe-quant-{kind}")
            cache[kind] = (path, save_family(path, moe_config(kind), default_tokenizer_dir))
        return cache[kind]

    return get


def _set_dense(hf_mlp: nn.Module, ours) -> None:
    gate_up = quant.dequantize(ours.gate_up_weight)
    _set(hf_mlp.gate_proj, gate_up[: ours.inter])
    _set(hf_mlp.up_proj, gate_up[ours.inter :])
    _set(hf_mlp.down_proj, quant.dequantize(ours.down_weight))


def dequantized_moe_reference(hf, model):
    """A copy of ``hf`` whose attention, dense, shared-expert and expert weights (and LM head)
    are ``model``'s quantized weights dequantized; routers and norms as they were."""
    ref = copy.deepcopy(hf)
    for layer, ours in zip(ref.model.layers, model.layers):
        a = ours.self_attn
        q, k, v = quant.dequantize(a.qkv_weight).split([a.q_size, a.kv_size, a.kv_size])
        for name, w in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            _set(getattr(layer.self_attn, name), w)
        _set(layer.self_attn.o_proj, quant.dequantize(a.o_weight))
        if not isinstance(ours.mlp, MoeBlock):
            _set_dense(layer.mlp, ours.mlp)
            continue
        moe = ours.mlp.experts
        experts = layer.mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(torch.stack([quant.dequantize(w) for w in moe.w13_q]))
            experts.down_proj.copy_(torch.stack([quant.dequantize(w) for w in moe.w2_q]))
        if ours.mlp.shared_expert is not None:
            _set_dense(layer.mlp.shared_expert, ours.mlp.shared_expert)
    _set(ref.lm_head, quant.dequantize(model.lm_head)[: hf.config.vocab_size])
    return ref.eval()


@pytest.mark.parametrize(
    "kind, method",
    [
        pytest.param(k, m, marks=() if (k, m) in QUICK else pytest.mark.slow)
        for k in KINDS
        for m in ("int8", "int4")
    ],
)
def test_quantized_moe_equals_transformers_on_the_dequantized_weights(saved, kind, method):
    path, hf = saved(kind)
    model = load_model(path, torch.float32, "cpu", quantization=method)
    qtype = "q8_0" if method == "int8" else "q4_1"
    sparse, expert_weights = 0, 0
    for layer in model.layers:
        assert layer.self_attn.qkv_weight.qtype == qtype and layer.self_attn.o_weight.qtype == qtype
        if isinstance(layer.mlp, MoeBlock):
            sparse += 1
            moe = layer.mlp.experts
            expert_weights += 2 * moe.num_experts
            assert isinstance(moe, FusedMoE) and not hasattr(moe, "w13") and not hasattr(moe, "w2")
            assert len(moe.w13_q) == len(moe.w2_q) == moe.num_experts
            assert all(w.qtype == qtype for w in moe.w13_q + moe.w2_q)
            assert moe.gate.dtype == torch.float32  # the router stays float
        else:
            assert layer.mlp.gate_up_weight.qtype == qtype
    assert sparse > 0
    # every expert counted: attention (2 per layer) + dense or shared MLPs + experts + LM head
    assert sum(quantized_weight_types(model).values()) > expert_weights + 2 * len(model.layers)
    ref = dequantized_moe_reference(hf, model)
    prompts = [[(7 + 31 * i) % VOCAB for i in range(19)], [(5 + 113 * i) % VOCAB for i in range(40)]]
    with torch.no_grad():
        float_logits = hf(torch.tensor([prompts[0]])).logits[0]
    # the quantization moved the answers: the check is not float vs float in disguise
    assert not torch.allclose(prefill_logits(model, prompts[0]), float_logits, atol=1e-3)
    for prompt in prompts:
        want_tokens, want_lps = hf_greedy(ref, prompt, MAX_TOKENS)
        tokens, lps = _greedy_with_logprobs(model, prompt, MAX_TOKENS)
        assert tokens == want_tokens
        err = max(abs(a - b) for a, b in zip(lps, want_lps))
        assert err < 1e-4, (err, lps, want_lps)


def test_ragged_expert_size_is_refused_naming_the_experts(tmp_path, default_tokenizer_dir):
    from transformers import MixtralConfig

    cfg = MixtralConfig(**{**BASE, "num_hidden_layers": 1}, intermediate_size=48, num_local_experts=4)
    save_family(tmp_path, cfg, default_tokenizer_dir)
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.\*\.w2 \(in_features=48\)"):
        load_model(tmp_path, torch.float32, "cpu", quantization="int8")
