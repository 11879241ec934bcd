"""Convert a llama-architecture GGUF file into a Hugging Face directory, cached on disk.

Output (float32): ``config.json`` (a ``LlamaConfig`` built from the GGUF metadata),
``model.safetensors`` (dequantized weights under HF names), tokenizer files (transformers'
GGUF tokenizer loader + ``save_pretrained``, which keeps the chat template).

llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` inside each head from
HF's "rotate half" RoPE layout (first half / second half of the head) to interleaved pairs.
``unpermute_qk`` applies the inverse so the weights match HF modelling code again.

The result is cached under ``$KVSERVE_CACHE_DIR`` (default ``~/.cache/kvserve``) in
``<gguf stem>-<12 hex digest of size, first and last MiB, converter version>/`` (content, not
mtime, so every install of the same file shares one cache); it is written into a
temporary directory next to it and renamed into place, so an interrupted conversion never
leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

#: Bump when the output format changes, so old caches are not reused.
CONVERTER_VERSION = "1"
#: Temporary conversion directories older than this (seconds) are treated as abandoned.
_STALE_TMP_S = 6 * 3600


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def cache_dir_for(gguf_path: Path) -> Path:
    """Where the converted copy of ``gguf_path`` lives (keyed on its size and sampled content:
    hashing the whole file would cost a second start ~0.3 s per 100 MB)."""
    size = gguf_path.stat().st_size
    h = hashlib.sha256(f"{size}:{CONVERTER_VERSION}:".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    digest = h.hexdigest()[:12]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Args:
        w: ``[n_head * head_dim, in]`` weight or ``[n_head * head_dim]`` bias, GGUF row order
            (pairs interleaved within each head).
    Returns:
        the same rows in HF order (first halves, then second halves, per head).
    """
    rest = w.shape[1:]
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name, or ``None`` for tensors HF does not store (rope_freqs)."""
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def build_config(reader, has_output: bool):
    """A ``transformers.LlamaConfig`` from GGUF ``llama.*`` / ``tokenizer.ggml.*`` metadata."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = (
        _field(reader, "llama.attention.key_length")
        or _field(reader, "llama.rope.dimension_count")
        or hidden // n_head
    )
    rope = {"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))}
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling == "linear":
        rope = {
            "rope_type": "linear",
            "factor": float(_field(reader, "llama.rope.scaling.factor")),
            "rope_theta": rope["rope_theta"],
        }
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    cfg = LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=int(head_dim),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        unk_token_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        attention_bias=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def dequantize_tensors(reader, cfg) -> dict[str, object]:
    """All tensors as float32 torch tensors under HF names, q/k rows in HF order."""
    import torch
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(s) for s in reversed(list(t.shape)))  # ggml lists dims innermost first
        arr = arr.reshape(shape)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, cfg.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, cfg.num_key_value_heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")  # own the memory (GGUF data is a read-only mmap)
        out[name] = torch.from_numpy(arr)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF directory for ``gguf_path`` into (existing, empty) ``out_dir``.

    Raises:
        ValueError: not a llama GGUF, or a tensor without a HF counterpart.
    """
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    cfg = build_config(reader, has_output)
    tensors = dequantize_tensors(reader, cfg)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    cfg.save_pretrained(str(out_dir))
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))


def _clean_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _cached(final: Path, write, complete) -> Path:
    """``final`` once ``complete(final)``, writing it first with ``write(tmp_dir)`` when absent.

    Concurrent callers may both write; the first rename wins and the other copy is dropped.
    """
    if complete(final):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(root)
    if final.exists():  # incomplete leftovers (should not happen with rename) -> redo
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def converted_dir(gguf_path: Path) -> Path:
    """The cached HF directory for ``gguf_path``, converting it first when absent."""
    gguf_path = Path(gguf_path).resolve()
    return _cached(cache_dir_for(gguf_path), lambda tmp: convert_gguf(gguf_path, tmp), is_complete)


def write_metadata(gguf_path: Path, out_dir: Path) -> None:
    """Write ``config.json`` and the tokenizer files of ``gguf_path`` (no weights) into
    ``out_dir``: what ``quantization="gguf"`` needs beside the GGUF file itself.

    Raises:
        ValueError: not a llama GGUF.
    """
    import gguf
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = build_config(reader, any(t.name == "output.weight" for t in reader.tensors))
    del reader
    cfg.save_pretrained(str(out_dir))
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))


def metadata_dir(gguf_path: Path) -> Path:
    """The cached directory of ``write_metadata`` for ``gguf_path`` (``<converted dir>-meta``).

    Raises:
        ValueError: the file cannot be read as a llama GGUF (naming it).
    """
    from kvserve.model_executor.gguf_loader import open_gguf

    gguf_path = Path(gguf_path).resolve()
    final = cache_dir_for(gguf_path)
    final = final.with_name(final.name + "-meta")
    if not (final / "config.json").is_file():
        open_gguf(gguf_path)  # a clear error naming the file before transformers reads it
    return _cached(final, lambda tmp: write_metadata(gguf_path, tmp), lambda d: (d / "config.json").is_file())
