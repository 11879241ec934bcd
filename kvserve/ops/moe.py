"""The mixture-of-experts MLP as native calls (``kvserve/csrc/moe.c``: algorithm, numerics and
why): ``route`` (softmax, top-k, renormalise in one pass) and ``experts`` (every active expert's
SwiGLU MLP, the gather and the weighted scatter in one call).

Used by ``kvserve.model_executor.layers.fused_moe`` for CPU tensors of float32 or bfloat16
(``supported``); torch otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGS = {
    "moe_route_f32": [_p, _i64, _i64, _i64, _i, _i, _p, _p, _i],
    **{
        f"moe_experts_{s}": [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i]
        for s in DTYPE_SUFFIX.values()
    },
}
_LIB = NativeLibrary(
    "kv_moe", "moe.c", _SIGS, restypes={f"moe_experts_{s}": ctypes.c_int for s in DTYPE_SUFFIX.values()}
)


def available() -> bool:
    """Whether the kernels built and loaded (False with ``KVSERVE_NATIVE=0`` or no C compiler)."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``experts`` takes these tensors: the kernels are available, all on CPU, ``x`` 2-D
    and the stacks 3-D, all of one float32/bfloat16 dtype."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPE_SUFFIX
        and x.dim() == 2
        and w13.dim() == 3
        and w2.dim() == 3
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and w13.device.type == "cpu"
        and w2.device.type == "cpu"
        and available()
    )


def k_major(stack: torch.Tensor) -> torch.Tensor:
    """``stack`` ``[E, N, K]`` with the same values and shape in the layout ``experts`` reads in
    place: a strided view of k-major storage ``[E, K, N]`` (``stack`` itself when already so)."""
    if stack.transpose(1, 2).is_contiguous():
        return stack
    return stack.transpose(1, 2).contiguous().transpose(1, 2)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_bfloat16: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing of ``logits`` ``[T, E]`` (any float dtype; taken in float32).

    Returns:
        ``(weights [T, top_k] float32, experts [T, top_k] int64)``, experts by descending
        probability (ties to the lower id); weights renormalised to sum 1 when ``renormalize``,
        then rounded to bfloat16 values (still float32) when ``round_bfloat16``.
    Raises:
        ValueError: ``logits`` not a 2-D CPU tensor, or ``top_k`` outside ``[1, E]``.
    """
    if logits.dim() != 2 or logits.device.type != "cpu":
        raise ValueError(f"moe.route: need 2-D CPU logits, got {tuple(logits.shape)} on {logits.device}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"moe.route: top_k={top_k} must be in [1, {E}]")
    lg = logits.float().contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32)
    experts = torch.empty(T, top_k, dtype=torch.int64)
    _LIB.call(
        "moe_route_f32",
        lg,
        T,
        E,
        top_k,
        int(renormalize),
        int(round_bfloat16),
        weights,
        experts,
        torch.get_num_threads(),
    )
    return weights, experts


def experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``fused_moe.grouped_experts`` in one call: each token's weighted sum of its experts'
    SwiGLU MLPs.

    Args:
        x: ``[T, H]`` float32 or bfloat16 CPU rows.
        weights: ``[T, k]`` routing weights (any float dtype; used as float32).
        experts: ``[T, k]`` expert ids in ``[0, E)`` (any integer dtype).
        w13: ``[E, 2I, H]`` gate rows then up rows; w2: ``[E, H, I]``; both in ``x``'s dtype, read
            in place when ``k_major`` (else copied to that layout for the call).
    Returns:
        ``[T, H]`` in ``x.dtype``.
    Raises:
        ValueError: shapes or dtypes that do not match, or an expert id out of range.
        MemoryError: the kernel's scratch could not be allocated.
    """
    if not supported(x, w13, w2):
        raise ValueError(
            f"moe.experts: need CPU float32/bfloat16 x [T, H] and stacks of its dtype, got x "
            f"{tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}"
        )
    T, H = x.shape
    E, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != H or two_i % 2 or tuple(w2.shape) != (E, H, inter):
        raise ValueError(
            f"moe.experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not "
            "match ([T, H], [E, 2I, H], [E, H, I])"
        )
    if weights.shape != experts.shape or weights.dim() != 2 or weights.shape[0] != T:
        raise ValueError(
            f"moe.experts: weights {tuple(weights.shape)} and experts {tuple(experts.shape)} must both be [T={T}, k]"
        )
    k = experts.shape[1]
    # the kernel reads the k-major storage [E, H, 2I] / [E, I, H]: free for stacks in that layout
    # (k_major), a copy per call otherwise. The copies must stay referenced until the call returns.
    x_c = x.contiguous()
    w13t, w2t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    ids = experts.to(torch.int64).contiguous()
    wts = weights.to(torch.float32).contiguous()
    out = torch.empty(T, H, dtype=x.dtype)
    if T == 0:
        return out
    rc = _LIB.call(
        f"moe_experts_{DTYPE_SUFFIX[x.dtype]}",
        x_c,
        ids,
        wts,
        w13t,
        w2t,
        out,
        T,
        k,
        E,
        H,
        inter,
        torch.get_num_threads(),
    )
    if rc == -1:
        raise ValueError(f"moe.experts: an expert id is outside [0, {E})")
    if rc != 0:
        raise MemoryError(f"moe.experts: no memory for the scratch of {T * k} (token, expert) pairs")
    return out
