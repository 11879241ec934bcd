"""The step-time floor's arithmetic: hand-computed FLOPs and bytes of a tiny config, and the
parameter and FLOP counts of transformers models of the same configs (``FlopCounterMode``)."""

from __future__ import annotations

import pytest
import torch

from kvserve.sim.roofline import (
    Cost,
    ModelShape,
    StepWork,
    causal_pairs,
    encode_step,
    offline_steps,
    run_cost,
    step_bytes,
    step_cost,
    step_flops,
    work_of_shape,
)

#: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 256, float32.
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def test_tiny_parameter_counts_by_hand():
    m = ModelShape.from_hf_config(TINY)
    # q 64x64, k and v 64x32 each, o 64x64
    assert m.attention_params() == 64 * 64 + 2 * 64 * 32 + 64 * 64 == 12288
    assert m.mlp_params() == 3 * 64 * 128 == 24576  # gate, up, down
    assert m.head_params() == 256 * 64
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4  # K and V, layers, KV heads, head_dim, float32
    assert m.flops_per_pair() == 4 * 2 * 4 * 16


def test_one_linear_layer_costs_two_flops_per_weight_per_row():
    # 64 -> 64 linear applied to 3 rows: 3 * 64 * 64 multiply-adds
    m = ModelShape(
        hidden_size=64,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=0,
        vocab_size=1,
    )
    only_linear = step_flops(m, StepWork(prefill_tokens=3)) - 0  # no pairs, no sampled rows
    # the layer is q, k, v, o (4 matrices of 64 x 64) and an empty MLP
    assert only_linear == 2 * 3 * 4 * 64 * 64


def test_decode_step_flops_and_bytes_by_hand():
    m = ModelShape.from_hf_config(TINY)
    w = StepWork(decode_seqs=1, context_tokens=10, sampled_rows=1)
    linear = 2 * 2 * 36864  # 2 FLOPs x 2 layers x (12288 + 24576) weights x 1 row
    head = 2 * 256 * 64
    attention = 4 * 2 * 4 * 16 * 10  # per pair: score + value sum, per layer and head
    assert step_flops(m, w) == linear + head + attention == 185344
    weights = (2 * 36864 + 256 * 64) * 4
    embed_row = 64 * 4
    kv = 512 * 10 + 512  # 10 positions read, the new token's K and V written
    assert step_bytes(m, w) == weights + embed_row + kv == 366336


def test_bfloat16_halves_the_bytes_not_the_flops():
    f32 = ModelShape.from_hf_config(TINY, "float32")
    bf16 = ModelShape.from_hf_config(TINY, "bfloat16")
    w = StepWork(decode_seqs=4, context_tokens=100, sampled_rows=4)
    assert step_bytes(bf16, w) == step_bytes(f32, w) / 2
    assert step_flops(bf16, w) == step_flops(f32, w)


def test_causal_pairs_count_each_query_seeing_its_prefix_and_itself():
    # 3 new tokens after 2 cached: they see 3, 4 and 5 positions
    assert causal_pairs(3, 2) == 3 + 4 + 5
    assert causal_pairs(1, 0) == 1


def test_offline_steps_one_prefill_then_decodes_of_the_living_requests():
    steps = offline_steps([(3, 2), (5, 1)])
    assert steps[0] == StepWork(prefill_tokens=8, prefill_pairs=6 + 15, sampled_rows=2)
    # the (3, 2) request's second token: prompt 3 + its first token = 4 positions
    assert steps[1:] == [StepWork(decode_seqs=1, context_tokens=4, sampled_rows=1)]
    with pytest.raises(ValueError, match="output_len >= 1"):
        offline_steps([(3, 0)])


def test_floor_is_the_larger_of_compute_and_memory_time():
    fl = Cost(flops=2e9, bytes=3e9, steps=1).floor(peak_flops=1e9, bandwidth=2e9)
    assert (fl.compute_s, fl.memory_s, fl.seconds, fl.bound) == (2.0, 1.5, 2.0, "compute")
    fl = Cost(flops=1e9, bytes=4e9).floor(1e9, 2e9)
    assert (fl.seconds, fl.bound) == (2.0, "memory")
    with pytest.raises(ValueError, match="positive"):
        Cost(1.0, 1.0).floor(0.0, 1.0)


