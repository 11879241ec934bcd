"""Quantized KV-cache rows: one byte per value and a scale per (token, KV head).

A quantized cache keeps the layout of ``kvserve.worker.cache_engine`` with a wider last
dimension: each row of ``head_dim`` values (one token of one KV head, K or V) is stored as
``head_dim`` one-byte codes followed by 2 bytes holding the row's scale as float16::

    row = [code_0 .. code_{D-1}, scale (float16, little-endian)]      # D + 2 bytes
    value_i = float(code_i) * scale

The codes are ``int8`` (symmetric, ``scale = max|x| / 127``, rounded to nearest) or
``float8_e4m3fn`` / ``float8_e5m2`` (``scale = max|x| / 448`` or ``/ 57344``, the formats'
largest finite values; rounding as torch's cast). The scale is rounded to float16 *before* the
codes are computed, so the codes are exact against the stored scale.

Why one scale per (token, head):
    a token's K/V are written once (prefill chunk or decode) and never change, so a row is
    quantized exactly when written and never re-quantized when its block fills (a per-block
    scale would need that, or a guess); outliers of one token do not widen the step of another.
Why in the row, as float16:
    the scale moves with its codes in every block copy (swap, copy-on-write, prefix reuse)
    without any code of its own; 2 bytes instead of 4 keep head_dim 64 at 66 bytes a row
    (1.94x fewer than bfloat16, 3.88x fewer than float32). Scales are clamped to
    ``[2**-14, 65504]`` (float16's normal range): rows with ``max|x| < 2**-14 * 127`` are
    quantized with a finer step than they need, rows beyond ``65504 * 127`` saturate.
"""

from __future__ import annotations

import torch

#: ``kv_cache_dtype`` (``config.KV_CACHE_DTYPES``, ``fp8`` already spelled ``fp8_e4m3``) ->
#: storage dtype of a quantized cache.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: Largest code magnitude per storage dtype (the scale maps ``max|x|`` to it).
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: Bytes after the codes of a row: its float16 scale.
SCALE_BYTES = 2
_SCALE_MIN = 2.0**-14
_SCALE_MAX = 65504.0


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of ``kv_cache_dtype`` is stored in (``auto``: ``model_dtype``).

    Raises:
        ValueError: an unknown ``kv_cache_dtype`` (naming ``--kv-cache-dtype``).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    if name not in STORAGE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not one of auto, {', '.join(STORAGE_DTYPES)}"
        )
    return STORAGE_DTYPES[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """True when a cache of this storage dtype holds codes + scales (``STORAGE_DTYPES``)."""
    return dtype in QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: ``head_dim``, plus ``SCALE_BYTES`` for a quantized dtype."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` ``[N, D]`` (any float dtype, D even) as quantized cache rows.

    Returns:
        int8 ``[N, D + 2]``: the bytes of the codes (``dtype``: ``STORAGE_DTYPES`` values) and
        each row's float16 scale (see the module doc), ready to be copied into the cache's
        byte view.
    """
    N, D = x.shape
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / qmax).clamp_(_SCALE_MIN, _SCALE_MAX).to(torch.float16)
    y = (xf / scale.float().unsqueeze(1)).clamp_(-qmax, qmax)
    rows = torch.empty(N, D + SCALE_BYTES, dtype=torch.int8, device=x.device)
    if dtype == torch.int8:
        rows[:, :D] = y.round_().to(torch.int8)
    else:
        rows[:, :D] = y.to(dtype).view(torch.int8)
    rows[:, D:].view(torch.float16)[:, 0] = scale
    return rows


def dequantize(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., D + 2]`` (int8 bytes or a view of them, codes of ``dtype``) back to
    values ``[..., D]`` of ``out_dtype`` (computed in float32: ``code * scale``)."""
    b = rows.view(torch.int8)
    D = b.shape[-1] - SCALE_BYTES
    codes = b[..., :D]
    if dtype != torch.int8:
        codes = codes.view(dtype)
    scale = b[..., D:].view(torch.float16).float()
    return (codes.float() * scale).to(out_dtype)
