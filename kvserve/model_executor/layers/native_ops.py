"""Fused CPU kernels for the elementwise parts of a step (C/OpenMP, built by ``native_lib``).

At 64 decode rows each torch elementwise op costs ~10-60 us of dispatch and a pass over memory;
a prefill of 6,000 tokens in bfloat16 spent ~40 % of its time in the RMSNorm, SiLU and dtype
conversions between its GEMMs (torch.profiler). These kernels do each of them in one pass:

- ``rms_norm``: optional residual add, then RMSNorm (Zhang & Sennrich, 2019) -- the numerics of
  HF transformers' ``LlamaRMSNorm``: statistics in float32, the normalised value rounded to the
  model dtype before the weight multiply.
- ``silu_and_mul``: ``silu(gate) * up`` over a fused ``[T, 2 * I]`` gate/up projection
  (SwiGLU, Shazeer 2020), each product rounded like torch's ``silu`` then ``mul``.
- ``rope_write_kv``: rotary embedding of q and k from the fused qkv projection, with the
  rotated k and the v written straight into their KV-cache slots (replaces four elementwise ops,
  a stack, a transpose and an ``index_copy_`` per layer).
- ``greedy_sample``: per row, the first index of the maximum (``torch.argmax``) and its
  log-probability ``-log(sum(exp(x - max)))``, in two passes over a row that stays in cache.

All take contiguous CPU tensors, float32 or bfloat16 (``greedy_sample``: float32 logits).
``supported(t)`` says whether a tensor can take the native path; callers fall back to torch.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_executor.layers.native_lib import DTYPE_SUFFIX, PRELUDE, NativeLibrary, instantiate

_KERNELS = r"""
void CAT(rms_norm_, SFX)(const ELEM* x, ELEM* residual, const ELEM* w, ELEM* out,
                         int64_t T, int64_t H, float eps, int nthreads)
{
    const int64_t H16 = H & ~(int64_t)15;
    #pragma omp parallel for schedule(static) num_threads(T >= 128 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* xr = x + t * H;
        ELEM* rr = residual ? residual + t * H : NULL;
        ELEM* orow = out + t * H;
        /* s = x (+ residual, rounded to the storage dtype and written back as the new residual) */
        const ELEM* src = xr;
        if (rr) {
            int64_t i = 0;
            for (; i < H16; i += 16)
                CAT(st16_, SFX)(rr + i, CAT(ld16_, SFX)(xr + i) + CAT(ld16_, SFX)(rr + i));
            for (; i < H; ++i) CAT(st1_, SFX)(rr + i, CAT(ld1_, SFX)(xr + i) + CAT(ld1_, SFX)(rr + i));
            src = rr;
        }
        v16 ss = (v16){};
        float tail = 0.0f;
        int64_t i = 0;
        for (; i < H16; i += 16) { v16 v = CAT(ld16_, SFX)(src + i); ss += v * v; }
        for (; i < H; ++i) { float v = CAT(ld1_, SFX)(src + i); tail += v * v; }
        const float inv = 1.0f / sqrtf((hsum16(ss) + tail) / (float)H + eps);
        for (i = 0; i < H16; i += 16) {
            v16 n = CAT(round16_, SFX)(CAT(ld16_, SFX)(src + i) * inv);
            CAT(st16_, SFX)(orow + i, n * CAT(ld16_, SFX)(w + i));
        }
        for (; i < H; ++i) {
            v16 n = CAT(round16_, SFX)((v16){} + CAT(ld1_, SFX)(src + i) * inv);
            CAT(st1_, SFX)(orow + i, n[0] * CAT(ld1_, SFX)(w + i));
        }
    }
}

