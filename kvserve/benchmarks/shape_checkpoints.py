"""Random-weight checkpoints of real model shapes, for ``kvserve bench shapes``.

Each named shape (``SHAPES``) is the ``config.json`` of a public model (sizes, head counts,
vocabulary, tied embeddings, norms, biases) with no trained weights: :func:`ensure_checkpoint`
writes it as a Hugging Face directory (``config.json``, bfloat16 ``safetensors`` shards, the
default model's tokenizer files) and :func:`ensure_gguf` as a GGUF file of the same weights in
one block type (``Q8_0``, ``Q4_0``; every 2-D tensor in that type, the embedding / tied LM head
included, 1-D tensors float32: llama-quantize's ``--pure`` layout), with the default model's
tokenizer metadata. Both are cached under ``<cache_root>/shapes/<name>``.

The vocabulary stays the shape's own (it sets the embedding and LM-head cost): the tokenizer is
SmolLM2's (49,152 tokens); ids past it exist in the weights only. In the GGUF the token list is
padded with placeholder entries up to the shape's vocabulary, since llama.cpp sizes the
embedding from the token list.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

#: The default model's tokenizer files copied next to every shape's weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
#: Block types :func:`ensure_gguf` writes (``gguf`` package quantizers).
GGUF_TYPES = ("q8_0", "q4_0", "q4_1")
#: Largest safetensors shard, bytes.
SHARD_BYTES = 2 * 2**30


def _llama(hidden, layers, heads, kv_heads, head_dim, inter, vocab, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
        **extra,
    }


#: Shape name -> transformers config (each public model's sizes; ``tiny`` is the smoke shape).
#: Llama 3.2's ``rope_scaling`` (``llama3``) is left out: it changes rotary frequencies, not cost.
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 64, 8192, 128256),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 128, 8192, 128256),
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
    },
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "tiny": _llama(64, 2, 4, 2, 16, 128, 49152, max_position_embeddings=4096),
}


def head_dim(cfg: dict) -> int:
    """``head_dim`` of a config (``hidden_size / num_attention_heads`` when absent)."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def has_qkv_bias(cfg: dict) -> bool:
    """Qwen2 always carries q/k/v biases; Llama and Qwen3 only with ``attention_bias``."""
    return cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))


def tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(HF name, shape)`` of every tensor the checkpoint of ``cfg`` holds, in file order."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        if has_qkv_bias(cfg):
            yield p + "self_attn.q_proj.bias", (q,)
            yield p + "self_attn.k_proj.bias", (kv,)
            yield p + "self_attn.v_proj.bias", (kv,)
        if cfg["model_type"] == "qwen3":
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h)


def parameter_count(cfg: dict) -> int:
    """Stored parameters of ``cfg`` (a tied LM head counted once)."""
    n = 0
    for _, shape in tensor_shapes(cfg):
        size = 1
        for d in shape:
            size *= d
        n += size
    return n


def cut_name(name: str, layers: int | None = None) -> str:
    """The label of shape ``name`` cut to its first ``layers`` decoder layers (``name`` itself
    when ``layers`` is None): ``llama-3.2-1b-4layers``."""
    return name if layers is None else f"{name}-{layers}layers"


def shape_config(name: str, layers: int | None = None) -> dict:
    """The transformers config of shape ``name``, with ``num_hidden_layers`` set to ``layers``
    when given (a cut: same widths and vocabulary, fewer layers; the profile of a step per layer
    without the full model's memory and time).

    Raises:
        KeyError: an unknown shape name; ValueError: ``layers`` below 1 or above the shape's.
    """
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; choose from {list(SHAPES)}")
    cfg = dict(SHAPES[name])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {cfg['num_hidden_layers']}] for {name}, got {layers}")
        cfg["num_hidden_layers"] = layers
    return cfg


def shape_dir(name: str, layers: int | None = None) -> Path:
    """``<cache_root>/shapes/<cut_name(name, layers)>``."""
    from kvserve import envs

    return envs.cache_root() / "shapes" / cut_name(name, layers)


def _random_tensor(name: str, shape: tuple[int, ...], gen):
    """Normal(0, 0.02) matrices and biases (transformers' ``initializer_range``), RMSNorm scales
    of 1, in bfloat16."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
    return t.to(torch.bfloat16)


def _shard_plan(cfg: dict) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors of each safetensors shard (bfloat16 bytes up to ``SHARD_BYTES`` a shard)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = 2
        for d in shape:
            nbytes *= d
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_weights(cfg: dict, out: Path, seed: int) -> None:
    """bfloat16 safetensors shards, one in memory at a time, plus
    ``model.safetensors.index.json`` (a single ``model.safetensors`` when one shard holds all)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    plan = _shard_plan(cfg)
    weight_map = {}
    total = 0
    for i, names in enumerate(plan):
        fname = "model.safetensors" if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {name: _random_tensor(name, shape, gen) for name, shape in names}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
        del shard
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def default_tokenizer_dir() -> Path:
    """The default model's directory (its tokenizer files are copied)."""
    from kvserve.model_executor.model_loader import resolve_model_dir

    return resolve_model_dir(None)


