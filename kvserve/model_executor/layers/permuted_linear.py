"""A linear weight whose input columns were reordered at load (``InputPermutedWeight``).

GPTQ's act-order (``desc_act``) checkpoints assign input channels to quantization groups in
an arbitrary order (``g_idx``). Sorting the channels by group makes every group a contiguous
run of columns, so the weight fits 32-weight blocks; the activations are then gathered with the
same permutation before the GEMM: ``x @ W^T == x[:, perm] @ W[:, perm]^T``.
"""

from __future__ import annotations

import torch


class InputPermutedWeight:
    """``weight`` (``[out, in]``, its columns in the order ``perm``) and ``perm``.

    Args:
        weight: the column-permuted weight (a ``quant.QuantWeight``).
        perm: int64 ``[in]``, a permutation of ``range(in)``: column ``j`` of ``weight`` is
            column ``perm[j]`` of the original weight.
    Raises:
        ValueError: ``perm`` is not a permutation of the weight's input features.
    """

    __slots__ = ("weight", "perm")

    def __init__(self, weight, perm: torch.Tensor):
        k = int(weight.shape[1])
        perm = perm.to(torch.int64).contiguous()
        if perm.shape != (k,) or not torch.equal(torch.sort(perm).values, torch.arange(k)):
            raise ValueError(f"InputPermutedWeight: perm must be a permutation of range({k})")
        self.weight = weight
        self.perm = perm

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` with its columns in the weight's order (a new tensor)."""
        return x.index_select(-1, self.perm)
