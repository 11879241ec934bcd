"""GGUF files of architecture ``qwen2`` and ``qwen3`` (their ``<arch>.*`` keys, q/k norms, a gpt2
BPE tokenizer), written here with the ``gguf`` package from tiny random models, through
``kvserve.LLM``: the float path (converted to an HF directory) and ``quantization="gguf"``,
against transformers on the same weights."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.model_loader import default_gguf_path
from kvserve.ops import quant
from tests.model_executor.family_checks import VOCAB, check_against_hf, prompts_of

T = gguf.GGMLQuantizationType
HF_TO_GGUF = {v: k for k, v in gguf_convert._GLOBAL_MAP.items()}
LAYER_TO_GGUF = {v: k for k, v in gguf_convert.ARCHITECTURES["qwen3"].items()}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    assert m, hf
    return f"blk.{m.group(1)}.{LAYER_TO_GGUF[m.group(2)]}"


def model_config(arch: str, **kw):
    from transformers import Qwen2Config, Qwen3Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return (Qwen3Config if arch == "qwen3" else Qwen2Config)(**base)


def random_model(cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def write_gguf(path, arch: str, model, qtype=None) -> None:
    """``model`` as llama.cpp writes a ``qwen2`` / ``qwen3`` file: ``<arch>.*`` metadata, q/k rows
    in HF order, the default model's gpt2 tokenizer; 2-D weights but the embedding in ``qtype``
    (float32 when None). Quantized weights are written back into ``model`` dequantized, so that
    it stays the reference."""
    cfg = model.config
    tok = gguf.GGUFReader(str(default_gguf_path()))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(tok.fields["tokenizer.ggml.pre"].contents()))
    w.add_token_list(tok.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(tok.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(tok.fields["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # llama.cpp writes no output.weight for a tied head
            a = t.detach().float().numpy()
            if qtype is not None and a.ndim == 2 and name != "model.embed_tokens.weight":
                blocks = quantize(a, qtype)
                w.add_tensor(gguf_name(name), blocks, raw_dtype=qtype)
                t.copy_(torch.from_numpy(dequantize(blocks, qtype).reshape(a.shape)))
            else:
                w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = {
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied-mqa": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=8, num_attention_heads=8)),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Conversions go to a fresh cache: the files written here are new every run."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("case", list(CASES))
def test_float_gguf_matches_transformers(tmp_path, case):
    arch, kw = CASES[case]
    hf = random_model(model_config(arch, **kw))
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, hf)
    check_against_hf(path, hf, prompts_of(2, [11, 19]), 10, {})
    cfg = gguf_convert.build_config(gguf.GGUFReader(str(path)), not kw["tie_word_embeddings"])
    assert cfg.architectures == [f"{arch.capitalize()}ForCausalLM"]


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen3-tied"])
def test_quantized_gguf_matches_transformers_on_dequantized_weights(tmp_path, case, monkeypatch):
    """Q8_0 linear weights kept quantized (float activations): greedy tokens equal transformers'
    on the dequantized weights, log-probabilities within float32 rounding of the kernels."""
    monkeypatch.setenv(quant.ACT_ENV, "float")
    arch, kw = CASES[case]
    hf = random_model(model_config(arch, **kw))
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, hf, T.Q8_0)
    check_against_hf(path, hf, prompts_of(2, [11, 19]), 10, {}, atol=1e-3, quantization="gguf")


def test_other_architecture_is_refused_naming_it(tmp_path):
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture 'gemma'.*llama, qwen2, qwen3"):
        gguf_convert.check_architecture(gguf.GGUFReader(str(path)), "GGUF file")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("qwen2.rope.freq_base", -5.0, r"metadata key 'qwen2.rope.freq_base' must be a finite number > 0"),
        (
            "qwen2.attention.layer_norm_rms_epsilon",
            -1.0,
            r"metadata key 'qwen2.attention.layer_norm_rms_epsilon' must be a finite number >= 0",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            4096,
            r"eos_token_id 4096 must be an integer in \[0, vocab_size=64\)",
        ),
    ],
)
def test_impossible_metadata_value_is_refused_naming_the_file(tmp_path, key, value, message):
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for k, v in {
        "qwen2.embedding_length": 64,
        "qwen2.attention.head_count": 4,
        "qwen2.block_count": 1,
        "qwen2.feed_forward_length": 96,
        "qwen2.context_length": 128,
        "qwen2.vocab_size": 64,
    }.items():
        w.add_uint32(k, v)
    if isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=rf"GGUF file 'x'.*{message}"):
        gguf_convert.build_config(gguf.GGUFReader(str(path)), True, "GGUF file 'x'")
