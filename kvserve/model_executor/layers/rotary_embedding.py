"""Rotary position embedding (Su et al., RoFormer 2021) in the "rotate half" layout.

The head dimension is split in two halves ``(x1, x2)``; position ``p`` rotates pair
``(x1[i], x2[i])`` by angle ``p * inv_freq[i]``. This is the layout of Hugging Face Llama
checkpoints (llama.cpp's GGUF uses interleaved pairs; ``gguf_convert`` undoes that).

Supported scaling types (``rope_type``): ``default``, ``linear`` (positions divided by
``factor``), ``llama3`` (Llama 3.1 frequency-dependent scaling: long wavelengths divided by
``factor``, short ones kept, a smooth blend between).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def get_rope_parameters(hf_config, layer_type: str = "full_attention") -> dict[str, Any]:
    """Rope settings of a HF config as one dict with at least ``rope_type`` and ``rope_theta``.

    Reads ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta`` (older).
    A per-layer-type ``rope_parameters`` (``{"full_attention": {...}, "sliding_attention":
    {...}}``, Gemma 3) gives ``layer_type``'s entry; the older Gemma 3 form has the sliding
    layers' base in ``rope_local_base_freq`` and no scaling for them.
    """
    params: dict[str, Any] = {}
    rp = getattr(hf_config, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]  # per-layer-type form
    elif isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    if (
        layer_type == "sliding_attention"
        and getattr(hf_config, "rope_local_base_freq", None)
        and not (isinstance(rp, dict) and "rope_theta" in rp)
    ):
        return {"rope_type": "default", "rope_theta": float(hf_config.rope_local_base_freq)}
    if isinstance(rp, dict):
        params.update(rp)
    rs = getattr(hf_config, "rope_scaling", None)
    if isinstance(rs, dict):
        for k, v in rs.items():
            params.setdefault(k, v)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies, float32 ``[head_dim // 2]``, after the configured scaling.

    Raises:
        ValueError: for an unsupported ``rope_type`` or a missing scaling field.
    """
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # smooth = 0 -> fully scaled (long wavelengths), 1 -> unscaled (short wavelengths)
        smooth = ((old_len / wavelen) - low) / (high - low)
        smooth = smooth.clamp(0.0, 1.0)
        inv = (1 - smooth) * inv / factor + smooth * inv
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3).")
    return inv.to(torch.float32)


class RotaryEmbedding:
    """Precomputed cos/sin tables and their application to query/key heads.

    Args:
        head_dim: rotary dimension (the full head dimension).
        max_position: table length; positions must be ``< max_position``.
        params: output of ``get_rope_parameters``.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype=torch.float32, device=None
    ):
        self.head_dim = head_dim
        self.max_position = max_position
        inv = compute_inv_freq(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_pos, head_dim/2]
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor):
        """``(cos, sin)`` for ``positions`` (int64 ``[T]``), each ``[T, 1, head_dim/2]``."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[T, heads, head_dim]``, may be a strided view) -> new contiguous tensor."""
        half = x.shape[-1] // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1 = out[..., :half]
        o2 = out[..., half:]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        return out
