"""Fused CPU kernels for the elementwise parts of a step (C/OpenMP; algorithms, numerics and
measurements in ``kvserve/csrc/ops.c``): each does in one pass what takes torch several ops.

- ``rms_norm``: optional residual add, then RMSNorm with ``LlamaRMSNorm``'s numerics.
- ``offset_rms_norm`` / ``offset_rms_norm_heads_``: Gemma's RMSNorm (``1 + weight``, float32),
  then an optional residual add; per head in place on q/k columns.
- ``silu_and_mul``: ``silu(gate) * up`` over a fused ``[T, 2 * I]`` gate/up projection.
- ``gelu_tanh_and_mul``: ``gelu_tanh(gate) * up`` (GeGLU) over the same.
- ``rope_write_kv``: rotary embedding of q and k from the fused qkv projection, the rotated k
  and the v written straight into their KV-cache slots (a cache of the model dtype, or an int8
  cache: rows quantized as ``kv_quant.quantize`` does, bit for bit).
- ``greedy_sample``: per row the first index of the maximum and its log-probability.
- ``prompt_logprob_stats``: per row the log-sum-exp, a target's rank and the top-k logits.

All take contiguous CPU tensors, float32 or bfloat16 (``greedy_sample``: float32 logits).
``supported(t)`` says whether a tensor can take the native path; callers fall back to torch.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

_p, _i64, _f, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGS = {}
for _sfx in DTYPE_SUFFIX.values():
    _SIGS[f"rms_norm_{_sfx}"] = [_p, _p, _p, _p, _i64, _i64, _f, _i]
    _SIGS[f"offset_rms_norm_{_sfx}"] = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _f, _i]
    _SIGS[f"silu_and_mul_{_sfx}"] = [_p, _p, _i64, _i64, _i]
    _SIGS[f"gelu_tanh_and_mul_{_sfx}"] = [_p, _p, _i64, _i64, _i]
    _SIGS[f"rope_write_kv_{_sfx}"] = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i]
    _SIGS[f"rope_write_kv_q8_{_sfx}"] = _SIGS[f"rope_write_kv_{_sfx}"]
_SIGS["greedy_sample_f32"] = [_p, _i64, _i64, _p, _p, _i]
_SIGS["prompt_logprob_stats_f32"] = [_p, _i64, _i64, _p, _i64, _p, _p, _p, _p, _i]
_LIB = NativeLibrary("kv_ops", "ops.c", _SIGS)


def available() -> bool:
    """True when the kernels are built and loaded (and ``KVSERVE_NATIVE`` is not ``0``)."""
    return _LIB.available()


def failure_reason() -> str | None:
    return _LIB.failure_reason()


def supported(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a contiguous CPU float32/bfloat16 tensor of one dtype and the
    library is available: the native path applies."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_SUFFIX or not _LIB.available():
        return False
    for t in tensors:  # a plain loop: this runs ~8 times per layer and decode step
        if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
            return False
    return True


#: The quantized cache dtype ``rope_write_kv`` writes (rows of ``head_dim`` codes + a float16
#: scale, ``model_executor.layers.kv_quant``); the float8 ones are written by torch.
QUANT_CACHE_DTYPE = torch.int8
#: Largest head_dim of an int8 cache row ``rope_write_kv`` quantizes (its row buffer).
QUANT_MAX_HEAD_DIM = 256


def writes_cache(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor | None
) -> bool:
    """True when ``rope_write_kv`` takes these inputs: ``supported`` for ``qkv``, ``cos``,
    ``sin`` and a cache of their dtype (or none), or an int8 cache (contiguous, CPU) with
    ``head_dim + 2``-byte rows of ``head_dim <= QUANT_MAX_HEAD_DIM``."""
    if kv_cache is None or kv_cache.dtype != QUANT_CACHE_DTYPE:
        return supported(qkv, cos, sin, *(() if kv_cache is None else (kv_cache,)))
    return (
        supported(qkv, cos, sin)
        and kv_cache.is_cpu
        and kv_cache.is_contiguous()
        and kv_cache.shape[-1] - 2 <= QUANT_MAX_HEAD_DIM
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, H]``; with ``residual`` (``[T, H]``, updated in place to
    ``x + residual``) the norm is of that sum. Returns a new ``[T, H]`` tensor.

    Raises:
        ValueError: shapes do not match or ``supported`` is False for the inputs.
    """
    ts = (x, weight) if residual is None else (x, weight, residual)
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} weight {tuple(weight.shape)} "
            f"residual {None if residual is None else tuple(residual.shape)}"
        )
    if not supported(*ts):
        raise ValueError("rms_norm: inputs must be contiguous CPU float32/bfloat16 of one dtype")
    out = torch.empty_like(x)
    _LIB.call(
        f"rms_norm_{DTYPE_SUFFIX[x.dtype]}",
        x,
        residual,
        weight,
        out,
        x.shape[0],
        x.shape[1],
        float(eps),
        torch.get_num_threads(),
    )
    return out