void CAT(silu_and_mul_, SFX)(const ELEM* gu, ELEM* out, int64_t T, int64_t I, int nthreads)
{
    const int64_t I16 = I & ~(int64_t)15;
    #pragma omp parallel for schedule(static) num_threads(T >= 32 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* g = gu + t * 2 * I;
        const ELEM* u = g + I;
        ELEM* o = out + t * I;
        int64_t i = 0;
        for (; i < I16; i += 16) {
            v16 gv = CAT(ld16_, SFX)(g + i);
            v16 e = exp16(vmin((v16){} - gv, (v16){} + 88.0f));
            v16 s = gv / (1.0f + e);
            /* below -88 the clamped exp no longer cancels gv (silu(-3e38) came out -1.8): there
               silu is gv * e^gv, i.e. +-0 (NaN for -inf, as torch) */
            const v16i far = gv < -88.0f;
            s = (v16)(((v16i)s & ~far) | ((v16i)(gv * 0.0f) & far));
            s = CAT(round16_, SFX)(s);
            CAT(st16_, SFX)(o + i, s * CAT(ld16_, SFX)(u + i));
        }
        for (; i < I; ++i) {
            float gv = CAT(ld1_, SFX)(g + i);
            v16 s = CAT(round16_, SFX)((v16){} + gv / (1.0f + expf(-gv)));
            CAT(st1_, SFX)(o + i, s[0] * CAT(ld1_, SFX)(u + i));
        }
    }
}
"""

_ROPE = r"""
/* Rotary embedding (RoFormer, Su et al. 2021; rotate-half form) of the q and k heads of a fused
   qkv row, written to qk_out [T, H + KH, D]; the rotated k and the v heads also go straight
   into their cache slots (cache [2, KH, NBBS, D], slots [T]; skipped when cache is NULL).
   Per element, as the torch path: o1 = round(x1 cos) - x2 sin, o2 = round(x2 cos) + x1 sin. */
