"""Applying token bitmasks to a batch of logits (one vectorised pass for all constrained rows).

A bitmask row is int32 ``[ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32`` is 1 when token
``t`` is allowed (llguidance's layout, little-endian words).
"""

from __future__ import annotations

import torch

from kvserve.ops import bitmask as bitmask_kernel

# byte value -> its 8 bits, least significant first: expanding a bitmask is one gather.
_BYTE_BITS = torch.tensor([[(b >> i) & 1 for i in range(8)] for b in range(256)], dtype=torch.bool)
_tables: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[R, vocab_size]`` from an int32 bitmask ``[R, W]`` (on the bitmask's device).

    Tokens past ``32 * W`` (a model vocabulary larger than the grammar's) are not allowed.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
    device = bitmask.device
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = _BYTE_BITS.to(device)
    rows = bitmask.shape[0]
    bits = table[bitmask.contiguous().view(torch.uint8).long()].view(rows, -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - bits.shape[1], dtype=torch.bool, device=device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    The C kernel (``bitmask_kernel``) for contiguous CPU float32 logits, else torch.

    Args:
        logits: float ``[N, V]``.
        rows: int64 ``[R]`` rows of ``logits`` that ``bitmask`` constrains (``None``: all ``N``).
        bitmask: int32 ``[R, ceil(V / 32)]`` (any device; moved to the logits' device).
    """
    if bitmask_kernel.supported(logits, bitmask):
        bitmask_kernel.apply_token_bitmask_(logits, rows, bitmask)
        return
    apply_token_bitmask_torch_(logits, rows, bitmask)


def apply_token_bitmask_torch_(
    logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor
) -> None:
    """``apply_token_bitmask_`` in torch (any device and float dtype): the reference of the kernel."""
    bitmask = bitmask.to(logits.device)
    if rows is None:
        logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
        return
    rows = rows.to(logits.device)
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, rows, sub)
