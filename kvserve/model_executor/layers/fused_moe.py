"""Mixture-of-experts MLP: top-k routing and SwiGLU experts run grouped by expert.

Routing (Shazeer et al., 2017, "Outrageously Large Neural Networks"; the top-k softmax gate of
Mixtral, Jiang et al., 2024): ``p = softmax(x @ gate.T)`` in float32, the ``k`` largest
probabilities per token are its experts' weights, renormalised to sum to 1 when the family says
so (Mixtral always; Qwen-MoE and OLMoE by ``norm_topk_prob``).

Experts run grouped: the ``T * k`` (token, expert) pairs are sorted by expert once, the token
rows gathered into one contiguous block per expert, each block goes through its expert's
``gate_up`` then ``down`` GEMM, and the weighted results are added back to their tokens with one
``index_add_``. Expert weights are stacked: ``w13`` ``[E, 2 * I, H]`` (gate rows then up rows),
``w2`` ``[E, H, I]``. Three ways to run the per-expert GEMMs, chosen per call
(``grouped_experts``):

- ``"grouped_mm"``: torch's grouped GEMM over the sorted rows and the per-expert row offsets, one
  call per projection (no Python per expert);
- ``"bmm"``: the rows padded to the busiest expert's count, one batched GEMM over all experts
  (no Python per expert; padding rows cost compute, so it is used only when they are few);
- ``"loop"``: one pair of GEMMs per active expert on its contiguous rows;
- ``"native"`` (what ``"auto"`` runs on CPU float32 / bfloat16 where the kernels are built):
  routing and every expert in one call each (``kvserve/ops/moe.py``, ``kvserve/csrc/moe.c``: the
  sort, the gather, the GEMMs, SiLU and the weighted scatter inside the kernel, no Python per
  expert). ``FusedMoE`` then keeps its stacks k-major (``[E, H, 2I]`` / ``[E, I, H]`` storage
  behind the same-shaped ``w13`` / ``w2`` views), which the kernel reads in place.

``per_expert_loop`` is the straightforward form (a boolean mask per expert, its tokens indexed,
its MLP run, results added): the reference the tests and ``kvserve bench moe`` compare with.

Quantized experts (``FusedMoE.quantize_stack``: int8 / int4 at load) are one block-quantized weight per
expert and projection; ``looped_experts`` runs them as the ``"loop"`` form does, one pair of
quantized GEMMs (``layers.linear.linear``) per active expert on its contiguous rows.

Under tensor parallelism each rank holds every expert's slice of the intermediate columns
(``w13``'s gate and up rows ``[r*I/T, (r+1)*I/T)``, ``w2``'s matching input columns): the
layer returns this rank's partial sum, which the caller all-reduces once per MoE block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvserve.model_executor.layers.linear import QUANT_METHODS, LinearWeight, linear, quantize_weight
from kvserve.ops import moe as native_moe

#: Ways ``grouped_experts`` can run the expert GEMMs (``"auto"`` picks one per call), and
#: ``"per_expert"``: ``per_expert_loop``, the reference form, selectable for measuring.
MODES = ("auto", "native", "grouped_mm", "bmm", "loop", "per_expert")


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing.

    Args:
        logits: router logits ``[T, E]`` (any float dtype; the softmax runs in float32).
        top_k: experts per token (``1 <= top_k <= E``).
        renormalize: divide the ``top_k`` probabilities by their sum.
        weight_dtype: dtype of the returned weights (None: float32).
    Returns:
        ``(weights [T, top_k], experts [T, top_k] int64)``, experts by descending probability.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weight_dtype is not None:
        weights = weights.to(weight_dtype)
    return weights, experts


def _swiglu(gu: torch.Tensor, inter: int) -> torch.Tensor:
    h = F.silu(gu[..., :inter])
    return h.mul_(gu[..., inter:])


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def pick_mode(num_pairs: int, num_experts: int, max_count: int, dtype: torch.dtype, device) -> str:
    """The torch expert-GEMM form ``"auto"`` runs for ``num_pairs`` (token, expert) pairs over
    ``num_experts`` experts whose busiest gets ``max_count`` of them where the native call does
    not apply (see the module doc)."""
    if _grouped_mm_available() and (torch.device(device).type == "cuda" or dtype == torch.float32):
        return "grouped_mm"
    # padding: the batched GEMM computes num_experts * max_count rows for num_pairs real ones
    if num_experts * max_count <= 2 * num_pairs:
        return "bmm"
    return "loop"


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    mode: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each token's experts' SwiGLU MLPs, run grouped by expert.

    Args:
        x: ``[T, H]`` token rows.
        weights: ``[T, k]`` routing weights (float32 or ``x``'s dtype; products are taken in
            the wider of the two, then cast to ``x.dtype``).
        experts: ``[T, k]`` int64 expert ids in ``[0, E)``.
        w13: ``[E, 2 * I, H]`` stacked gate (rows ``[0, I)``) and up (rows ``[I, 2I)``) weights.
        w2: ``[E, H, I]`` stacked down weights.
        mode: one of ``MODES``.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    Raises:
        ValueError: an unknown ``mode``, ``"grouped_mm"`` where torch has no grouped GEMM, or
            ``"native"`` where the kernel is not built or the tensors are not CPU float32 /
            bfloat16 of one dtype.
    """
    if mode not in MODES:
        raise ValueError(f"grouped_experts: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "per_expert":
        return per_expert_loop(x, weights, experts, w13, w2)
    if mode in ("auto", "native") and native_moe.supported(x, w13, w2):
        return native_moe.experts(x, weights, experts, w13, w2)
    if mode == "native":
        raise ValueError(
            "grouped_experts: mode='native' needs the native MoE kernel and CPU float32/bfloat16 "
            f"tensors of one dtype ({native_moe.failure_reason() or 'tensors not supported'})"
        )
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    k = experts.shape[1]
    out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert, token order kept within
    token = order // k  # the token row of each sorted pair
    pair_w = weights.reshape(-1)[order]
    counts_t = torch.bincount(flat, minlength=E)
    xs = x.index_select(0, token)  # every expert's rows, contiguous, gathered once
    n = xs.shape[0]
    if mode == "auto":
        counts_list = counts_t.tolist()
        mode = pick_mode(n, E, max(counts_list), x.dtype, x.device)
    if mode == "grouped_mm":
        if not _grouped_mm_available():
            raise ValueError("grouped_experts: mode='grouped_mm' needs torch._grouped_mm (torch >= 2.8)")
        offs = torch.cumsum(counts_t, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        ys = torch._grouped_mm(_swiglu(gu, inter), w2.transpose(1, 2), offs=offs)
    elif mode == "bmm":
        counts_list = counts_t.tolist()
        m = max(counts_list)
        starts = torch.cumsum(counts_t, 0) - counts_t
        sorted_e = flat[order]
        pos = torch.arange(n, device=x.device) - starts[sorted_e]
        slot = sorted_e * m + pos  # row of each pair in the padded [E * m] block
        buf = torch.zeros(E * m, H, dtype=x.dtype, device=x.device)
        buf.index_copy_(0, slot, xs)
        gu = torch.bmm(buf.view(E, m, H), w13.transpose(1, 2))
        y = torch.bmm(_swiglu(gu, inter), w2.transpose(1, 2))
        ys = y.view(E * m, H).index_select(0, slot)
    else:
        counts_list = counts_t.tolist()
        ys = torch.empty(n, H, dtype=x.dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts_list):
            if c == 0:
                continue
            seg = slice(start, start + c)
            h = _swiglu(F.linear(xs[seg], w13[e]), inter)
            torch.mm(h, w2[e].t(), out=ys[seg])
            start += c
    ys = (ys * pair_w.unsqueeze(1)).to(x.dtype)
    return out.index_add_(0, token, ys)


def looped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13: Sequence[LinearWeight],
    w2: Sequence[LinearWeight],
) -> torch.Tensor:
    """``grouped_experts`` in its ``"loop"`` form for per-expert weights of any ``linear`` form
    (block-quantized ``quant.QuantWeight`` included): the pairs sorted by expert, each active
    expert's contiguous rows through one gate/up and one down GEMM.

    Args:
        x, weights, experts: as ``grouped_experts``.
        w13: E weights ``[2I, H]`` (gate rows then up rows); w2: E weights ``[H, I]``.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    T, H = x.shape
    k = experts.shape[1]
    out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    pair_w = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=len(w13)).tolist()
    xs = x.index_select(0, token)
    ys = torch.empty(xs.shape[0], H, dtype=x.dtype, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        seg = slice(start, start + c)
        gu = linear(xs[seg], w13[e])
        ys[seg] = linear(_swiglu(gu, gu.shape[1] // 2), w2[e])
        start += c
    ys = (ys * pair_w.unsqueeze(1)).to(x.dtype)
    return out.index_add_(0, token, ys)


def per_expert_loop(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The straightforward form of ``grouped_experts`` (same arguments and result): for each
    expert, a mask of the tokens routed to it, those rows indexed, its MLP run, the weighted
    result added to the tokens."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    for e in range(w13.shape[0]):
        hit = experts == e  # [T, k]
        if not bool(hit.any()):
            continue
        rows, slots = torch.nonzero(hit, as_tuple=True)
        h = _swiglu(F.linear(x[rows], w13[e]), inter)
        y = F.linear(h, w2[e]) * weights[rows, slots].unsqueeze(1)
        out.index_add_(0, rows, y.to(x.dtype))
    return out


class FusedMoE(torch.nn.Module):
    """Router + stacked SwiGLU experts of one MoE MLP.

    Args:
        num_experts: E; top_k: experts per token; hidden_size: H; intermediate_size: I (per
            expert).
        renormalize: renormalise the top-k weights (see ``route``).
        float32_weights: multiply expert outputs by the float32 routing weights (Mixtral)
            rather than by weights cast to the activation dtype first (Qwen-MoE, OLMoE).
        mode: the expert-GEMM form (``MODES``).

    Parameters: ``gate`` ``[E, H]``, ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]`` (``I``: this
    rank's share of the intermediate size under tensor parallelism). After ``quantize_stack`` the
    experts are ``w13_q`` / ``w2_q`` (one quantized weight per expert) and ``w13`` / ``w2`` are
    gone; the router stays float.
    Raises:
        ValueError: ``top_k`` outside ``[1, num_experts]``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        float32_weights: bool = False,
        dtype=torch.float32,
        device=None,
        mode: str = "auto",
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        if mode not in MODES:
            raise ValueError(f"FusedMoE: mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.inter = intermediate_size
        self.renormalize = renormalize
        self.float32_weights = float32_weights
        self.mode = mode

        def param(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate = param(num_experts, hidden_size)
        self.w13 = param(num_experts, 2 * intermediate_size, hidden_size)
        self.w2 = param(num_experts, hidden_size, intermediate_size)
        self.w13_q: list[LinearWeight] | None = None
        self.w2_q: list[LinearWeight] | None = None

    def quantize_stack(self, name: str, method: str) -> None:
        """Replace the stacked expert weights ``name`` (``"w13"`` or ``"w2"``) by one
        block-quantized weight per expert (``layers.linear.quantize_weight``: ``int8`` Q8_0,
        ``int4`` Q4_1) in ``w13_q`` / ``w2_q``; the float stack is dropped. The router stays
        float. ``forward`` runs the quantized experts once both stacks are quantized.

        Raises:
            ValueError: ``name`` is neither ``w13`` nor ``w2``, or an unknown ``method``.
        """
        if name not in ("w13", "w2") or method not in QUANT_METHODS:
            raise ValueError(f"FusedMoE.quantize_stack: got name={name!r}, method={method!r}")
        stack = getattr(self, name).data
        quantized = [quantize_weight(stack[e].contiguous(), method) for e in range(self.num_experts)]
        delattr(self, name)
        setattr(self, name + "_q", quantized)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` for ``x`` ``[T, H]`` (native routing on CPU
        float32/bfloat16 where the kernels are available and the mode allows it: float32
        weights, rounded to bfloat16 values where the family multiplies in the activation
        dtype)."""
        logits = F.linear(x, self.gate)
        if (
            self.mode in ("auto", "native")
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and native_moe.available()
        ):
            round_bf16 = not self.float32_weights and x.dtype == torch.bfloat16
            return native_moe.route(logits, self.top_k, self.renormalize, round_bfloat16=round_bf16)
        return route(
            logits,
            self.top_k,
            self.renormalize,
            None if self.float32_weights else x.dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]`` in ``x.dtype``."""
        weights, experts = self.route(x)
        if self.w13_q is not None and self.w2_q is not None:
            return looped_experts(x, weights, experts, self.w13_q, self.w2_q)
        if self.mode in ("auto", "native") and native_moe.supported(x, self.w13, self.w2):
            self._to_k_major()
        return grouped_experts(x, weights, experts, self.w13, self.w2, self.mode)

    def _to_k_major(self) -> None:
        """Store the stacks k-major (``ops.moe.k_major``), once: the native call then reads them
        in place; ``w13`` / ``w2`` keep their shapes (strided views), so loaders and the torch
        forms work on them unchanged. One transposing copy at a time (the old storage is freed)."""
        for name in ("w13", "w2"):
            p = getattr(self, name)
            if not p.data.transpose(1, 2).is_contiguous():
                p.data = native_moe.k_major(p.data)