def offset_rms_norm(
    x: torch.Tensor, weight1: torch.Tensor, eps: float, add: torch.Tensor | None = None
) -> torch.Tensor:
    """Gemma's RMSNorm of ``x`` ``[T, H]``: ``x / sqrt(mean(x**2, -1) + eps) * weight1`` in float32,
    rounded to ``x``'s dtype; with ``add`` (``[T, H]``, ``x``'s dtype) returns ``add + that``
    (rounded again), the residual add after Gemma's post-norms. A new ``[T, H]`` tensor.

    Args:
        weight1: float32 ``[H]``, the scale ``1 + weight`` (Gemma stores the offset).
    Raises:
        ValueError: shapes do not match, or the inputs are not contiguous CPU float32/bfloat16
            (``x`` and ``add`` of one dtype) with the library available.
    """
    if x.dim() != 2 or weight1.shape != (x.shape[1],) or (add is not None and add.shape != x.shape):
        raise ValueError(
            f"offset_rms_norm: x {tuple(x.shape)} weight1 {tuple(weight1.shape)} "
            f"add {None if add is None else tuple(add.shape)}"
        )
    if (
        not supported(*((x,) if add is None else (x, add)))
        or not supported(weight1)
        or weight1.dtype != torch.float32
    ):
        raise ValueError(
            "offset_rms_norm: x/add contiguous CPU float32/bfloat16 of one dtype, weight1 float32"
        )
    out = torch.empty_like(x)
    T, H = x.shape
    _LIB.call(
        f"offset_rms_norm_{DTYPE_SUFFIX[x.dtype]}",
        x,
        H,
        weight1,
        add,
        out,
        H,
        T,
        1,
        H,
        float(eps),
        torch.get_num_threads(),
    )
    return out


def offset_rms_norm_heads_(
    qkv: torch.Tensor, start: int, heads: int, weight1: torch.Tensor, eps: float
) -> None:
    """Gemma 3's q or k norm in place: ``offset_rms_norm`` of each of the ``heads`` head vectors
    (``len(weight1)`` elements each) in columns ``[start, start + heads * len(weight1))`` of every
    row of ``qkv`` ``[T, C]`` (a fused q/k/v projection), the other columns untouched.

    Raises:
        ValueError: the columns do not fit, ``qkv`` is not a contiguous 2-D CPU float32/bfloat16
            tensor, or ``weight1`` is not float32 with the library available.
    """
    D = weight1.shape[0] if weight1.dim() == 1 else -1
    if qkv.dim() != 2 or D <= 0 or start < 0 or heads < 0 or start + heads * D > qkv.shape[1]:
        raise ValueError(
            f"offset_rms_norm_heads_: qkv {tuple(qkv.shape)} columns [{start}, {start} + {heads} x "
            f"{tuple(weight1.shape)})"
        )
    if not supported(qkv) or not supported(weight1) or weight1.dtype != torch.float32:
        raise ValueError("offset_rms_norm_heads_: qkv contiguous CPU float32/bfloat16, weight1 float32")
    ptr = qkv.data_ptr() + start * qkv.element_size()
    T, C = qkv.shape
    _LIB.call(
        f"offset_rms_norm_{DTYPE_SUFFIX[qkv.dtype]}",
        ptr,
        C,
        weight1,
        None,
        ptr,
        C,
        T,
        heads,
        D,
        float(eps),
        torch.get_num_threads(),
    )


