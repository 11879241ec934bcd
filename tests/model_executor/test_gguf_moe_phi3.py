"""GGUF files of Phi-3 (``phi3``) and of the mixture-of-experts families (``qwen2moe``,
``qwen3moe``, ``olmoe``, Mixtral as a ``llama`` file with ``llama.expert_count``), written here
from tiny random transformers models the way llama.cpp's ``convert_hf_to_gguf.py`` writes them
(tensor names from the ``gguf`` package's own name map, stacked experts, Phi-3's fused tensors
and LongRoPE factor tensors, Llama's q/k row permutation for Mixtral), run through
``kvserve.LLM`` on the float path and with their quantized blocks kept, against transformers:
on the same GGUF where transformers reads that architecture (``phi3`` without LongRoPE or
partial rotary, ``qwen2moe``, ``qwen3moe``), else on the checkpoint the file was written from."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.gguf_loader import load_gguf_model
from kvserve.ops import quant
from tests.model_executor.family_checks import check_against_hf
from tests.model_executor.test_gguf_quantized import permute_qk

T = gguf.GGMLQuantizationType


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each of the 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


#: A small byte-level BPE vocabulary (the 256 bytes and a few merges): files with the default
#: model's 49,152 tokens take seconds to parse, on every open.
MERGES = ["\u0120 t", "h e", "i n", "\u0120 a"]
TOKENS = _byte_tokens() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)


def prompts_of(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random token ids of the small vocabulary (lengths cycled)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


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

#: case -> (general.architecture, config class, config keywords). The Qwen MoE sizes are
#: transformers' defaults where its GGUF reader takes no metadata key for them
#: (``moe_intermediate_size``, ``shared_expert_intermediate_size``), so that it can read these
#: files too.
CASES = {
    "phi3": ("phi3", "Phi3Config", dict(intermediate_size=96, pad_token_id=0)),
    "phi3-longrope-partial": (
        "phi3",
        "Phi3Config",
        dict(
            intermediate_size=96,
            num_key_value_heads=1,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            sliding_window=24,
            tie_word_embeddings=True,  # Phi-4-mini's
            pad_token_id=0,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[1.5 + 0.7 * i for i in range(6)],
                partial_rotary_factor=0.75,
            ),
        ),
    ),
    "mixtral": (
        "llama",
        "MixtralConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2moe": (
        "qwen2moe",
        "Qwen2MoeConfig",
        dict(
            intermediate_size=96,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3moe": (
        "qwen3moe",
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=768,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    # a dense layer between sparse ones: llama.cpp's qwen3moe has no dense tensors, so they are
    # written under Llama's names (ffn_gate / ffn_up / ffn_down)
    "qwen3moe-dense-layer": (
        "qwen3moe",
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "olmoe": (
        "olmoe",
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0),
    ),
}

#: The cases transformers' own GGUF reader loads as kvserve does.
TRANSFORMERS_READS = ("phi3", "qwen2moe", "qwen3moe")


def random_model(case: str):
    """The tiny random transformers model of ``case`` (float32, eval): norms randomised (so
    their loading is tested), the LM head scaled (decisive greedy choices)."""
    import transformers
    from transformers import AutoModelForCausalLM

    _, config_class, kw = CASES[case]
    cfg = getattr(transformers, config_class)(**{**BASE, **kw})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def _checkpoint_tensors(arch: str, model):
    """``(hub-format name, tensor view)`` of ``model``'s weights as the HF checkpoint names them
    (what llama.cpp's converter reads), with each layer's experts already stacked per
    projection as the converter stacks them: views into the model's own parameters."""
    cfg = model.config
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        if ".mlp.experts.gate_up_proj" in name:
            half = t.shape[1] // 2
            layer = name.split(".mlp.")[0]
            if arch == "llama":  # Mixtral: w1 gate, w3 up, w2 down; the converter's merged name
                yield f"{layer.removeprefix('model.')}.feed_forward.experts.w1", t[:, :half]
                yield f"{layer.removeprefix('model.')}.feed_forward.experts.w3", t[:, half:]
            else:
                yield f"{layer}.mlp.experts.gate_proj", t[:, :half]
                yield f"{layer}.mlp.experts.up_proj", t[:, half:]
        elif ".mlp.experts.down_proj" in name:
            layer = name.split(".mlp.")[0]
            if arch == "llama":
                yield f"{layer.removeprefix('model.')}.feed_forward.experts.w2", t
            else:
                yield f"{layer}.mlp.experts.down_proj", t
        elif arch == "llama" and name.endswith(".mlp.gate.weight"):
            yield name.replace(".mlp.gate.weight", ".block_sparse_moe.gate"), t
        else:
            yield name, t


def write_gguf(path, case: str, model, qtype=None, edit=None, expert_used_count=None) -> None:
    """``model`` written as llama.cpp's converter writes a file of ``case``'s architecture.

    Metadata: the ``<arch>.*`` sizes, ``expert_count`` / ``expert_used_count`` /
    ``expert_feed_forward_length`` / ``expert_shared_feed_forward_length``, OLMoE's
    ``attention.clamp_kqv``, Phi-3's ``rope.dimension_count`` (``partial_rotary_factor *
    hidden / heads``), ``rope.scaling.original_context_length``, ``attention.sliding_window``
    and, for LongRoPE, ``rope.scaling.attn_factor`` with the ``rope_factors_long`` /
    ``rope_factors_short`` tensors; the default model's gpt2 tokenizer. Tensors: named by the
    ``gguf`` package's tensor name map of the architecture; Mixtral's q/k rows permuted (llama);
    every 2-D or 3-D weight but the embedding and the routers in ``qtype`` (float32 when None),
    the quantized ones written back into ``model`` dequantized, so that it stays the reference;
    ``qtype`` may also be a function of the GGUF tensor name. A small byte-level BPE tokenizer
    (``TOKENS``). For files with faults: ``edit(name, array)`` returns the array to write in
    its place (None: the tensor is left out), ``expert_used_count`` replaces the config's.
    """
    import math

    arch = CASES[case][0]
    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(expert_used_count or cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "clip_qkv", None) is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    extra = []
    if arch == "phi3":
        rot = rope.get("partial_rotary_factor", 1.0)
        rope_dims = int(rot * cfg.hidden_size) // cfg.num_attention_heads
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
                if scale > 1.0
                else 1.0
            )
            extra += [
                ("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
                ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)),
            ]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers
    )
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    with torch.no_grad():
        for hf_name, t in _checkpoint_tensors(arch, model):
            base, suffix = (
                hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "weight")
            )
            name = name_map.get_name(base) or dense_map.get_name(base)
            assert name is not None, hf_name
            name = f"{name}.{suffix}"
            a = t.detach().float().numpy()
            heads = None
            if arch == "llama" and base.endswith("q_proj"):
                heads = cfg.num_attention_heads
            elif arch == "llama" and base.endswith("k_proj"):
                heads = cfg.num_key_value_heads
            if heads is not None:
                a = permute_qk(a, heads)
            if name.endswith("ffn_gate_inp_shexp.weight"):
                a = a.reshape(-1)  # one row, as the converter writes it
            if edit is not None:
                a = edit(name, a)
                if a is None:
                    continue
            qt = qtype(name) if callable(qtype) else qtype
            quantized = (
                qt is not None
                and a.ndim >= 2
                and name != "token_embd.weight"
                and not name.endswith("ffn_gate_inp.weight")  # llama.cpp keeps routers float
            )
            if not quantized:
                w.add_tensor(name, np.ascontiguousarray(a))
                continue
            blocks = quantize(np.ascontiguousarray(a), qt)
            w.add_tensor(name, blocks, raw_dtype=qt)
            back = dequantize(blocks, qt).reshape(a.shape)
            if heads is not None:
                back = gguf_convert.unpermute_qk(back, heads)
            t.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    for name, a in extra:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Conversions go to a fresh cache: the files written here are new every run."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))


