"""A tiny Gemma 3 written as llama.cpp writes a gemma3 GGUF (norm scales stored as ``1 + weight``,
q/k rows unpermuted, ``gemma3.*`` metadata) runs through both GGUF paths with transformers'
greedy tokens and logprobs of the same weights; so does one with the block types of the Q4_K_M
Gemma 3 file whose shapes allow them (Q5_0 q/k/gate/up repacked to Q8_0 beside Q8_0 v and
embedding), its fused q/k/v and gate/up kept quantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvserve import LLM, SamplingParams
from kvserve.ops import quant
from tests.model_executor.test_quant_inputs import SMALL_VOCAB, _tokenizer_fields

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = name.split(".", 3)
    return f"blk.{i}.{LAYER_NAMES[rest]}"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


T = gguf.GGMLQuantizationType


def _write_tiny(path, qtype_of):
    """A tiny Gemma 3 (transformers) and its GGUF at ``path``; ``qtype_of(hf_name)`` gives a 2-D
    tensor's block type (None: float32). A quantized tensor's dequantized values are written back
    into the transformers model, so both run the same weights."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    # what a gemma3 GGUF implies: query_pre_attn_scalar = head_dim, local rope base 10000, every
    # sixth layer global
    cfg = Gemma3TextConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.mul_(20.0)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1000000.0)
    w.add_sliding_window(cfg.sliding_window)
    for key, (value, vtype) in _tokenizer_fields().items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # llama.cpp stores Gemma's 1 + weight
        qt = qtype_of(name) if a.ndim == 2 else None
        if qt is None:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
            continue
        blocks = quantize(a, qt)
        with torch.no_grad():
            t.copy_(torch.from_numpy(np.asarray(dequantize(blocks, qt), dtype=np.float32)))
        w.add_tensor(_gguf_name(name), blocks, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _write_tiny(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", lambda name: None)


def _q4_k_m_types(name: str):
    """The Q4_K_M Gemma 3 270M file's types where this model's widths (64, 96: not multiples of
    256) allow them: Q5_0 q, k, gate, up and down; Q8_0 v, o and the tied embedding."""
    if any(p in name for p in ("q_proj", "k_proj", "gate_proj", "up_proj", "down_proj")):
        return T.Q5_0
    return T.Q8_0


@pytest.fixture(scope="module")
def tiny_q5_0(tmp_path_factory):
    return _write_tiny(tmp_path_factory.mktemp("gguf") / "tiny-gemma3-q5_0.gguf", _q4_k_m_types)


PROMPTS = [[20 + (13 * i) % 1500 for i in range(19)], [700 + (7 * i) % 900 for i in range(11)]]
N = 16


def _greedy_reference(model):
    """transformers' greedy tokens and their logprobs for ``PROMPTS``."""
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            ids, lps = list(p), []
            for _ in range(N):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                t = int(torch.argmax(logits))
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                ids.append(t)
            ref.append((ids[len(p) :], lps))
    return ref


def _check_against(ref, outs) -> None:
    for o, (toks, lps) in zip(outs, ref):
        c = o.outputs[0]
        assert list(c.token_ids) == toks
        got = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4


def _run(path, quantization, check_model=None):
    llm = LLM(model=str(path), quantization=quantization, dtype="float32", seed=0)
    try:
        model = llm.llm_engine.executor.model
        assert type(model).__name__ == "GemmaForCausalLM"
        if check_model is not None:
            check_model(model)
        return llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_tiny_gemma3_gguf_matches_transformers(tiny, quantization):
    path, model = tiny
    _check_against(_greedy_reference(model), _run(path, quantization))


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_tiny_gemma3_q5_0_gguf_matches_transformers(tiny_q5_0, quantization, monkeypatch):
    """The Q5_0 tensors repacked to Q8_0: every linear weight stays quantized (the fused q/k/v
    of Q5_0 q/k and Q8_0 v too) and the greedy tokens and logprobs equal transformers' on the
    dequantized weights, as the float conversion's do (float activations: the exact mode)."""
    monkeypatch.setenv(quant.ACT_ENV, "float")
    path, model = tiny_q5_0

    def all_q8_0(m):
        if quantization == "none":
            return
        for layer in m.layers:
            for w in (
                layer.self_attn.qkv_weight,
                layer.self_attn.o_weight,
                layer.mlp.gate_up_weight,
                layer.mlp.down_weight,
            ):
                assert isinstance(w, quant.QuantWeight) and w.qtype == "q8_0"
        assert isinstance(m.lm_head, quant.QuantWeight)

    _check_against(_greedy_reference(model), _run(path, quantization, all_q8_0))
