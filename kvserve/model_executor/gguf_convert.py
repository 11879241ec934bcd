"""Convert a GGUF file (``general.architecture`` llama (Mixtral too), qwen2, qwen3, phi3,
qwen2moe, qwen3moe, olmoe, gemma2 or gemma3) into a Hugging Face directory, cached on disk.

Output (float32): ``config.json`` (a ``LlamaConfig``, ``MixtralConfig``, ``Qwen2Config``,
``Qwen3Config``, ``Phi3Config``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``OlmoeConfig``,
``Gemma2Config`` or ``Gemma3TextConfig`` built from the GGUF metadata's ``<architecture>.*``
keys; Phi-3 and the mixture-of-experts families: ``gguf_families``),
``model.safetensors`` (dequantized weights under HF names, experts one tensor each), tokenizer
files (transformers' GGUF tokenizer loader + ``save_pretrained``, which keeps the chat template).

llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` inside each head from
HF's "rotate half" RoPE layout (first half / second half of the head) to interleaved pairs.
``unpermute_qk`` applies the inverse so the weights match HF modelling code again (llama
only, Mixtral included: Qwen's, Phi-3's, OLMoE's and Gemma's rows are stored as HF has them,
llama.cpp rotating them in the "neox" layout, which is HF's). Gemma's RMSNorm scales are stored as
``1 + weight``; ``hf_float`` takes the 1 off again.

The result is cached under ``$KVSERVE_CACHE_DIR`` (default ``~/.cache/kvserve``) in
``<gguf stem>-<16 hex digits of sha256(converter version, sha256 of the whole file)>/``
(content, not name or mtime, so every install of the same file shares one cache and a different
file never meets another's conversion). The whole-file hash is computed once per file version
and remembered in ``<cache>/gguf-sha256.json`` under the file's path, size, mtime, ctime, inode
and device (``file_sha256``), so an unchanged file is not read again on every start. The
conversion is written into a temporary directory next to its final place and renamed into
place, so an interrupted or failed conversion (a refused file, a full disk) never leaves a cache
entry behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvserve.envs import cache_root
from kvserve.model_executor.config_checks import check_config_values
from kvserve.model_executor.gguf_families import (
    EXPERT_STACKS,
    IGNORED,
    expert_layer_map,
    has_experts,
    hf_shape,
    moe_config,
    phi3_config,
    phi3_layer_map,
)

if TYPE_CHECKING:
    import torch

#: Bump when the output format changes, so old caches are not reused.
CONVERTER_VERSION = "1"
#: The whole-file hash memo's file name under ``cache_root()`` (``file_sha256``).
HASH_MEMO = "gguf-sha256.json"
#: Entries the memo keeps (the oldest are dropped first).
_HASH_MEMO_MAX = 256
#: Temporary conversion directories older than this (seconds) are treated as abandoned.
_STALE_TMP_S = 6 * 3600


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``.

    Raises:
        ValueError: naming the file, when it is not a readable GGUF file: bad magic, a
            truncated header / metadata entry / tensor info / tensor data (naming the entry or
            tensor where the file ends), a duplicated tensor name, an unknown tensor type
            (naming the tensor and its type id).
        ImportError: the imported ``gguf`` module has no ``GGUFReader`` (naming the module's
            file: e.g. a user's own ``gguf.py`` shadowing the package), so the file is not blamed.
    """
    import gguf

    reader = getattr(gguf, "GGUFReader", None)
    if reader is None:
        raise ImportError(
            f"the imported 'gguf' module ({getattr(gguf, '__file__', None)!r}) has no GGUFReader: "
            "is a local file or folder named gguf shadowing the gguf package?"
        )
    try:
        return reader(str(path))
    except Exception as e:
        try:
            why = gguf_layout_error(Path(path))
        except Exception:  # the diagnosis is best effort: fall back to the reader's words
            why = None
        why = why or f"{type(e).__name__}: {e}"
        if "GGMLQuantizationType" in str(e) or "unknown type" in why:
            raise ValueError(f"GGUF file {str(path)!r} has a tensor of unknown type: {why}") from None
        raise ValueError(f"GGUF file {str(path)!r} cannot be read (truncated or corrupt?): {why}") from None


