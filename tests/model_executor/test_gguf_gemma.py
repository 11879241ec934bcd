"""A tiny Gemma 3 written as llama.cpp writes a gemma3 GGUF (norm scales stored as ``1 + weight``,
q/k rows unpermuted, ``gemma3.*`` metadata) runs through both GGUF paths with transformers'
greedy tokens and logprobs of the same weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
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
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
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
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


PROMPTS = [[20 + (13 * i) % 1500 for i in range(19)], [700 + (7 * i) % 900 for i in range(11)]]
N = 16


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_tiny_gemma3_gguf_matches_transformers(tiny, quantization):
    path, model = tiny
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
    llm = LLM(model=str(path), quantization=quantization, dtype="float32", seed=0)
    try:
        assert type(llm.llm_engine.executor.model).__name__ == "GemmaForCausalLM"
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    for o, (toks, lps) in zip(outs, ref):
        c = o.outputs[0]
        assert list(c.token_ids) == toks
        got = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4