def test_run_cost_sums_steps_and_skips_empty_ones():
    m = ModelShape.from_hf_config(TINY)
    a, b = StepWork(prefill_tokens=5, prefill_pairs=15, sampled_rows=1), StepWork()
    total = run_cost(m, [a, b, a])
    one = step_cost(m, a)
    assert (total.flops, total.bytes, total.steps) == (2 * one.flops, 2 * one.bytes, 2)


def test_moe_reads_expected_distinct_experts():
    cfg = {**TINY, "num_local_experts": 8, "num_experts_per_tok": 2}
    m = ModelShape.from_hf_config(cfg)
    expert = 3 * 64 * 128
    assert m.mlp_params() == 2 * expert + 64 * 8  # two experts and the router per token
    one_token = m.step_weight_bytes(1) / 4 - m.head_params()
    assert one_token == pytest.approx(2 * (12288 + 2 * expert + 64 * 8))  # 2 layers
    many = m.step_weight_bytes(10_000) / 4 - m.head_params()
    assert many == pytest.approx(2 * (12288 + 8 * expert + 64 * 8))  # every expert


def test_unknown_dtype_and_missing_sizes_are_errors():
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelShape.from_hf_config(TINY, "float8")
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_attention_heads": 2})


def _stored_linear_params(model) -> int:
    """Every matrix (and stacked expert tensor) of the layers: parameters of 2+ dims that are
    not the embeddings, the LM head or position/type tables."""
    skip = ("embed", "lm_head", "pooler")
    return sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and not any(s in n for s in skip)
    )


@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
)
def test_parameter_counts_match_transformers(family, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {k: v for k, v in TINY.items() if k != "model_type"}
    cfg = AutoConfig.for_model(family, **sizes, **extra, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    m = ModelShape.from_hf_config(cfg.to_dict())
    stored = m.attention_params() + (
        m.num_experts * m.expert_params() + m.hidden_size * m.num_experts if m.num_experts else m.mlp_params()
    )
    assert m.num_layers * stored == _stored_linear_params(model)
    assert m.head_params() == model.lm_head.weight.numel()


def _counted_flops(model, **inputs) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return counter.get_total_flops()


def test_encoder_step_flops_match_the_flop_counter_on_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    model = BertModel(cfg, add_pooling_layer=False)
    model.set_attn_implementation("eager")  # attention as two matmuls the counter sees
    model.eval()
    m = ModelShape.from_hf_config({**cfg.to_dict(), "architectures": ["BertModel"]})
    assert not m.causal and not m.lm_head and not m.gated_mlp
    assert m.num_layers * m.layer_params() == _stored_linear_params(model)
    ids = torch.randint(0, 100, (1, 11))
    assert step_flops(m, encode_step([11])) == _counted_flops(model, input_ids=ids)


def test_decoder_prefill_flops_match_the_flop_counter_on_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    sizes = {k: v for k, v in TINY.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(LlamaConfig(**sizes), attn_implementation="eager").eval()
    m = ModelShape.from_hf_config(TINY)
    s = 9
    counted = _counted_flops(model, input_ids=torch.randint(0, 256, (1, s)), logits_to_keep=1)
    # eager attention: two matmuls over every query x key pair (the causal mask applied after),
    # so the counter charges it as dense: so does this row
    dense = StepWork(prefill_tokens=s, prefill_pairs=s * s, sampled_rows=1)
    assert step_flops(m, dense) == counted


def test_a_simulator_step_shape_prices_as_the_same_step():
    from kvserve.sim.step_shape import StepShape

    shape = StepShape(
        prefill_tokens=5,
        prefill_seqs=1,
        prefill_attn_pairs=0.015,
        decode_seqs=2,
        context_tokens=40,
        sampled_rows=3,
    )
    work = work_of_shape(shape)
    assert work == StepWork(
        prefill_tokens=5, prefill_pairs=15.0, decode_seqs=2, context_tokens=40, sampled_rows=3
    )
    m = ModelShape.from_hf_config(TINY)
    assert step_flops(m, work) == 2 * 2 * 36864 * 7 + 3 * 2 * 256 * 64 + m.flops_per_pair() * 55