#: Bytes of a fixed-size GGUF metadata value, by value type id (8 = string, 9 = array: variable).
_GGUF_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_layout_error(path: Path) -> str | None:
    """What is wrong with the layout of GGUF file ``path`` (version 2 or 3, little-endian), or
    ``None`` when the header, metadata, tensor infos and tensor data all fit in the file.

    Walks the file as the GGUF specification lays it out: magic, version, tensor and metadata
    counts; each metadata key and typed value; each tensor's name, dims, type id and data
    offset; then checks every tensor's data lies inside the file. Reads only the header (a
    memory map), so it is cheap on multi-GB files.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    if size < 24:
        return f"the {size}-byte file is shorter than a GGUF header (24 bytes)"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            return f"no GGUF magic (the file starts with {bytes(m[:4])!r}, expected b'GGUF')"
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            return f"GGUF version {version} is not supported (2 or 3)"
        pos = 24

        def need(n: int, what: str) -> None:
            if pos + n > size:
                raise _Truncated(f"{what} is truncated: the file ends at byte {size}")

        def string(what: str) -> str:
            nonlocal pos
            need(8, what)
            (n,) = struct.unpack_from("<Q", m, pos)
            need(8 + n, what)
            out = bytes(m[pos + 8 : pos + 8 + n]).decode("utf-8", "replace")
            pos += 8 + n
            return out

        def value(vtype: int, what: str) -> None:
            nonlocal pos
            if vtype == 8:
                string(what)
            elif vtype == 9:
                need(12, what)
                etype, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if etype in _GGUF_VALUE_BYTES:
                    need(count * _GGUF_VALUE_BYTES[etype], what)
                    pos += count * _GGUF_VALUE_BYTES[etype]
                else:
                    for _ in range(count):
                        value(etype, what)
            elif vtype in _GGUF_VALUE_BYTES:
                need(_GGUF_VALUE_BYTES[vtype], what)
                pos += _GGUF_VALUE_BYTES[vtype]
            else:
                raise _Truncated(f"{what} has unknown value type {vtype}")

        alignment = 32
        try:
            for i in range(n_kv):
                key = string(f"metadata entry {i} of {n_kv}")
                what = f"metadata entry {i} of {n_kv} ({key!r})"
                need(4, what)
                (vtype,) = struct.unpack_from("<I", m, pos)
                pos += 4
                if key == "general.alignment" and vtype == 4:
                    need(4, what)
                    alignment = struct.unpack_from("<I", m, pos)[0] or 32
                value(vtype, what)
            infos = []
            for i in range(n_tensors):
                name = string(f"tensor info {i} of {n_tensors}")
                what = f"tensor info {i} of {n_tensors} ({name!r})"
                need(4, what)
                (n_dims,) = struct.unpack_from("<I", m, pos)
                need(4 + 8 * n_dims + 12, what)
                dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, dims, ttype, offset))
        except _Truncated as e:
            return str(e)
    data_start = -(-pos // alignment) * alignment
    seen: set[str] = set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            return f"tensor {name!r} appears twice"
        seen.add(name)
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            return f"tensor {name!r} has unknown type id {ttype}"
        n = 1
        for d in dims:
            n *= d
        end = data_start + offset + n // block * type_bytes
        if end > size:
            return (
                f"tensor {name!r} ({GGMLQuantizationType(ttype).name}, shape {list(reversed(dims))}) "
                f"is truncated: its data ends at byte {end}, the file at byte {size}"
            )
    return None


class _Truncated(Exception):
    pass


def _memo_key(path: Path, st: os.stat_result) -> str:
    """The memo key of one version of a file: any write to it changes its ctime (which, unlike
    mtime, cannot be set back), a replacement its inode."""
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|{st.st_dev}"


def _read_memo(memo: Path) -> dict[str, str]:
    try:
        with open(memo, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # absent or unreadable: rebuilt as files are hashed
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 64}


def _write_memo(memo: Path, entries: dict[str, str]) -> None:
    """Replace the memo atomically (a temporary file renamed over it); a failure (read-only or
    full disk) only costs a hash on a later start, so it is ignored, leaving no partial file."""
    tmp = None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{memo.name}-", dir=memo.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        os.replace(tmp, memo)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of the whole file ``path``, streamed (``hashlib.file_digest``; on Python
    3.10, which lacks it, 1 MiB reads).

    Remembered in ``cache_root() / HASH_MEMO`` under the file's path, size, mtime, ctime, inode
    and device: while none of them changes, the file is not read again. A file that changes
    while it is read is hashed again (its new version's hash is what is remembered).

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    memo = cache_root() / HASH_MEMO
    for _ in range(3):
        st = path.stat()
        key = _memo_key(path, st)
        entries = _read_memo(memo)
        if key in entries:
            return entries[key]
        with open(path, "rb") as f:
            if sys.version_info >= (3, 11):
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            else:
                h = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                digest = h.hexdigest()
        if _memo_key(path, path.stat()) != key:
            continue  # written meanwhile: the digest may mix two versions
        entries = _read_memo(memo)  # (another process may have added entries meanwhile)
        entries.pop(key, None)
        entries[key] = digest
        while len(entries) > _HASH_MEMO_MAX:
            entries.pop(next(iter(entries)))
        _write_memo(memo, entries)
        return digest
    raise OSError(errno.EBUSY, "the file kept changing while it was hashed", str(path))


def cache_dir_for(gguf_path: Path) -> Path:
    """Where the converted copy of ``gguf_path`` lives: keyed on the sha256 of the whole file
    (``file_sha256``, remembered across starts) and ``CONVERTER_VERSION``."""
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{file_sha256(gguf_path)}".encode())
    return cache_root() / f"{gguf_path.stem}-{h.hexdigest()[:16]}"


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


#: Gemma's layer tensors where they differ from Llama's (``ffn_norm`` is the pre-feedforward norm;
#: the norm after attention and after the MLP have their own names).
_GEMMA_LAYER_MAP = {
    **_LAYER_MAP,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

#: Qwen3's per-head q/k norms (Qwen2 files have none; the map is shared).
_QWEN_LAYER_MAP = {
    **_LAYER_MAP,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

_QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")

#: ``general.architecture`` values this converter reads -> their layer name map (``llama``'s
#: holds Mixtral's expert tensors too).
ARCHITECTURES = {
    "llama": {**_LAYER_MAP, **expert_layer_map("block_sparse_moe", ("w1", "w3", "w2"), shared=False)},
    "qwen2": _QWEN_LAYER_MAP,
    "qwen3": _QWEN_LAYER_MAP,
    "phi3": phi3_layer_map(_LAYER_MAP),
    "qwen2moe": {**_QWEN_LAYER_MAP, **expert_layer_map("mlp", _QWEN_EXPERTS, shared=True)},
    "qwen3moe": {**_QWEN_LAYER_MAP, **expert_layer_map("mlp", _QWEN_EXPERTS, shared=False)},
    "olmoe": {**_QWEN_LAYER_MAP, **expert_layer_map("mlp", _QWEN_EXPERTS, shared=False)},
    "gemma2": _GEMMA_LAYER_MAP,
    "gemma3": _GEMMA_LAYER_MAP,
}

#: The Llama-shaped architectures: ``general.architecture`` -> (transformers config class,
#: HF architecture); their metadata keys are ``<architecture>.*``.
LLAMA_SHAPED = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name of architecture ``arch``, or ``None`` for tensors HF does
    not store (``rope_freqs``, Phi-3's ``rope_factors_long`` / ``rope_factors_short``). An
    expert stack (``ffn_*_exps``) is named ``<layer>.<prefix>.experts.<projection>.weight``."""
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    layer_map = ARCHITECTURES[arch]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in layer_map:
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    if gguf_name in IGNORED:
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {arch} counterpart")


