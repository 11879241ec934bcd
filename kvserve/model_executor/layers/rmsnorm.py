"""Root-mean-square layer norm (Zhang & Sennrich, 2019), with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.ops import elementwise


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x**2, -1) + eps) * weight``, computed in float32.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = float(eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            var = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(var + self.eps) * self.weight
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (``[..., hidden_size]``).

        With ``residual`` given, first adds ``x`` into ``residual`` in place and returns
        ``(norm(residual), residual)`` -- the residual stream is updated where it lies. On CPU
        (contiguous ``[T, H]`` float32/bfloat16) this is one fused native pass
        (``elementwise.rms_norm``), else torch ops.
        """
        if x.dim() == 2 and elementwise.supported(x, self.weight, *(() if residual is None else (residual,))):
            out = elementwise.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        s = residual.add_(x)
        return self._norm(s), s


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x**2, -1) + eps) * (1 + weight)``, all in float32,
    cast to ``x``'s dtype only at the end (the weight is stored as an offset from 1, so a zero
    weight is the identity scale).

    Args:
        hidden_size: size of the last dimension (a head's ``head_dim`` for q/k norms).
        eps: added to the mean square before the square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = float(eps)
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """float32 ``1 + weight``, kept until the weight changes (loading writes it in place:
        its version moves)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + self.weight.float())
        return self._scale[1]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.scale()).to(x.dtype)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise ``x`` (``[..., hidden_size]``); returns a new tensor of ``x``'s dtype, with
        ``add`` (``x``'s shape and dtype) ``add + norm(x)`` (Gemma's residual add after a
        post-norm). On CPU (contiguous ``[T, H]`` float32/bfloat16) one native pass
        (``elementwise.offset_rms_norm``), else torch ops."""
        if x.dim() == 2 and elementwise.supported(x, *(() if add is None else (add,))):
            return elementwise.offset_rms_norm(x, self.scale(), self.eps, add)
        return self._norm(x) if add is None else add + self._norm(x)

    def normalize_heads_(self, qkv: torch.Tensor, start: int, heads: int) -> None:
        """Normalise in place each of ``heads`` head vectors (``hidden_size`` elements) in columns
        ``[start, start + heads * hidden_size)`` of ``qkv`` ``[T, C]`` (Gemma 3's q/k norms on the
        fused projection); natively on contiguous CPU float32/bfloat16."""
        D = self.weight.shape[0]
        if qkv.dim() == 2 and elementwise.supported(qkv):
            elementwise.offset_rms_norm_heads_(qkv, start, heads, self.scale(), self.eps)
            return
        part = qkv[:, start : start + heads * D].view(qkv.shape[0], heads, D)
        part.copy_(self._norm(part))
