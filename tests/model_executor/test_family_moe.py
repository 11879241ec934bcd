"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers, and
the grouped MoE layer against the per-expert loop."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model_executor.layers import fused_moe
from kvserve.model_executor.layers.fused_moe import FusedMoE
from tests.golden import NEAR_TIE, TEST_DEVICE, Reference, compare, hf_greedy_logits

ENGINE = dict(device=TEST_DEVICE, dtype="float32")
MAX_NEW = 12
PROMPT_LENS = [3, 19, 33, 9]
VOCAB = 49152  # the default tokenizer's

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


def _config(kind: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if kind == "mixtral_top2":
        return MixtralConfig(**BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    if kind == "mixtral_top1_mha":
        return MixtralConfig(
            **{**BASE, "num_key_value_heads": 4},
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=1,
        )
    if kind == "qwen2_moe_shared":
        return Qwen2MoeConfig(
            **{**BASE, "num_hidden_layers": 3},
            intermediate_size=80,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # a dense layer between sparse ones
        )
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **{**BASE, "num_hidden_layers": 3},
            head_dim=32,  # heads * head_dim != hidden
            intermediate_size=80,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,  # layer 1 sparse, layers 0 and 2 dense
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


KINDS = ["mixtral_top2", "mixtral_top1_mha", "qwen2_moe_shared", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    ps.append(ps[2][:24] + [rng.randrange(3, VOCAB) for _ in range(7)])  # shares a prefix
    return ps


_CACHE: dict = {}


def _model(kind, tmp_path_factory, tokenizer_dir):
    """``(model_dir, hf_model, references)`` of ``kind``, built once per module."""
    if kind not in _CACHE:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
        with torch.no_grad():
            hf.lm_head.weight.mul_(20.0)  # decisive greedy choices (fewer near-ties)
            # non-trivial norms and biases, so that their loading (and q/k norm shapes) is tested
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
        _CACHE[kind] = (path, hf.to(TEST_DEVICE).eval())
    return _CACHE[kind]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory, default_tokenizer_dir, prompts):
    path, hf = _model(request.param, tmp_path_factory, default_tokenizer_dir)
    refs = [hf_greedy_logits(hf, p, MAX_NEW) for p in prompts]
    return request.param, path, hf, refs


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kw)


def _check(outs, refs):
    """Greedy tokens equal the references up to the first near-tie; returns the near-ties met."""
    near = 0
    for out, (tokens, logits) in zip(outs, refs):
        gaps = [float(lg.topk(2).values[0] - lg.topk(2).values[1]) for lg in logits]
        step = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), None)
        near += compare(list(out.outputs[0].token_ids), Reference(tokens, step))
    return near


@pytest.mark.parametrize("family", KINDS, indirect=True)
def test_greedy_and_logprobs_equal_transformers(family, prompts):
    kind, path, hf, refs = family
    llm = LLM(model=str(path), **ENGINE, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=0), use_tqdm=False)
    _check(outs, refs)
    worst = 0.0
    for out, (tokens, logits) in zip(outs, refs):
        c = out.outputs[0]
        for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            if tok != tokens[step]:
                break  # past a near-tie
            want = torch.log_softmax(logits[step], -1)[tok].item()
            worst = max(worst, abs(lp[tok].logprob - want))
    assert worst < 1e-4, (kind, worst)
    llm.shutdown()


SCHEDULES = {
    "chunked_prefix_recompute": dict(
        preemption_mode="recompute", enable_chunked_prefill=True, enable_prefix_caching=True
    ),
    "chunked_prefix_swap": dict(
        preemption_mode="swap", enable_chunked_prefill=True, enable_prefix_caching=True
    ),
}


@pytest.mark.parametrize("family", ["mixtral_top2", "qwen2_moe_shared", "qwen3_moe", "olmoe"], indirect=True)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_under_preemption_chunking_and_prefix_cache(family, prompts, schedule):
    kind, path, hf, refs = family
    llm = LLM(
        model=str(path),
        **ENGINE,
        seed=0,
        block_size=4,
        num_gpu_blocks=22,
        num_cpu_blocks=64,
        max_num_batched_tokens=16,
        **SCHEDULES[schedule],
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    _check(outs, refs)
    stats = llm.llm_engine.get_kv_cache_stats()
    assert stats["num_preemptions"] > 0, "the tiny cache must force preemption"
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    llm.shutdown()


@pytest.mark.parametrize("family", ["qwen2_moe_shared"], indirect=True)
def test_greedy_under_ngram_speculation(family, prompts):
    """Speculative steps on a mixture-of-experts model (its layers have no dense
    ``gate_up_weight``; Qwen2-MoE's shared expert has one) keep transformers' greedy tokens."""
    kind, path, hf, refs = family
    llm = LLM(
        model=str(path),
        **ENGINE,
        seed=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    # prompts that repeat themselves, so that the n-gram proposer drafts
    outs = llm.generate([{"prompt_token_ids": p + p} for p in prompts[1:3]], _greedy(), use_tqdm=False)
    want = [hf_greedy_logits(hf, p + p, MAX_NEW) for p in prompts[1:3]]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    _check(outs, want)
    llm.shutdown()


# ---------------------------------------------------------------- the MoE layer


def _experts(E, H, I, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=dtype) * 0.2
    w2 = torch.randn(E, H, I, generator=g, dtype=dtype) * 0.2
    return w13, w2


@pytest.mark.parametrize("mode", ["auto", "native", "grouped_mm", "bmm", "loop"])
@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (37, 8, 2), (64, 16, 4), (5, 8, 8)])
def test_grouped_experts_equal_the_loop(mode, T, E, k):
    if mode == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no grouped GEMM")
    H, I = 32, 24
    w13, w2 = _experts(E, H, I)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    weights, experts = fused_moe.route(torch.randn(T, E, generator=g), k, renormalize=k > 1)
    ref = fused_moe.per_expert_loop(x, weights, experts, w13, w2)
    got = fused_moe.grouped_experts(x, weights, experts, w13, w2, mode)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["auto", "native", "grouped_mm", "bmm", "loop"])