def permutes_qk(arch: str) -> bool:
    """Whether llama.cpp's converter interleaved the q/k rows of ``arch`` (only llama's)."""
    return arch == "llama"


def hf_float(arch: str, hf_name: str, arr: np.ndarray) -> np.ndarray:
    """A dequantized float tensor as the HF checkpoint holds it: llama.cpp stores Gemma's
    ``1 + weight`` RMSNorm scales as ``1 + weight`` already, HF the offset ``weight``."""
    if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        return arr - np.float32(1.0)
    return arr


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _required_int(reader, key: str, where: str) -> int:
    v = _field(reader, key)
    if v is None:
        raise ValueError(f"{where}: metadata key {key!r} is missing (needed to build the model config)")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{where}: metadata key {key!r} must be a positive integer, got {v!r}")
    return int(v)


def _number(reader, key: str, where: str, default: float, positive: bool) -> float:
    """Metadata ``key`` (``default`` when absent) as a float: finite and > 0 when ``positive``
    (a rope base), else >= 0 (a norm epsilon).

    Raises:
        ValueError: naming ``where`` and ``key``, for any other value.
    """
    v = _field(reader, key, default)
    ok = not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
    if ok and not (0 < float(v) < math.inf if positive else 0 <= float(v) < math.inf):
        ok = False
    if not ok:
        limit = "> 0" if positive else ">= 0"
        raise ValueError(f"{where}: metadata key {key!r} must be a finite number {limit}, got {v!r}")
    return float(v)