def transformers_on_gguf(path):
    """transformers' own model of the GGUF file ``path`` (its GGUF reader), float32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


#: The quick tier's cases (the others are slow-marked: together these stay within seconds).
QUICK = ("phi3", "phi3-longrope-partial", "mixtral", "qwen2moe", "olmoe")


@pytest.mark.parametrize(
    "case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_float_gguf_matches_transformers(tmp_path, case):
    """The file converted to float gives transformers' greedy tokens (log-probabilities within
    1e-4): transformers on the same GGUF where it reads it, else on the written checkpoint."""
    hf = random_model(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, case, hf)
    ref = transformers_on_gguf(path) if case in TRANSFORMERS_READS else hf
    # prompts past Phi-3's sliding window and LongRoPE's original length
    check_against_hf(path, ref, prompts_of(2, [11, 37]), 8, {}, quantization="none")


@pytest.mark.parametrize(
    "case, qtype",
    [
        ("mixtral", T.Q8_0),
        ("phi3-longrope-partial", T.Q8_0),
        pytest.param("qwen2moe", T.Q8_0, marks=pytest.mark.slow),
        pytest.param("olmoe", T.Q4_0, marks=pytest.mark.slow),
        pytest.param("qwen3moe", T.F16, marks=pytest.mark.slow),
    ],
)
def test_quantized_gguf_keeps_experts_quantized_and_matches_transformers(tmp_path, case, qtype, monkeypatch):
    """Q8_0 / Q4_0 weights, the experts' 3-D stacks included, run in their blocks (one quantized
    weight per expert and projection; routers float); F16 ones are dequantized at load (the
    experts run grouped, float): greedy tokens equal transformers' on the dequantized weights,
    log-probabilities within float32 rounding of the kernels."""
    monkeypatch.setenv(quant.ACT_ENV, "float")
    hf = random_model(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, case, hf, qtype)
    model = load_gguf_model(path, torch.float32, "cpu")
    if CASES[case][0] != "phi3":
        moe = next(layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts"))
        assert isinstance(moe.gate, torch.Tensor) and moe.gate.dtype == torch.float32
        if qtype == T.F16:
            assert moe.w13_q is None and moe.w2_q is None and moe.w13.dtype == torch.float32
        else:
            assert len(moe.w13_q) == len(moe.w2_q) == moe.num_experts
            kind = qtype.name.lower()
            assert all(isinstance(x, quant.QuantWeight) and x.qtype == kind for x in moe.w13_q + moe.w2_q)
    del model
    check_against_hf(path, hf, prompts_of(2, [11, 37]), 8, {}, atol=1e-3, quantization="gguf")


def test_expert_stacks_without_a_kernel_are_dequantized_with_a_log_line(tmp_path, monkeypatch, caplog):
    """Q5_0 gate/up stacks run as Q8_0 blocks (repacked exactly), a Q5_1 down stack (no kernel)
    is dequantized at load with a log line and its experts run as float weights in the same
    per-expert loop: greedy tokens equal transformers' on the dequantized weights."""
    monkeypatch.setenv(quant.ACT_ENV, "float")
    hf = random_model("mixtral")
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "mixtral", hf, lambda n: T.Q5_1 if "ffn_down_exps" in n else T.Q5_0)
    with caplog.at_level(logging.INFO, logger="kvserve.gguf"):
        model = load_gguf_model(path, torch.float32, "cpu")
    assert "Q5_1 tensors have no quantized kernel; dequantized to float at load" in caplog.text
    assert "Q5_0 tensors repacked to Q8_0 at load (exact)" in caplog.text
    moe = model.layers[1].mlp.experts
    assert all(isinstance(x, quant.QuantWeight) and x.qtype == "q8_0" for x in moe.w13_q)
    assert all(isinstance(x, torch.Tensor) and x.shape == (64, 32) for x in moe.w2_q)
    del model
    check_against_hf(path, hf, prompts_of(2, [11, 37]), 8, {}, atol=1e-3, quantization="gguf")