void CAT(rope_write_kv_, SFX)(const ELEM* qkv, const ELEM* cosb, const ELEM* sinb, ELEM* qk_out,
                              ELEM* cache, const int64_t* slots, int64_t T, int64_t H, int64_t KH,
                              int64_t D, int64_t NBBS, int nthreads)
{
    const int64_t half = D / 2, half16 = half & ~(int64_t)15, row = (H + 2 * KH) * D;
    #pragma omp parallel for schedule(static) num_threads(T >= 64 ? nthreads : 1)
    for (int64_t t = 0; t < T; ++t) {
        const ELEM* c = cosb + t * half;
        const ELEM* sn = sinb + t * half;
        for (int64_t hh = 0; hh < H + KH; ++hh) {
            const ELEM* x = qkv + t * row + hh * D;
            ELEM* o = qk_out + (t * (H + KH) + hh) * D;
            int64_t i = 0;
            for (; i < half16; i += 16) {
                v16 x1 = CAT(ld16_, SFX)(x + i), x2 = CAT(ld16_, SFX)(x + half + i);
                v16 cv = CAT(ld16_, SFX)(c + i), sv = CAT(ld16_, SFX)(sn + i);
                CAT(st16_, SFX)(o + i, CAT(round16_, SFX)(x1 * cv) - x2 * sv);
                CAT(st16_, SFX)(o + half + i, CAT(round16_, SFX)(x2 * cv) + x1 * sv);
            }
            for (; i < half; ++i) {
                float x1 = CAT(ld1_, SFX)(x + i), x2 = CAT(ld1_, SFX)(x + half + i);
                float cv = CAT(ld1_, SFX)(c + i), sv = CAT(ld1_, SFX)(sn + i);
                v16 a = CAT(round16_, SFX)((v16){} + x1 * cv), b = CAT(round16_, SFX)((v16){} + x2 * cv);
                CAT(st1_, SFX)(o + i, a[0] - x2 * sv);
                CAT(st1_, SFX)(o + half + i, b[0] + x1 * sv);
            }
            if (cache && hh >= H)
                memcpy(cache + ((hh - H) * NBBS + slots[t]) * D, o, sizeof(ELEM) * D);
        }
        if (cache)
            for (int64_t h = 0; h < KH; ++h)
                memcpy(cache + ((KH + h) * NBBS + slots[t]) * D, qkv + t * row + (H + KH + h) * D,
                       sizeof(ELEM) * D);
    }
}
"""

_GREEDY = r"""
void greedy_sample_f32(const float* logits, int64_t N, int64_t V, int64_t* tok, float* logprob, int nthreads)
{
    const int64_t V16 = V & ~(int64_t)15;
    #pragma omp parallel for schedule(static) num_threads(N >= 4 ? nthreads : 1)
    for (int64_t r = 0; r < N; ++r) {
        const float* x = logits + r * V;
        float m = -INFINITY;
        int64_t best = 0;
        if (V16) {
            v16 mv = *(const v16*)x;
            v16i iv = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
            v16i cur = iv;
            for (int64_t i = 16; i < V16; i += 16) {
                cur += 16;
                v16 v = *(const v16*)(x + i);
                v16i gt = v > mv;               /* strictly greater: keeps the first index */
                mv = (v16)(((v16i)v & gt) | ((v16i)mv & ~gt));
                iv = (cur & gt) | (iv & ~gt);
            }
            m = mv[0]; best = iv[0];
            for (int k = 1; k < 16; ++k)
                if (mv[k] > m || (mv[k] == m && iv[k] < best)) { m = mv[k]; best = iv[k]; }
        }
        for (int64_t i = V16; i < V; ++i) if (x[i] > m) { m = x[i]; best = i; }
        v16 sv = (v16){};
        for (int64_t i = 0; i < V16; i += 16) sv += exp16(*(const v16*)(x + i) - m);
        float s = hsum16(sv);
        for (int64_t i = V16; i < V; ++i) s += expf(x[i] - m);
        tok[r] = best;
        logprob[r] = -logf(s);
    }
}
"""

_SOURCE = (
    PRELUDE
    + "static inline v16 vmin(v16 a, v16 b) { v16i m = a < b; return (v16)(((v16i)a & m) | ((v16i)b & ~m)); }\n"
    + instantiate(_KERNELS + _ROPE)
    + _GREEDY
)
_p, _i64, _f, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGS = {}
for _sfx in DTYPE_SUFFIX.values():
    _SIGS[f"rms_norm_{_sfx}"] = [_p, _p, _p, _p, _i64, _i64, _f, _i]
    _SIGS[f"silu_and_mul_{_sfx}"] = [_p, _p, _i64, _i64, _i]
    _SIGS[f"rope_write_kv_{_sfx}"] = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i]
_SIGS["greedy_sample_f32"] = [_p, _i64, _i64, _p, _p, _i]
_LIB = NativeLibrary("kv_ops", _SOURCE, _SIGS)


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
    _LIB.fn(f"rms_norm_{DTYPE_SUFFIX[x.dtype]}")(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        float(eps),
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` ``[T, 2 * I]``; returns ``[T, I]``.

    Raises:
        ValueError: odd last dimension or unsupported input.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not supported(gate_up):
        raise ValueError(
            f"silu_and_mul: need a contiguous CPU float32/bfloat16 [T, 2 * I], "
            f"got {tuple(gate_up.shape)} {gate_up.dtype}"
        )
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    _LIB.fn(f"silu_and_mul_{DTYPE_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), out.data_ptr(), T, I2 // 2, torch.get_num_threads()
    )
    return out


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
        kv_cache: ``[2, KH, num_blocks, block_size, D]`` or ``None`` (no cache: nothing written).
        slot_mapping: int64 ``[T]`` cache slot of each token (``block * block_size + offset``).
    Returns:
        ``[T, H + KH, D]``: rotated q heads then rotated k heads. The cache receives the rotated
        k and the v heads at each token's slot.
    Raises:
        ValueError: on a shape or dtype mismatch, or unsupported inputs.
    """
    T = qkv.shape[0]
    H, KH, D = num_heads, num_kv_heads, head_dim
    ts = [qkv, cos, sin] + ([] if kv_cache is None else [kv_cache])
    if (
        qkv.dim() != 2
        or qkv.shape[1] != (H + 2 * KH) * D
        or cos.numel() != T * (D // 2)
        or sin.numel() != T * (D // 2)
        or D % 2
        or not supported(*ts)
        or (
            kv_cache is not None
            and (
                kv_cache.shape[1] != KH
                or kv_cache.shape[-1] != D
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
    _LIB.fn(f"rope_write_kv_{DTYPE_SUFFIX[qkv.dtype]}")(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        None if kv_cache is None else kv_cache.data_ptr(),
        None if kv_cache is None else slot_mapping.data_ptr(),
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
    _LIB.fn("greedy_sample_f32")(
        logits.data_ptr(), N, V, tok.data_ptr(), lp.data_ptr(), torch.get_num_threads()
    )
    return tok, lp
