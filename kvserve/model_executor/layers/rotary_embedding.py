"""Rotary position embedding (Su et al., RoFormer 2021) in the "rotate half" layout.

The head dimension is split in two halves ``(x1, x2)``; position ``p`` rotates pair
``(x1[i], x2[i])`` by angle ``p * inv_freq[i]``. This is the layout of Hugging Face Llama
checkpoints (llama.cpp's GGUF uses interleaved pairs; ``gguf_convert`` undoes that).

Supported scaling types (``rope_type``): ``default``, ``linear`` (positions divided by
``factor``), ``llama3`` (Llama 3.1 frequency-dependent scaling: long wavelengths divided by
``factor``, short ones kept, a smooth blend between), ``longrope`` (Phi-3 / Phi-4-mini, also
spelled ``su``: per-frequency divisors ``short_factor`` / ``long_factor`` and cos/sin scaled by
an attention factor; see ``RotaryEmbedding`` for which set a token uses). A
``partial_rotary_factor`` below 1 rotates only the first ``rotary_dim`` entries of each head.
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
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in params and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
    if "max_position_embeddings" not in params:
        params["max_position_embeddings"] = getattr(hf_config, "max_position_embeddings", None)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """Entries of each head that are rotated: ``int(head_dim * partial_rotary_factor)``.

    Raises:
        ValueError: a ``partial_rotary_factor`` outside ``(0, 1]`` or one giving an odd or zero
            rotary dimension.
    """
    factor = float(params.get("partial_rotary_factor") or 1.0)
    dim = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or dim < 2 or dim % 2:
        raise ValueError(
            f"partial_rotary_factor={factor} gives rotary dimension {dim} of head_dim={head_dim}; "
            "it must be in (0, 1] and give an even, non-zero dimension"
        )
    return dim


def longrope_threshold(params: dict[str, Any]) -> int | None:
    """``original_max_position_embeddings`` of a ``longrope`` config (the length past which its
    long factors apply), else ``None``."""
    if params["rope_type"] != "longrope":
        return None
    return int(params["original_max_position_embeddings"])


def _longrope_factors(dim: int, params: dict[str, Any], key: str) -> torch.Tensor:
    factors = params.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
        raise ValueError(
            f"rope_scaling.{key} must be a list of {dim // 2} numbers (rotary dimension {dim} / 2), "
            f"got {factors!r}"
        )
    return torch.tensor([float(f) for f in factors], dtype=torch.float64)


def longrope_attention_factor(params: dict[str, Any]) -> float:
    """The factor LongRoPE multiplies cos and sin by: ``attention_factor`` when given, else
    ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` with the scale
    ``s = factor`` or ``max_position_embeddings / original_max_position_embeddings``
    (1 when ``s <= 1``) -- the rule of the LongRoPE paper (Ding et al., 2024) as Phi-3 uses it."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    omp = float(params["original_max_position_embeddings"])
    scale = params.get("factor")
    if scale is None:
        scale = float(params["max_position_embeddings"]) / omp
    scale = float(scale)
    return 1.0 if scale <= 1.0 else math.sqrt(1.0 + math.log(scale) / math.log(omp))


def compute_inv_freq(head_dim: int, params: dict[str, Any], long: bool = False) -> torch.Tensor:
    """Inverse frequencies, float32 ``[head_dim // 2]``, after the configured scaling.

    Args:
        head_dim: the rotary dimension (``rotary_dim``).
        long: for ``longrope``, the ``long_factor`` set (else ``short_factor``); ignored otherwise.
    Raises:
        ValueError: for an unsupported ``rope_type`` or a missing scaling field.
    """
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        pass
    elif rope_type == "longrope":
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise ValueError(f"rope_scaling.rope_type='longrope' needs rope_scaling.{key}")
        inv = inv / _longrope_factors(head_dim, params, "long_factor" if long else "short_factor")
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
        raise ValueError(
            f"rope_scaling.rope_type {rope_type!r} is not supported "
            "(supported: default, linear, llama3, longrope)."
        )
    return inv.to(torch.float32)


class RotaryEmbedding:
    """Precomputed cos/sin tables and their application to query/key heads.

    Args:
        head_dim: the full head dimension; the first ``rotary_dim`` entries (all, unless
            ``partial_rotary_factor`` < 1) are rotated, the rest pass through.
        max_position: table length; positions must be ``< max_position``.
        params: output of ``get_rope_parameters``.

    LongRoPE (``longrope_after`` set: the config's ``original_max_position_embeddings``) keeps
    two tables, short and long factors, both scaled by ``longrope_attention_factor``; the table
    below ``max_position`` rows is the short one, the one above the long one. Which one a token
    uses follows transformers' Phi-3 rotary: one forward rotates all its tokens with the long
    factors when its largest position + 1 exceeds ``original_max_position_embeddings``, else
    with the short ones; keys already cached keep their rotation. Generation runs the prompt as
    one forward and each new token as its own, so token ``p`` of a sequence with an ``L``-token
    prompt is rotated long when ``max(L, p + 1) > original_max_position_embeddings``, i.e. when
    the prompt is longer than that or ``p >= original_max_position_embeddings``. The runner
    passes the first condition per token (``lookup``'s ``long_prompt``): the answer then does
    not depend on how the prompt is chunked, batched or recomputed. (transformers' Phi-3
    ``generate`` goes one step further: when a sequence first grows past the threshold it drops
    its cache and recomputes every earlier key with the long factors. A paged cache keeps the
    keys it has, so from that token on log-probabilities differ slightly from ``generate``'s,
    while they equal a step-by-step forward with transformers' own cache.)
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype=torch.float32, device=None
    ):
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        self.max_position = max_position
        self.longrope_after = longrope_threshold(params)
        t = torch.arange(max_position, dtype=torch.float32)
        tables = [compute_inv_freq(self.rotary_dim, params)]
        scale = 1.0
        if self.longrope_after is not None:
            tables.append(compute_inv_freq(self.rotary_dim, params, long=True))
            scale = longrope_attention_factor(params)
        freqs = torch.cat([torch.outer(t, inv) for inv in tables])  # [n * max_pos, rotary_dim/2]
        self.cos = (freqs.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * scale).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor, long_prompt: torch.Tensor | None = None):
        """``(cos, sin)`` for ``positions`` (int64 ``[T]``), each ``[T, 1, rotary_dim/2]``.

        ``long_prompt``: bool ``[T]``, whether each token's sequence has a prompt longer than
        ``longrope_after`` (LongRoPE only; ``None`` counts every prompt as short, so only
        positions past it use the long factors).
        """
        if self.longrope_after is not None:
            use_long = positions >= self.longrope_after
            if long_prompt is not None:
                use_long = use_long | long_prompt
            positions = positions + use_long.to(positions.dtype) * self.max_position
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[T, heads, head_dim]``, may be a strided view) -> new contiguous tensor.

        Only the first ``2 * cos.shape[-1]`` entries of each head are rotated; the rest are
        copied unchanged (partial rotary).
        """
        half = cos.shape[-1]
        if 2 * half != x.shape[-1]:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            out[..., 2 * half :] = x[..., 2 * half :]
            out[..., : 2 * half] = RotaryEmbedding.apply(x[..., : 2 * half], cos, sin)
            return out
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