def check_architecture(reader, where: str) -> str:
    """``general.architecture`` (a key of ``ARCHITECTURES``).

    Raises:
        ValueError: naming ``where``, for any other architecture.
    """
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: general.architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return str(arch)


def _gemma_config(reader, arch: str, has_output: bool, where: str):
    """A ``Gemma2Config`` / ``Gemma3TextConfig`` from GGUF ``gemma2.*`` / ``gemma3.*`` metadata.

    What the metadata does not hold follows llama.cpp's reading of these files: the softmax
    scale's ``query_pre_attn_scalar`` is the head dimension except for the 27B models
    (46 layers for Gemma 2, 62 for Gemma 3: ``hidden / heads``); Gemma 3's sliding layers use
    rope base 10000 and every sixth layer is global; Gemma 2 alternates.
    """
    from transformers import Gemma2Config, Gemma3TextConfig

    hidden = _required_int(reader, f"{arch}.embedding_length", where)
    n_head = _required_int(reader, f"{arch}.attention.head_count", where)
    blocks = _required_int(reader, f"{arch}.block_count", where)
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // n_head)
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_kv, bool) or not isinstance(n_kv, (int, np.integer)) or n_kv <= 0 or n_head % n_kv:
        raise ValueError(
            f"{where}: metadata key '{arch}.attention.head_count_kv' must be a positive divisor of "
            f"'{arch}.attention.head_count' ({n_head}), got {n_kv!r}"
        )
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ValueError(
                f"{where}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' is in its metadata"
            )
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    big = blocks == (46 if arch == "gemma2" else 62)
    theta = _number(reader, f"{arch}.rope.freq_base", where, 10000.0, positive=True)
    full_rope: dict = {"rope_type": "default", "rope_theta": theta}
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        full_rope = {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
            "rope_theta": theta,
        }
    elif scaling not in (None, "none"):
        raise ValueError(f"{where}: GGUF rope scaling {scaling!r} is not supported")
    common = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_required_int(reader, f"{arch}.feed_forward_length", where),
        num_hidden_layers=blocks,
        num_attention_heads=n_head,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        max_position_embeddings=_required_int(reader, f"{arch}.context_length", where),
        rms_norm_eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", where, 1e-6, positive=False),
        query_pre_attn_scalar=hidden // n_head if big else head_dim,
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    cfg: Gemma2Config | Gemma3TextConfig
    try:
        if arch == "gemma2":
            cfg = Gemma2Config(
                **common,
                rope_parameters=full_rope,
                attn_logit_softcapping=_field(reader, "gemma2.attn_logit_softcapping"),
                final_logit_softcapping=_field(reader, "gemma2.final_logit_softcapping"),
            )
            cfg.architectures = ["Gemma2ForCausalLM"]
        else:
            cfg = Gemma3TextConfig(
                **common,
                rope_parameters={
                    "full_attention": full_rope,
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            )
            cfg.architectures = ["Gemma3ForCausalLM"]
        cfg.unk_token_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    except Exception as e:  # transformers' own config validation
        raise ValueError(f"{where}: its metadata describes no valid {arch} model: {e}") from None
    cfg.dtype = "float32"
    return cfg


def build_config(reader, has_output: bool, where: str = "GGUF file"):
    """A transformers config from GGUF ``<architecture>.*`` / ``tokenizer.ggml.*`` metadata: a
    ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (``LLAMA_SHAPED``), a ``Phi3Config``
    or a mixture-of-experts config (``gguf_families``: ``MixtralConfig`` for a ``llama`` file
    with ``llama.expert_count``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``OlmoeConfig``), or a
    Gemma config for ``gemma2`` / ``gemma3`` files (``_gemma_config``).

    Args:
        where: names the file in errors (e.g. ``"GGUF file '/p/m.gguf'"``).
    Raises:
        ValueError: another architecture, a missing / non-positive ``<architecture>.*`` size
            key, a negative rope base or norm epsilon (naming ``where`` and the key), or a
            config value ``config_checks.check_config_values`` refuses (naming ``where`` and
            the config field).
    """
    import transformers

    arch = check_architecture(reader, where)
    if arch.startswith("gemma"):
        return _gemma_config(reader, arch, has_output, where)
    common = _llama_shaped_kwargs(reader, arch, has_output, where)
    if arch == "phi3":
        cfg = phi3_config(reader, common, lambda k, d=None: _field(reader, k, d), where)
    elif has_experts(reader, arch):
        cfg = moe_config(
            reader,
            arch,
            common,
            lambda k, d=None: _field(reader, k, d),
            lambda k: _required_int(reader, k, where),
            where,
        )
    else:
        config_class, hf_arch = LLAMA_SHAPED[arch]
        try:
            cfg = getattr(transformers, config_class)(**common)
        except Exception as e:  # transformers' own config validation (e.g. heads that do not divide)
            raise ValueError(f"{where}: its metadata describes no valid {arch} model: {e}") from None
        cfg.architectures = [hf_arch]
    # not a named config parameter: set as the attribute the constructor would make of the
    # keyword (the saved config.json is the same)
    cfg.unk_token_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    cfg.dtype = "float32"
    # what no key-level check caught (a negative window, an end-of-text id past the
    # vocabulary), refused before anything is cached
    check_config_values(cfg, f"{where} (as a config)")
    return cfg


def _llama_shaped_kwargs(reader, arch: str, has_output: bool, where: str) -> dict:
    """The config keyword arguments every Llama-shaped architecture reads from its
    ``<arch>.*`` keys (sizes, heads, rope, norm epsilon, tied head, token ids).

    Raises:
        ValueError: naming ``where`` and the key: a missing or non-positive size, a
            ``head_count_kv`` that does not divide ``head_count``, an unsupported rope scaling.
    """
    hidden = _required_int(reader, f"{arch}.embedding_length", where)
    n_head = _required_int(reader, f"{arch}.attention.head_count", where)
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ValueError(
                f"{where}: neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens' is in its metadata"
            )
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = (
        _field(reader, f"{arch}.attention.key_length")
        or _field(reader, f"{arch}.rope.dimension_count")
        or hidden // n_head
    )
    rope = {
        "rope_type": "default",
        "rope_theta": _number(reader, f"{arch}.rope.freq_base", where, 10000.0, positive=True),
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        rope = {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
            "rope_theta": rope["rope_theta"],
        }
    elif scaling not in (None, "none"):
        raise ValueError(f"{where}: GGUF rope scaling {arch}.rope.scaling.type={scaling!r} is not supported")
    ffn = _required_int(reader, f"{arch}.feed_forward_length", where)
    blocks = _required_int(reader, f"{arch}.block_count", where)
    ctx = _required_int(reader, f"{arch}.context_length", where)
    n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_kv, bool) or not isinstance(n_kv, (int, np.integer)) or n_kv <= 0 or n_head % n_kv:
        raise ValueError(
            f"{where}: metadata key '{arch}.attention.head_count_kv' must be a positive divisor of "
            f"'{arch}.attention.head_count' ({n_head}), got {n_kv!r}"
        )
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=blocks,
        num_attention_heads=n_head,
        num_key_value_heads=int(n_kv),
        head_dim=int(head_dim),
        max_position_embeddings=ctx,
        rms_norm_eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", where, 1e-6, positive=False),
        rope_parameters=rope,
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        **({"attention_bias": False} if arch != "qwen2" else {}),
    )