def _config_json(name: str, tok_dir: Path, layers: int | None) -> dict:
    cfg = shape_config(name, layers)
    src = json.loads((tok_dir / "config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if src.get(k) is not None:
            cfg[k] = src[k]
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def _is_complete(path: Path) -> bool:
    return (path / ".complete").is_file()


def ensure_checkpoint(name: str, seed: int = 0, log=print, layers: int | None = None) -> Path:
    """The Hugging Face directory of shape ``name`` (cut to ``layers`` decoder layers when
    given: ``shape_config``), written on first use (random bfloat16 weights from ``seed``,
    config, tokenizer files) into ``shape_dir(name, layers) / "hf"``.

    Raises:
        KeyError: an unknown shape name; ValueError: ``layers`` out of range.
    """
    shape_config(name, layers)  # the checks, before anything is written
    final = shape_dir(name, layers) / "hf"
    if _is_complete(final):
        return final
    tok_dir = default_tokenizer_dir()
    cfg = _config_json(name, tok_dir, layers)
    tmp = final.with_name(f"hf.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log(
        f"writing {cut_name(name, layers)}: {parameter_count(cfg) / 1e9:.2f} B random bfloat16 parameters -> {final}"
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, tmp / f)
    _write_weights(cfg, tmp, seed)
    (tmp / ".complete").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


# ---------------------------------------------------------------- GGUF

#: HF layer tensor suffix -> GGUF ``blk.N.`` suffix.
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of an HF tensor name of these shapes.

    Raises:
        KeyError: a name the shapes do not produce.
    """
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    return f"blk.{idx}.{_GGUF_LAYER[rest]}"


def permute_for_gguf(w, n_head: int):
    """llama.cpp's q/k row order for its ``llama`` architecture: within each head the two rotary
    halves interleaved pairwise (HF keeps them as first half, second half).

    Args:
        w: ``[n_head * head_dim, in]`` or ``[n_head * head_dim]`` numpy array, HF order.
    """
    rest = w.shape[1:]
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field_value(field):
    """A GGUF reader field's value: str / int / float, or a list of them."""
    from gguf import GGUFValueType

    def one(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


@functools.lru_cache(maxsize=1)
def _default_tokenizer_metadata() -> dict:
    """The default GGUF's ``tokenizer.*`` metadata (parsing its ~100,000 strings takes seconds)."""
    from gguf import GGUFReader

    from kvserve.model_executor.model_loader import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    return {k: _field_value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def tokenizer_metadata(vocab_size: int) -> dict:
    """The default GGUF's ``tokenizer.*`` metadata with its token list (and token types) padded
    to ``vocab_size`` entries by ``<|shape_pad_N|>`` placeholders of the UNUSED type."""
    meta = dict(_default_tokenizer_metadata())
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pad = vocab_size - len(tokens)
    if pad > 0:
        meta["tokenizer.ggml.tokens"] = tokens + [f"<|shape_pad_{i}|>" for i in range(pad)]
        meta["tokenizer.ggml.token_type"] = list(types) + [5] * pad  # 5: UNUSED
    return meta


def _add_metadata(w, arch: str, cfg: dict, ftype: int) -> None:
    hd = head_dim(cfg)
    w.add_name(f"random {arch}")
    w.add_file_type(ftype)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_vocab_size(cfg["vocab_size"])
    for key, value in tokenizer_metadata(cfg["vocab_size"]).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))


def ensure_gguf(name: str, qtype: str, log=print, layers: int | None = None) -> Path:
    """The GGUF file of shape ``name`` (cut to ``layers`` when given) in block type ``qtype``
    (``GGUF_TYPES``), written on first use from the HF checkpoint's weights
    (:func:`ensure_checkpoint`) into ``shape_dir(name, layers) / f"{cut}-{qtype}.gguf"``
    (``cut = cut_name(name, layers)``).

    Raises:
        KeyError: an unknown shape; ValueError: an unknown ``qtype`` or ``layers`` out of range.
    """
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {qtype!r} not among {GGUF_TYPES}")
    hf = ensure_checkpoint(name, log=log, layers=layers)
    final = shape_dir(name, layers) / f"{cut_name(name, layers)}-{qtype}.gguf"
    if final.is_file():
        return final
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((hf / "config.json").read_text())
    arch = cfg["model_type"]
    qt = gguf.GGMLQuantizationType[qtype.upper()]
    ftype = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}.get(
        qtype, gguf.LlamaFileType.MOSTLY_Q4_1
    )
    log(f"writing {final.name} ({qtype.upper()})")
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    _add_metadata(w, arch, cfg, int(ftype))
    files = sorted(hf.glob("*.safetensors"))
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                where[k] = f
    for hf_name, _ in tensor_shapes(cfg):
        with safe_open(str(where[hf_name]), "pt") as sf:
            a = sf.get_tensor(hf_name).float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute_for_gguf(a, cfg["num_attention_heads"])
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute_for_gguf(a, cfg["num_key_value_heads"])
        if a.ndim == 2:
            w.add_tensor(gguf_tensor_name(hf_name), gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gguf_tensor_name(hf_name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(final)
    return final