def _act_and_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """The kernel ``<name>_<dtype>`` over ``gate_up`` ``[T, 2 * I]``; returns ``[T, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not supported(gate_up):
        raise ValueError(
            f"{name}: need a contiguous CPU float32/bfloat16 [T, 2 * I], got {tuple(gate_up.shape)} {gate_up.dtype}"
        )
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    _LIB.call(f"{name}_{DTYPE_SUFFIX[gate_up.dtype]}", gate_up, out, T, I2 // 2, torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` ``[T, 2 * I]``; returns ``[T, I]``.

    Raises:
        ValueError: odd last dimension or unsupported input.
    """
    return _act_and_mul("silu_and_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate_up[:, :I], approximate="tanh") * gate_up[:, I:]`` for ``gate_up`` ``[T, 2 * I]``
    (Gemma's GeGLU); returns ``[T, I]`` of its dtype, the GELU rounded to it before the product
    as torch's two ops round.

    Raises:
        ValueError: odd last dimension or unsupported input.
    """
    return _act_and_mul("gelu_tanh_and_mul", gate_up)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> torch.Tensor:
    """Rotary embedding of q and k from a fused projection, and the KV-cache write, in one pass.

    Args:
        qkv: ``[T, (H + 2 * KH) * D]`` contiguous (q heads, k heads, v heads).
        cos, sin: ``[T, D // 2]`` contiguous (or ``[T, 1, D // 2]``), the tokens' rotary tables.
        kv_cache: ``[2, KH, num_blocks, block_size, D]`` of ``qkv``'s dtype, or int8
            ``[2, KH, num_blocks, block_size, D + 2]`` (``writes_cache``: rows of codes and a
            float16 scale, quantized as ``kv_quant.quantize`` does), or ``None`` (no cache:
            nothing written).
        slot_mapping: int64 ``[T]`` cache slot of each token (``block * block_size + offset``).
    Returns:
        ``[T, H + KH, D]``: rotated q heads then rotated k heads. The cache receives the rotated
        k and the v heads at each token's slot.
    Raises:
        ValueError: on a shape or dtype mismatch, or unsupported inputs.
    """
    T = qkv.shape[0]
    H, KH, D = num_heads, num_kv_heads, head_dim
    quant = kv_cache is not None and kv_cache.dtype == QUANT_CACHE_DTYPE
    if (
        qkv.dim() != 2
        or qkv.shape[1] != (H + 2 * KH) * D
        or cos.numel() != T * (D // 2)
        or sin.numel() != T * (D // 2)
        or D % 2
        or not writes_cache(qkv, cos, sin, kv_cache)
        or (
            kv_cache is not None
            and (
                kv_cache.shape[1] != KH
                or kv_cache.shape[-1] != D + (2 if quant else 0)
                or slot_mapping is None
                or slot_mapping.shape != (T,)
                or slot_mapping.dtype != torch.int64
            )
        )
    ):
        raise ValueError(
            f"rope_write_kv: qkv {tuple(qkv.shape)} {qkv.dtype}, cos {tuple(cos.shape)}, "
            f"H={H} KH={KH} D={D}, cache "
            f"{None if kv_cache is None else tuple(kv_cache.shape)} do not fit"
        )
    out = torch.empty(T, H + KH, D, dtype=qkv.dtype)
    nbbs = 0 if kv_cache is None else kv_cache.shape[2] * kv_cache.shape[3]
    _LIB.call(
        f"rope_write_kv{'_q8' if quant else ''}_{DTYPE_SUFFIX[qkv.dtype]}",
        qkv,
        cos,
        sin,
        out,
        kv_cache,
        None if kv_cache is None else slot_mapping,
        T,
        H,
        KH,
        D,
        nbbs,
        torch.get_num_threads(),
    )
    return out


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their log-probabilities for float32 ``logits`` ``[N, V]``.

    Returns:
        ``(tokens int64 [N], logprobs float32 [N])``; ties go to the lowest index, as
        ``torch.argmax``.
    Raises:
        ValueError: not a contiguous float32 CPU ``[N, V]`` tensor, or the library is unavailable.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or not supported(logits):
        raise ValueError(
            f"greedy_sample: need contiguous CPU float32 [N, V], got {tuple(logits.shape)} "
            f"{logits.dtype} on {logits.device}"
        )
    N, V = logits.shape
    tok = torch.empty(N, dtype=torch.int64)
    lp = torch.empty(N, dtype=torch.float32)
    _LIB.call("greedy_sample_f32", logits, N, V, tok, lp, torch.get_num_threads())
    return tok, lp


def prompt_logprob_stats(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What prompt logprobs report, per row of float32 ``logits`` ``[N, V]``, in two passes.

    Args:
        targets: int64 ``[N]`` in ``[0, V)``, the token whose rank each row reports.
        k: how many of the largest logits to return (0..V).
    Returns:
        ``(lse float32 [N], rank int64 [N], top_vals float32 [N, k], top_ids int64 [N, k])``:
        ``log(sum(exp(row)))``, ``1 + #(row > row[target])``, and the ``k`` largest logits in
        descending order (ties: lower id first). A NaN logit counts as ``-inf``.
    Raises:
        ValueError: not a contiguous float32 CPU ``[N, V]`` tensor, targets not ``[N]`` ids in
            range, ``k`` outside ``[0, V]``, or the library is unavailable.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or not supported(logits):
        raise ValueError(
            f"prompt_logprob_stats: need contiguous CPU float32 [N, V], got {tuple(logits.shape)} "
            f"{logits.dtype} on {logits.device}"
        )
    N, V = logits.shape
    targets = targets.to(device="cpu", dtype=torch.int64).contiguous()
    if targets.shape != (N,) or (N and (int(targets.min()) < 0 or int(targets.max()) >= V)):
        raise ValueError(
            f"prompt_logprob_stats: targets must be [{N}] ids in [0, {V}), got {tuple(targets.shape)}"
        )
    if not 0 <= k <= V:
        raise ValueError(f"prompt_logprob_stats: k must be in [0, {V}], got {k}")
    kk = max(k, 1)  # the kernel keeps at least one
    lse = torch.empty(N, dtype=torch.float32)
    rank = torch.empty(N, dtype=torch.int64)
    vals = torch.empty(N, kk, dtype=torch.float32)
    ids = torch.empty(N, kk, dtype=torch.int64)
    _LIB.call(
        "prompt_logprob_stats_f32",
        logits,
        N,
        V,
        targets,
        kk,
        lse,
        rank,
        vals,
        ids,
        torch.get_num_threads(),
    )
    return lse, rank, vals[:, :k], ids[:, :k]