def dequantize_tensors(reader, cfg) -> dict[str, torch.Tensor]:
    """All tensors as float32 torch tensors under HF names, q/k rows in HF order; an expert
    stack ``[E, ...]`` becomes one tensor per expert (``<prefix>.experts.<e>.<projection>``, the
    checkpoint names of the Hugging Face models)."""
    import torch
    from gguf.quants import dequantize

    arch = str(_field(reader, "general.architecture", "llama"))
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(s) for s in reversed(list(t.shape)))  # ggml lists dims innermost first
        arr = hf_float(arch, name, arr.reshape(hf_shape(name, shape)))
        if not permutes_qk(arch):
            pass
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_qk(arr, cfg.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_qk(arr, cfg.num_key_value_heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")  # own the memory (GGUF data is a read-only mmap)
        if t.name.split(".", 2)[-1] in EXPERT_STACKS:
            head, tail = name.rsplit(".experts.", 1)
            for e in range(arr.shape[0]):
                out[f"{head}.experts.{e}.{tail}"] = torch.from_numpy(arr[e].copy())
            continue
        out[name] = torch.from_numpy(arr)
    return out


def _where(gguf_path: Path) -> str:
    return f"GGUF file {str(gguf_path)!r}"


def check_tensors(reader, cfg, where: str) -> None:
    """Check the GGUF tensors' names and shapes against the model ``cfg`` describes, on a
    ``meta``-device model (nothing is allocated), before anything is converted or cached.

    Raises:
        ValueError: naming ``where`` and the GGUF tensor: a name without an HF Llama
            counterpart, a shape the config does not expect, or expected weights missing.
    """
    import torch

    from kvserve.model_executor.models import registry

    arch = str(_field(reader, "general.architecture", "llama"))
    model = registry.model_class(cfg, where)(cfg, torch.float32, "meta")
    check_expert_tensors(reader, cfg, where)
    loaded = set()
    for t in reader.tensors:
        try:
            name = hf_tensor_name(t.name, arch)
            if name is None:
                continue
            model.weight_target(name, hf_shape(name, tuple(int(s) for s in reversed(list(t.shape)))))
        except ValueError as e:
            raise ValueError(f"{where}: tensor {t.name!r}: {e}") from None
        loaded.add(name)
    try:
        model.check_all_loaded(loaded)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_expert_tensors(reader, cfg, where: str) -> None:
    """Raises ValueError naming ``where`` and the first GGUF tensor a sparse layer of a
    mixture-of-experts ``cfg`` lacks (router, the three expert stacks, Qwen2-MoE's shared
    expert and its gate); nothing for other models."""
    from kvserve.model_executor.models.moe import FAMILIES, is_sparse_layer

    fam = FAMILIES.get(getattr(cfg, "model_type", ""))
    if fam is None:
        return
    names = {t.name for t in reader.tensors}
    arch = str(_field(reader, "general.architecture", "llama"))
    wanted = [
        k
        for k in ARCHITECTURES[arch]
        if k.startswith("ffn_") and ("_exps" in k or "_inp" in k or "shexp" in k)
    ]
    for i in range(cfg.num_hidden_layers):
        if not is_sparse_layer(cfg, fam, i):
            continue
        for w in wanted:
            if f"blk.{i}.{w}" not in names:
                raise ValueError(
                    f"{where}: tensor 'blk.{i}.{w}' is missing (layer {i} has routed experts: "
                    f"{', '.join(wanted)})"
                )


def check_tokenizer_metadata(reader, where: str) -> None:
    """Raises ValueError naming ``where`` and the key when the GGUF metadata lacks what
    transformers' GGUF tokenizer loader reads (``tokenizer.ggml.model``, ``tokenizer.ggml.tokens``;
    ``merges`` for a ``gpt2`` (BPE) tokenizer, ``scores`` for a ``llama`` (SentencePiece) one)."""
    model = _field(reader, "tokenizer.ggml.model")
    needed = ["tokenizer.ggml.model", "tokenizer.ggml.tokens"]
    needed += {"gpt2": ["tokenizer.ggml.merges"], "llama": ["tokenizer.ggml.scores"]}.get(model, [])
    missing = [k for k in needed if k not in reader.fields]
    if missing:
        raise ValueError(
            f"{where} has no tokenizer: metadata key(s) {', '.join(map(repr, missing))} missing "
            "(kvserve takes the tokenizer and chat template from the GGUF metadata)"
        )


#: Architectures whose model config transformers' GGUF reader does not know.
_NO_TRANSFORMERS_READER = ("olmoe",)


def _save_tokenizer(gguf_path: Path, out_dir: Path, arch: str) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if arch in _NO_TRANSFORMERS_READER:
            # AutoTokenizer reads the model config first and refuses the architecture; the
            # tokenizer itself is built from tokenizer.ggml.* alone
            tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises KeyError / ValueError / ... on odd metadata
        raise ValueError(
            f"{_where(gguf_path)}: its tokenizer metadata cannot be loaded: {type(e).__name__}: {e}"
        ) from None
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the HF directory for ``gguf_path`` into (existing, empty) ``out_dir``.

    Raises:
        ValueError: naming the file (and the tensor or metadata key): not a readable GGUF, an
            unsupported architecture, missing config or tokenizer metadata, or a tensor without a HF counterpart,
            of the wrong shape, or missing (all checked before anything is written).
    """
    from safetensors.torch import save_file

    where = _where(gguf_path)
    reader = open_gguf(gguf_path)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    arch = check_architecture(reader, where)
    check_tokenizer_metadata(reader, where)
    cfg = build_config(reader, has_output, where)
    check_tensors(reader, cfg, where)
    tensors = dequantize_tensors(reader, cfg)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    cfg.save_pretrained(str(out_dir))
    _save_tokenizer(gguf_path, out_dir, arch)


def _clean_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _write_error(e: BaseException, final: Path) -> ValueError | None:
    """The error to raise for ``e``, raised while writing cache entry ``final``, when it is a
    failure of the disk (full, read-only, no permission) rather than of the file converted;
    None otherwise. The safetensors writer reports an I/O failure as its own error type whose
    message holds the OS error."""
    if isinstance(e, ValueError):  # the converter's verdict on the file, already named
        return None
    text = str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text:
        why = "no space left on the device"
    elif isinstance(e, OSError) or "os error" in text:
        why = f"{type(e).__name__}: {e}"
    else:
        return None
    return ValueError(
        f"cannot write the converted model into the cache directory {str(final.parent)!r} ({why}); "
        f"nothing was cached. Free space there, or set KVSERVE_CACHE_DIR to a writable directory "
        f"with room."
    )


def _cached(final: Path, write, complete) -> Path:
    """``final`` once ``complete(final)``, writing it first with ``write(tmp_dir)`` when absent.

    The entry is written into a temporary directory beside ``final`` and renamed into place:
    whatever fails (``write`` refusing the file, a full disk) leaves no directory behind.
    Concurrent callers may both write; the first rename wins and the other copy is dropped.

    Raises:
        ValueError: ``write``'s own errors; or the cache cannot be written (a full disk, a
            read-only or unwritable directory), naming the directory (``_write_error``).
    """
    if complete(final):
        return final
    root = final.parent
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(root)
        if final.exists():  # incomplete leftovers (should not happen with rename) -> redo
            shutil.rmtree(final, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        write(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not complete(final):
                raise
    except Exception as e:
        err = _write_error(e, final)
        if err is None:
            raise
        raise err from e
    finally:
        if tmp is not None and tmp.exists():
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
        ValueError: naming the file: not a readable GGUF of a supported architecture, missing config or tokenizer
            metadata, or tensors whose names or shapes do not fit it (``check_tensors``: a
            file the loader will refuse gets no cache entry either).
    """
    where = _where(gguf_path)
    reader = open_gguf(gguf_path)
    arch = check_architecture(reader, where)
    check_tokenizer_metadata(reader, where)
    cfg = build_config(reader, any(t.name == "output.weight" for t in reader.tensors), where)
    check_tensors(reader, cfg, where)
    del reader
    cfg.save_pretrained(str(out_dir))
    _save_tokenizer(gguf_path, out_dir, arch)


def metadata_dir(gguf_path: Path) -> Path:
    """The cached directory of ``write_metadata`` for ``gguf_path`` (``<converted dir>-meta``).

    Raises:
        ValueError: the file cannot be read as a GGUF of a supported architecture (naming it).
    """
    gguf_path = Path(gguf_path).resolve()
    final = cache_dir_for(gguf_path)
    final = final.with_name(final.name + "-meta")
    return _cached(final, lambda tmp: write_metadata(gguf_path, tmp), lambda d: (d / "config.json").is_file())