def _load_both_ways(path):
    """Both readers of a GGUF file: the float conversion and the quantized loader."""
    yield lambda: gguf_convert.converted_dir(path)
    yield lambda: load_gguf_model(path, torch.float32, "cpu")


def test_missing_expert_tensor_names_the_file_and_tensor(tmp_path):
    hf = random_model("qwen2moe")
    path = tmp_path / "noexp.gguf"
    write_gguf(path, "qwen2moe", hf, edit=lambda n, a: None if n == "blk.1.ffn_up_exps.weight" else a)
    for load in _load_both_ways(path):
        with pytest.raises(ValueError, match=r"noexp\.gguf.*'blk\.1\.ffn_up_exps\.weight' is missing"):
            load()
    path = tmp_path / "noshexp.gguf"
    write_gguf(path, "qwen2moe", hf, edit=lambda n, a: None if n == "blk.0.ffn_gate_inp_shexp.weight" else a)
    for load in _load_both_ways(path):
        with pytest.raises(
            ValueError, match=r"noshexp\.gguf.*'blk\.0\.ffn_gate_inp_shexp\.weight' is missing"
        ):
            load()


def test_expert_stack_of_the_wrong_shape_names_the_file_and_tensor(tmp_path):
    hf = random_model("mixtral")
    path = tmp_path / "shape.gguf"
    write_gguf(path, "mixtral", hf, edit=lambda n, a: a[:3] if n == "blk.0.ffn_down_exps.weight" else a)
    for load in _load_both_ways(path):
        with pytest.raises(ValueError, match=r"shape\.gguf.*'blk\.0\.ffn_down_exps\.weight'.*\(3, 64, 32\)"):
            load()


def test_bad_expert_metadata_and_unknown_architecture_name_the_file_and_field(tmp_path):
    hf = random_model("olmoe")
    path = tmp_path / "used.gguf"
    write_gguf(path, "olmoe", hf, expert_used_count=9)
    for load in _load_both_ways(path):
        with pytest.raises(
            ValueError, match=r"used\.gguf.*'olmoe\.expert_used_count' \(9\).*'olmoe\.expert_count' \(8\)"
        ):
            load()
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for load in _load_both_ways(path):
        with pytest.raises(
            ValueError, match=r"other\.gguf.*'deepseek2' is not supported.*phi3, qwen2moe, qwen3moe, olmoe"
        ):
            load()
