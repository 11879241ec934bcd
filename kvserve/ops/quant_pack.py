"""Build GGUF Q4_1 / Q8_0 blocks (``quant.QuantWeight``) from integer codes and scales,
and quantize a float weight to Q4_1 (``quantize_q4_1``, the ``int4`` method).

The checkpoint formats (``quantized_checkpoint``) unpack their codes and repack them here, so
the existing kernels run them:

- Q4_1, per 32 weights: float16 ``d`` and ``m``, 4-bit codes ``q`` in ``[0, 15]``, weight
  ``d * q + m``. Bytes of a block: ``d``, ``m``, then 16 bytes whose low nibbles hold codes
  0-15 and high nibbles codes 16-31.
- Q8_0, per 32 weights: float16 ``d``, int8 codes, weight ``d * q``.

GGUF Q5_0 blocks, which have no kernel, are repacked losslessly into Q8_0 (``q8_0_from_q5_0``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.ops.quant import BLOCK_ELEMS, QuantWeight


def _check_codes(codes: torch.Tensor, scales: list[torch.Tensor], what: str) -> tuple[int, int]:
    if codes.dim() != 2 or codes.shape[1] % BLOCK_ELEMS or codes.shape[1] == 0:
        raise ValueError(
            f"{what}: codes must be [out, in] with in a positive multiple of {BLOCK_ELEMS}, "
            f"got {tuple(codes.shape)}"
        )
    n, k = codes.shape
    for s in scales:
        if tuple(s.shape) != (n, k // BLOCK_ELEMS):
            raise ValueError(f"{what}: scales must be [{n}, {k // BLOCK_ELEMS}], got {tuple(s.shape)}")
    return n, k


def pack_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QuantWeight:
    """Q4_1 blocks of ``w = d * codes + m``.

    Args:
        codes: ``[out, in]`` integers in ``[0, 15]`` (any integer dtype); ``in`` a multiple of 32.
        d, m: ``[out, in / 32]`` per-block scale and offset (cast to float16).
    Raises:
        ValueError: shapes that do not fit, or a code outside ``[0, 15]``.
    """
    n, k = _check_codes(codes, [d, m], "pack_q4_1")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("pack_q4_1: codes must lie in [0, 15]")
    q = codes.to(torch.uint8).reshape(n, k // BLOCK_ELEMS, BLOCK_ELEMS)
    qs = q[..., :16] | (q[..., 16:] << 4)
    dm = torch.stack([d.to(torch.float16), m.to(torch.float16)], dim=-1).contiguous()
    data = torch.cat([dm.view(torch.uint8), qs], dim=-1).reshape(n, -1)
    return QuantWeight(data.contiguous(), "q4_1", k)


def pack_q8_0(codes: torch.Tensor, d: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks of ``w = d * codes``.

    Args:
        codes: ``[out, in]`` integers in ``[-128, 127]``; ``in`` a multiple of 32.
        d: ``[out, in / 32]`` per-block scale (cast to float16).
    Raises:
        ValueError: shapes that do not fit, or a code outside int8.
    """
    n, k = _check_codes(codes, [d], "pack_q8_0")
    if codes.numel() and (int(codes.min()) < -128 or int(codes.max()) > 127):
        raise ValueError("pack_q8_0: codes must lie in [-128, 127]")
    q = codes.to(torch.int8).reshape(n, k // BLOCK_ELEMS, BLOCK_ELEMS).view(torch.uint8)
    # a fresh tensor: a view (e.g. a transposed [out, 1]) may keep a stride that ``view`` refuses
    dd = torch.empty(n, k // BLOCK_ELEMS, 1, dtype=torch.float16)
    dd[..., 0] = d
    dd = dd.view(torch.uint8)
    return QuantWeight(torch.cat([dd, q], dim=-1).reshape(n, -1).contiguous(), "q8_0", k)


#: Bytes of a GGUF Q5_0 block: float16 ``d``, 4 bytes of high bits, 16 bytes of low nibbles.
Q5_0_BLOCK_BYTES = 22
#: Bytes of a Q8_0 block: float16 ``d``, 32 int8 codes.
Q8_0_BLOCK_BYTES = 34


def q8_0_from_q5_0(blocks: np.ndarray) -> np.ndarray:
    """GGUF Q5_0 blocks rewritten as Q8_0 blocks holding exactly the same weights.

    A Q5_0 block (ggml's ``block_q5_0``) stores per 32 weights a float16 ``d``, a little-endian
    uint32 ``qh`` whose bit ``i`` is bit 4 of code ``i``, and 16 bytes whose low nibbles hold
    bits 0-3 of codes 0-15 and high nibbles those of codes 16-31; weight ``i`` is
    ``d * (q_i - 16)`` with ``q_i`` in ``[0, 31]``. That is a Q8_0 block with the same ``d``
    bytes and int8 codes ``q_i - 16`` in ``[-16, 15]``, so the dequantized values are
    bit-identical (both compute ``float(d) * code``). Vectorized over all blocks.

    Args:
        blocks: uint8 ``[..., n * 22]``: rows of whole Q5_0 blocks (e.g. ``[out, row_bytes]``).
    Returns:
        uint8 ``[..., n * 34]``, a new C-contiguous array of Q8_0 blocks (34/22 of the bytes).
    Raises:
        ValueError: not uint8, or a last dimension that is not whole blocks.
    """
    if blocks.dtype != np.uint8 or blocks.ndim == 0 or blocks.shape[-1] % Q5_0_BLOCK_BYTES:
        raise ValueError(
            f"q8_0_from_q5_0: need uint8 rows of whole {Q5_0_BLOCK_BYTES}-byte blocks, "
            f"got {blocks.dtype} {blocks.shape}"
        )
    lead = blocks.shape[:-1]
    nb = blocks.shape[-1] // Q5_0_BLOCK_BYTES
    b = blocks.reshape(-1, Q5_0_BLOCK_BYTES)
    high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")  # [blocks, 32]: bit i of qh
    qs = b[:, 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    out = np.empty((b.shape[0], Q8_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, :2] = b[:, :2]
    # (q - 16) as int8 two's complement, written as uint8 bytes
    np.subtract(low | (high << 4), 16, out=out[:, 2:], casting="unsafe")
    return out.reshape(*lead, nb * Q8_0_BLOCK_BYTES)


#: Candidate ranges of a block for the Q4_1 search: fractions of its ``max - min`` trimmed
#: from the low and the high end (``(0, 0)`` = plain min/max).
_CANDIDATES = ((0.0, 0.0), (0.04, 0.0), (0.0, 0.04))
#: Least-squares refits of ``(d, m)`` per candidate (each evaluated).
_REFITS = 2
#: Weights quantized at a time: bounds the search's temporaries (a few times 4 bytes each)
#: while keeping the number of tensor operations, whose fixed cost dominates small ones, low.
_WEIGHTS_PER_CHUNK = 1 << 22


def _q4_1_eval(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """float16-rounded ``(d, m)``, codes (float) and squared error ``[B, 1]`` of ``blocks``
    ``[B, 32]`` quantized with candidate ``(d, m)`` ``[B, 1]``."""
    d16, m16 = d.half().float(), m.half().float()
    inv = torch.where(d16 > 0, 1.0 / d16, torch.zeros((), dtype=torch.float32))
    q = (blocks - m16).mul_(inv).round_().clamp_(0, 15)
    r = q * d16
    r += m16
    r -= blocks
    return d16, m16, q, r.mul_(r).sum(-1, keepdim=True)


def _search_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best float16 ``(d, m)`` ``[B, 1]`` found for ``blocks`` ``[B, 32]`` float32."""
    n = blocks.shape[1]
    sw = blocks.sum(-1, keepdim=True)
    lo0 = blocks.amin(dim=-1, keepdim=True)
    hi0 = blocks.amax(dim=-1, keepdim=True)
    span = hi0 - lo0
    best_d, best_m, _, best_err = _q4_1_eval(blocks, span / 15, lo0)
    for t_lo, t_hi in _CANDIDATES:
        d, m = span * ((1 - t_lo - t_hi) / 15), lo0 + t_lo * span
        for step in range(_REFITS + 1):
            d16, m16, q, err = _q4_1_eval(blocks, d, m)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_d = torch.where(better, d16, best_d)
            best_m = torch.where(better, m16, best_m)
            if step == _REFITS:
                break
            # least-squares (d, m) for these codes: minimise sum (d q + m - w)^2
            sq, sqq, sqw = (
                q.sum(-1, keepdim=True),
                (q * q).sum(-1, keepdim=True),
                (q * blocks).sum(-1, keepdim=True),
            )
            den = n * sqq - sq * sq
            ok = den > 0  # not all codes equal
            d = torch.where(ok, (n * sqw - sq * sw) / torch.where(ok, den, 1.0), d).clamp_min(0)
            m = torch.where(ok, (sw - d * sq) / n, m)
    return best_d, best_m


def quantize_q4_1(weight: torch.Tensor) -> QuantWeight:
    """``weight`` ``[out, in]`` (float, CPU) as Q4_1 blocks, each block's ``(d, m)`` chosen by
    a small search for the lowest squared error.

    The idea is llama.cpp's (its ``make_qkx`` quantizers: try several ranges, refit the scale
    and offset to the rounded codes, keep the best); this is our own, smaller version: for a
    few trimmed ranges ``[lo, hi]`` of the block (``_CANDIDATES``), round the codes, refit
    ``(d, m)`` by least squares to them (``_REFITS`` times), and keep the candidate (plain
    min/max included) with the lowest squared error after the float16 rounding of ``d`` and
    ``m``. So the error is never worse than min/max quantization's (at most ``d / 2`` per
    weight, plus the float16 rounding of ``d`` and ``m``); on Gaussian weights the mean squared
    error is below min/max's (tests/model_executor/test_int4_quantization.py holds both).

    Raises:
        ValueError: not a 2-D CPU float tensor, or ``in`` not a positive multiple of 32.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.device.type != "cpu":
        raise ValueError(
            f"quantize_q4_1: need a 2-D CPU float weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    n, k = weight.shape
    if k <= 0 or k % BLOCK_ELEMS:
        raise ValueError(f"quantize_q4_1: in_features={k} is not a positive multiple of {BLOCK_ELEMS}")
    codes = torch.empty(n, k, dtype=torch.uint8)
    ds = torch.empty(n, k // BLOCK_ELEMS, dtype=torch.float16)
    ms = torch.empty_like(ds)
    rows = max(1, _WEIGHTS_PER_CHUNK // k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        blocks = weight[r0:r1].detach().float().reshape(-1, BLOCK_ELEMS)
        d, m = _search_q4_1(blocks)
        _, _, q, _ = _q4_1_eval(blocks, d, m)
        codes[r0:r1] = q.reshape(r1 - r0, k).to(torch.uint8)
        ds[r0:r1] = d.reshape(r1 - r0, -1).half()
        ms[r0:r1] = m.reshape(r1 - r0, -1).half()
    return pack_q4_1(codes, ds, ms)