def test_grouped_experts_one_expert_takes_all_and_empty_experts(mode):
    """Every token routed to expert 3 first (the others of 8 empty but one): the busiest
    expert's block is the whole batch, the empty ones are skipped."""
    if mode == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no grouped GEMM")
    T, E, H, I = 9, 8, 16, 8
    w13, w2 = _experts(E, H, I, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    experts = torch.tensor([[3, 5]] * T)
    weights = torch.tensor([[0.75, 0.25]] * T)
    ref = fused_moe.per_expert_loop(x, weights, experts, w13, w2)
    got = fused_moe.grouped_experts(x, weights, experts, w13, w2, mode)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    # the same by hand: 0.75 * expert 3 + 0.25 * expert 5
    def mlp(e):
        gu = x @ w13[e].T
        return (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T

    torch.testing.assert_close(got, 0.75 * mlp(3) + 0.25 * mlp(5), rtol=1e-5, atol=1e-5)
    empty = fused_moe.grouped_experts(x[:0], weights[:0], experts[:0], w13, w2, mode)
    assert empty.shape == (0, H)


@pytest.mark.parametrize("method", [None, "int8", "int4"])
def test_looped_experts_equal_the_loop_on_float_and_quantized_weights(method, monkeypatch):
    """``looped_experts`` (what quantized experts run) on per-expert weights: float ones give
    the per-expert loop's result; quantized ones (float activations) the loop's on their
    dequantized weights."""
    from kvserve.model_executor.layers.linear import quantize_weight
    from kvserve.ops import quant

    monkeypatch.setenv(quant.ACT_ENV, "float")

    T, E, k, H, I = 23, 8, 2, 64, 32
    w13, w2 = _experts(E, H, I, seed=5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g)
    weights, experts = fused_moe.route(torch.randn(T, E, generator=g), k, renormalize=True)
    if method is None:
        w13s, w2s = list(w13), list(w2)
    else:
        w13s = [quantize_weight(w.contiguous(), method) for w in w13]
        w2s = [quantize_weight(w.contiguous(), method) for w in w2]
        w13 = torch.stack([quant.dequantize(w) for w in w13s])
        w2 = torch.stack([quant.dequantize(w) for w in w2s])
    got = fused_moe.looped_experts(x, weights, experts, w13s, w2s)
    ref = fused_moe.per_expert_loop(x, weights, experts, w13, w2)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert fused_moe.looped_experts(x[:0], weights[:0], experts[:0], w13s, w2s).shape == (0, H)


@pytest.mark.parametrize("kind", ["mixtral_top2", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "per_expert"])
def test_layer_equals_the_transformers_block(kind, dtype, mode):
    """``FusedMoE`` (``auto``: the native routing and experts call on CPU; ``per_expert``: the
    torch reference) against the family's transformers MoE block on the same random weights,
    64 rows and one row, float32 and bfloat16."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = _config(kind)
    torch.manual_seed(1)
    mixtral = kind.startswith("mixtral")
    block = (MixtralSparseMoeBlock if mixtral else Qwen3MoeSparseMoeBlock)(cfg).eval()
    E = block.gate.weight.shape[0]
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    inter = block.experts.down_proj.shape[-1]
    layer = FusedMoE(
        E,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
        inter,
        renormalize=True if mixtral else cfg.norm_topk_prob,
        float32_weights=mixtral,
        dtype=dtype,
        mode=mode,
    )
    with torch.no_grad():
        layer.gate.copy_(block.gate.weight)
        layer.w13.copy_(block.experts.gate_up_proj)  # [E, 2I, H]: gate rows then up rows
        layer.w2.copy_(block.experts.down_proj)
    block = block.to(dtype)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    for rows in (x, x[:1]):
        with torch.no_grad():
            want = block(rows.unsqueeze(0))
            want = (want[0] if isinstance(want, tuple) else want).reshape(rows.shape).float()
            got = layer(rows)
        assert got.dtype == dtype
        scale = float(want.abs().max())
        assert scale > 0.05
        tol = 1e-5 if dtype == torch.float32 else 0.03
        assert float((got.float() - want).abs().max()) <= tol * scale, (kind, dtype, mode)


def test_route_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    w, e = fused_moe.route(logits, 2, renormalize=False)
    assert e.tolist() == [[0, 1]]
    torch.testing.assert_close(w, p[:, :2])
    w, _ = fused_moe.route(logits, 2, renormalize=True)
    torch.testing.assert_close(w, p[:, :2] / p[:, :2].sum())


# ---------------------------------------------------------------- refusals


def test_refusals_name_the_family(tmp_path_factory, default_tokenizer_dir):
    path, _ = _model("mixtral_top2", tmp_path_factory, default_tokenizer_dir)
    from kvserve.model_executor.models.moe import MoeForCausalLM

    class FiveRanks:
        world_size, rank = 5, 0

    with pytest.raises(
        ValueError, match="MixtralForCausalLM: tensor_parallel_size=5 must divide intermediate_size=48"
    ):
        MoeForCausalLM(_config("mixtral_top2"), tp=FiveRanks())


def test_native_decode_step_does_not_apply(tmp_path_factory, default_tokenizer_dir):
    """Pure-decode CPU steps take the module path (the fused step has no MoE kernel)."""
    from kvserve.model_executor.models import cpu_decode_step

    path, _ = _model("olmoe", tmp_path_factory, default_tokenizer_dir)
    llm = LLM(model=str(path), **ENGINE)
    calls = []
    real = cpu_decode_step.applies

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    cpu_decode_step.applies = spy
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], _greedy(), use_tqdm=False)
    finally:
        cpu_decode_step.applies = real
    assert len(out[0].outputs[0].token_ids) == MAX_NEW
    assert not calls
    llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen2_moe_shared", "olmoe"])
def test_tensor_parallel_ranks_hold_complementary_expert_slices(
    kind, tmp_path_factory, default_tokenizer_dir
):
    """Loaded as rank 0 and rank 1 of two (no peers needed to load): each rank's experts,
    shared expert and OLMoE's whole-projection q/k norm weights, put back together along the
    intermediate columns (heads), are the checkpoint's."""
    from kvserve.model_executor.model_loader import read_safetensors_into
    from kvserve.model_executor.models.moe import MoeBlock, MoeForCausalLM

    path, hf = _model(kind, tmp_path_factory, default_tokenizer_dir)

    class Rank:
        world_size = 2

        def __init__(self, rank):
            self.rank = rank

    ranks = []
    for r in (0, 1):
        m = MoeForCausalLM(hf.config, tp=Rank(r))
        with torch.no_grad():
            read_safetensors_into(m, path)
        ranks.append(m)
    for i, hf_layer in enumerate(hf.model.layers):
        blocks = [m.layers[i].mlp for m in ranks]
        if isinstance(blocks[0], MoeBlock):
            full = hf_layer.mlp.experts
            inter = blocks[0].experts.inter
            gate = torch.cat([b.experts.w13[:, :inter] for b in blocks], dim=1)
            up = torch.cat([b.experts.w13[:, inter:] for b in blocks], dim=1)
            torch.testing.assert_close(
                torch.cat([gate, up], dim=1), full.gate_up_proj.detach(), rtol=0, atol=0
            )
            down = torch.cat([b.experts.w2 for b in blocks], dim=2)
            torch.testing.assert_close(down, full.down_proj.detach(), rtol=0, atol=0)
            torch.testing.assert_close(
                blocks[1].experts.gate, hf_layer.mlp.gate.weight.detach(), rtol=0, atol=0
            )
            if blocks[0].shared_expert is not None:
                shared = torch.cat([b.shared_expert.down_weight for b in blocks], dim=1)
                torch.testing.assert_close(
                    shared, hf_layer.mlp.shared_expert.down_proj.weight.detach(), rtol=0, atol=0
                )
        if kind == "olmoe":
            q_norm = torch.cat([m.layers[i].self_attn.q_norm.weight for m in ranks])
            torch.testing.assert_close(q_norm, hf_layer.self_attn.q_norm.weight.detach(), rtol=0, atol=0)


def test_tensor_parallel_checks_expert_sizes_before_any_rank_starts():
    """``ParallelConfig.verify_with_model`` (run before any peer is spawned) checks the expert and
    shared-expert intermediate sizes as it does ``intermediate_size``."""
    from kvserve.config import ParallelConfig

    cfg = _config("qwen2_moe_shared")  # intermediate 80, experts 32, shared expert 48
    ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu")
    cfg.shared_expert_intermediate_size = 49
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 must divide shared_expert_intermediate_size=49"
    ):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu")
    cfg = _config("qwen2_moe_shared")
    with pytest.raises(
        ValueError,
        match=r"whole Q8_0 blocks of 32: down_proj intermediate_size 80/2 = 40, "
        r"down_proj moe_intermediate_size 32/2 = 16, down_proj shared_expert_intermediate_size 48/2 = 24",
    ):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(cfg, "cpu", quantization="int8")
