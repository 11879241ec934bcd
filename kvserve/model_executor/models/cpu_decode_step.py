"""The decoder layers of a pure-decode CPU step as a straight run of native calls.

Why: the kernels of a decode step are few and short (4 GEMMs, attention, 2 RMSNorms, rotary +
cache write, SiLU-and-mul per layer), and the Python around each -- nn.Module calls, argument
checks, output allocation, ctypes conversion -- cost a sizeable share of a real SmolLM2-135M
step (docs/benchmarks.md, CPU kernels). Here the checks run once per
step, the activations live in nine buffers allocated once per step and reused by every layer,
and each layer is nine ctypes calls with integer arguments.

The kernels and their order are those of ``LlamaForCausalLM``'s module path, so the hidden
states are bit-identical to it (``tests/model_executor/test_cpu_decode_step.py``); with
Qwen3's per-head q/k RMSNorm where the layers have one. Gemma's layer (``is_gemma``: four
norms of scale ``1 + weight``, per-head q/k norms, GeGLU, each layer's own window and rotary
table) runs on the one-call form only, bit-identical to ``GemmaForCausalLM``'s module path;
where that form does not apply (tensor parallelism, LoRA steps it does not take, Gemma 2's
attention soft-cap, the exact GELU) Gemma keeps the module path. Under tensor
parallelism every rank runs its shard's layers here too (H/T heads, KV heads and MLP columns per
rank: the kernels take any shape), with the same all-reduce after o and down as the module path.

Applies when (``applies``): CPU, float32 or bfloat16, every linear weight packed for a native
kernel that takes this step's row count (``gemm.PanelWeight`` of the model dtype, up to
its ``max_rows`` if set, ``gemm_amx.AmxWeight`` up to ``gemm_amx.MAX_ROWS`` rows, or
``gemm_bf16dot.DotWeight`` at any), all rows single-token decodes on the
native attention kernel (``meta.native_decode``), the model's parts those kernels cover
(``native_decode_parts``: whole-head rotary), a KV cache of the model dtype or int8
(``_kv_quant``: ``rope_write_kv_q8`` quantizes k and v into it, the q8 decode attention
kernel reads it; float8 caches take the module path), and the native ops available. Otherwise the
module path runs. A step with LoRA adapters (``meta.lora``) adds their deltas right after each
GEMM, as the module path does (``kvserve.model_executor.layers.lora.add_lora``).

Two forms of the same sequence:

- one C call for the whole step (``decode_layers``, ``csrc/decode_layers.c``): every layer and
  the final norm, the kernels resolved once per model and step regime into a dispatch table
  (``_StepPlan``: per layer and weight the kernel of its format -- quantized tile / int8
  activations / panels, AMX tiles, float panels -- its weight bytes and bias), the activation
  buffers allocated with it. It runs every step ``applies`` admits (any row count: batched
  decodes, speculative verify rows expanded to decode rows) without tensor parallelism, where
  the model's ``fuse_native_decode`` is True (the default). Steps with LoRA adapters run it too
  when the native LoRA kernel takes the slots (``_lora_entries``: CPU, float32/bfloat16, up to
  ``lora_ops.NATIVE_MAX_ROWS`` rows): the dispatch table holds every target's slot pointers, the step
  passes its rows and segments, and the C side calls ``lora.c``'s kernel after each GEMM as the
  per-layer loop's ``add_lora`` does (~120 Python op calls and ~270 ctypes calls per step saved).
- the per-layer loop below (nine ctypes calls per layer), under tensor parallelism (its
  all-reduces are Python operations between the GEMMs), for LoRA steps the kernel does not
  take, and where the fused library is unavailable.

Both give bit-identical hidden states (``tests/model_executor/test_cpu_decode_step_fused.py``).
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from kvserve.model_executor.layers import lora as lora_ops
from kvserve.model_executor.layers.attention import AttentionMetadata, NativeDecode
from kvserve.model_executor.layers.linear import WEIGHT_BYTES, native_gemm
from kvserve.model_executor.layers.lora import add_lora
from kvserve.model_executor.layers.rmsnorm import OffsetRMSNorm, RMSNorm
from kvserve.ops import attention as paged_attention
from kvserve.ops import decode_layers, elementwise, gemm, gemm_amx, quant
from kvserve.ops import lora as lora_kernel
from kvserve.ops.library import DTYPE_SUFFIX

#: LoRA steps run on the one-call step; False sends them to the per-layer path, which runs the
#: same kernels in the same order (bit-identical hidden states), so the two can be compared.
FUSE_LORA = True


def uniform_kernel_rows(model) -> int | None:
    """The most rows a step may have for every linear layer (LM head included) to run the same
    kernel as at one row, or None when the kernel does not depend on the row count.

    Why: a row's numbers are bit-identical across steps only while its kernels are; past this
    count a bfloat16 step leaves ``gemm_amx`` (``gemm_amx.MAX_ROWS``) or the bfloat16 panels
    (``PanelWeight.max_rows``) for oneDNN, which rounds some outputs differently (the default
    model's gate/up projection: 1 row in 8 differs). A speculative step that crosses it computes
    the K/V of accepted drafts with other numbers than the plain decode steps would, and greedy
    output drifts from speculation off (3 of 8 requests at 8 concurrent in bfloat16).
    float32 panels and the bfloat16 dot-product GEMM (``gemm_bf16dot.DotWeight``) take every
    row count: None. Quantized weights: None (their kernels switch at
    ``quant.PANEL_ROWS``, not covered here). The transformers fallback (torch's linear layers):
    None.
    """
    if getattr(model, "is_transformers_fallback", False):
        return None  # torch's own linear layers: none of these kernels
    weights = [model.lm_head]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [a.qkv_weight, a.o_weight]
        # a mixture-of-experts block has no dense MLP linears, only its shared expert's
        # (Qwen2-MoE); its routed experts run fused_moe's kernels, not covered here
        dense = m if hasattr(m, "gate_up_weight") else getattr(m, "shared_expert", None)
        if dense is not None:
            weights += [dense.gate_up_weight, dense.down_weight]
    limit: int | None = None
    for w in weights:
        lim: int | None
        if isinstance(w, gemm_amx.AmxWeight):
            lim = gemm_amx.MAX_ROWS
        elif isinstance(w, gemm.PanelWeight):
            lim = w.max_rows
        else:
            lim = None
        if lim is not None:
            limit = lim if limit is None else min(limit, lim)
    return limit


def _check_native(model) -> None:
    if getattr(model, "is_transformers_fallback", False):
        raise ValueError(
            "the fused CPU decode step is not supported by the transformers fallback "
            f"({type(model).__name__}): it runs the native families' fused weights only"
        )


def _kv_quant(cache: torch.Tensor, dtype: torch.dtype) -> bool | None:
    """False for a cache of the model ``dtype``, True for an int8 cache whose rows the native
    rope write quantizes (``elementwise.QUANT_CACHE_DTYPE``), None for any other (module path)."""
    if cache.dtype == dtype:
        return False
    if cache.dtype == elementwise.QUANT_CACHE_DTYPE and cache.shape[-1] - 2 <= elementwise.QUANT_MAX_HEAD_DIM:
        return True
    return None


def applies(model, kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata, num_tokens: int) -> bool:
    """True when ``forward_layers`` can run this step (see the module doc).

    Raises:
        ValueError: ``model`` is the transformers fallback (its layers are transformers'
            modules, not the native decoder's fused weights).
    """
    _check_native(model)
    nd = meta.native_decode
    if (
        kv_caches is None
        or nd is None
        or meta.prefills
        or meta.decode_buckets
        or nd.start != 0
        or nd.end != num_tokens
        or model.dtype not in DTYPE_SUFFIX
        or _kv_quant(kv_caches[0], model.dtype) is None
        or model.embed_tokens.device.type != "cpu"
        or not getattr(model, "native_decode_parts", True)
        or not elementwise.available()
        or not paged_attention.available()
    ):
        return False
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    if not all(
        native_gemm(w, None, num_tokens, model.dtype) is not None
        for w in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)
    ):
        return False
    if not is_gemma(model):
        return True
    # Gemma layers run on the one-call step only (the per-layer loop is Llama's), with every
    # window's rows on the native kernel
    for w in {layer.self_attn.window for layer in model.layers}:
        v = meta.for_window(w).native_decode
        if v is None or v.start != 0 or v.end != num_tokens:
            return False
    return _fused_plan(model, num_tokens, kv_caches, meta) is not None


def is_gemma(model) -> bool:
    """Whether ``model``'s layers are Gemma's (offset norms, four per layer, GeGLU)."""
    return isinstance(model.norm, OffsetRMSNorm)


def _fused_plan(model, rows: int, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> _StepPlan | None:
    """The one-call step's plan for this step, or None where the per-layer path runs: under
    tensor parallelism, with ``fuse_native_decode`` off, LoRA rows the native kernel does not
    take, or no plan (``step_plan``)."""
    lora = meta.lora
    if (
        getattr(model, "tp", None) is not None
        or not getattr(model, "fuse_native_decode", True)
        or (lora is not None and not (FUSE_LORA and rows <= lora_ops.NATIVE_MAX_ROWS))
    ):
        return None
    plan = step_plan(model, rows, kv_caches)
    if plan is None or (lora is not None and not plan.has_lora):
        return None
    return plan


def forward_layers(
    model,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """All decoder layers and the final norm for embedded tokens ``x`` ``[T, hidden]``.

    Args:
        cos, sin: ``[T, 1, head_dim / 2]`` rotary tables of the tokens' positions.
        local: Gemma: the sliding layers' ``(cos, sin)`` (their own rotary base), else None.
        kv_caches: one ``[2, kv_heads, num_blocks, block_size, head_dim]`` per layer.
        meta: the step's metadata; ``applies`` must have returned True for it.
    Returns:
        ``[T, hidden]`` hidden states after the final norm, in the model dtype.

    Raises:
        ValueError: the step's index tensors are not contiguous int64; a Gemma model on a step
            the one-call step does not take.
        MemoryError: a quantized GEMM could not allocate its scratch.
    """
    nd = meta.native_decode
    # applies() checked native_decode; a step with KV caches has its slot mapping
    assert nd is not None and meta.slot_mapping is not None
    cos, sin = cos.contiguous(), sin.contiguous()
    if local is not None:
        local = (local[0].contiguous(), local[1].contiguous())
    slots = meta.slot_mapping.contiguous()
    for name, t in (("table", nd.table), ("kstart", nd.kstart), ("kend", nd.kend), ("slot_mapping", slots)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"native decode: {name} must be contiguous int64, got {t.dtype} {t.stride()}")
    plan = _fused_plan(model, x.shape[0], kv_caches, meta)
    if plan is not None:
        return plan.run(x, cos, sin, slots, nd, meta.lora, meta, local)
    if is_gemma(model):
        raise ValueError("native decode: Gemma layers run on the one-call step only (applies() said no)")
    return _forward_per_layer(model, x, cos, sin, slots, nd, kv_caches, meta)


def _forward_per_layer(
    model,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    nd: NativeDecode,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``forward_layers`` as nine native calls per layer (LoRA deltas and all-reduces between
    them); arguments checked by ``forward_layers`` (``nd``: ``meta.native_decode``)."""
    T, hidden = x.shape
    sfx = DTYPE_SUFFIX[model.dtype]
    nt = torch.get_num_threads()
    a0 = model.layers[0].self_attn
    H, KH, D = a0.num_heads, a0.num_kv_heads, a0.head_dim
    G = H // KH
    inter = model.layers[0].mlp.inter
    tp = getattr(model, "tp", None)
    new = lambda *shape: torch.empty(*shape, dtype=x.dtype)  # noqa: E731
    residual = x  # F.embedding's fresh output: updated in place from here on
    h, o, mlp_out = new(T, hidden), new(T, hidden), new(T, hidden)
    qkv = new(T, (H + 2 * KH) * D)
    qk = new(T, H + KH, D)
    attn_out = new(T, H * D)
    gate_up, act = new(T, 2 * inter), new(T, inter)
    rms = elementwise._LIB.fn(f"rms_norm_{sfx}")
    silu = elementwise._LIB.fn(f"silu_and_mul_{sfx}")
    kv_q8 = bool(_kv_quant(kv_caches[0], model.dtype))
    q8 = "_q8" if kv_q8 else ""
    rope = elementwise._LIB.fn(f"rope_write_kv{q8}_{sfx}")
    attend = paged_attention._LIB.fn(f"kv_paged_decode_attention{q8}_{sfx}")
    # the int8 kernel takes the codes' kind before nthreads and returns nonzero without memory
    kind = (paged_attention.QUANT_KIND[elementwise.QUANT_CACHE_DTYPE],) if kv_q8 else ()
    p = lambda t: t.data_ptr()  # noqa: E731
    cos_p, sin_p, slots_p = p(cos), p(sin), p(slots)
    table_p, nbmax, kstart_p, kend_p = p(nd.table), nd.table.shape[1], p(nd.kstart), p(nd.kend)

    lora = meta.lora

    # the panel GEMM reads float32 x: float32 x is its own, bfloat16 x is widened into this
    xf = None if x.dtype == torch.float32 else torch.empty(T * max(hidden, H * D, inter), dtype=torch.float32)

    # the kernel of each kind of weight, resolved once per step, not once per call
    resolved: dict = {}

    def gemm(weight, bias, src, dst, module=None, target=""):
        key = (
            type(weight),
            getattr(weight, "qtype", None),
            getattr(weight, "dtype", None),
            getattr(weight, "layout", None),
        )
        hit = resolved.get(key)
        if hit is None:
            call = native_gemm(weight, bias, T, x.dtype)
            assert call is not None  # applies() found native kernels (all layers share one format)
            fn, _, _, _, _, panel = call
            if isinstance(weight, quant.QuantWeight):
                attr = quant.weight_attr(weight, T, dtype=x.dtype)
            else:
                attr = WEIGHT_BYTES[type(weight)]
            hit = resolved[key] = (fn, panel, attr)
        fn, panel, attr = hit
        w, n, k = getattr(weight, attr).data_ptr(), weight.out_features, weight.in_features
        b = None if bias is None else bias.data_ptr()
        if panel:
            fn(p(src), p(src) if xf is None else p(xf), w, b, p(dst), T, n, k, nt)
        elif fn(p(src), w, b, p(dst), T, n, k, nt):  # only the quantized kernels return a status
            raise MemoryError(f"native decode: no memory for a quantized GEMM's scratch ({T} rows)")
        if lora is not None:
            la, lb = module.lora_stacks[target]
            add_lora(
                dst, src, la, lb, lora, parts=None if module.lora_parts is None else module.lora_parts[target]
            )

    for i, layer in enumerate(model.layers):
        attn, mlp, cache = layer.self_attn, layer.mlp, kv_caches[i]
        if i == 0:
            rms(
                p(residual),
                None,
                p(layer.input_layernorm.weight),
                p(h),
                T,
                hidden,
                layer.input_layernorm.eps,
                nt,
            )
        else:  # residual += mlp_out; h = norm(residual)
            rms(
                p(mlp_out),
                p(residual),
                p(layer.input_layernorm.weight),
                p(h),
                T,
                hidden,
                layer.input_layernorm.eps,
                nt,
            )
        gemm(attn.qkv_weight, attn.qkv_bias, h, qkv, attn, "qkv")
        if attn.q_norm is not None:  # per-head RMSNorm in place, one token's heads at a time
            row = (H + 2 * KH) * D * qkv.element_size()
            for t in range(T):
                q = p(qkv) + t * row
                k = q + H * D * qkv.element_size()
                rms(q, None, p(attn.q_norm.weight), q, H, D, attn.q_norm.eps, nt)
                rms(k, None, p(attn.k_norm.weight), k, KH, D, attn.k_norm.eps, nt)
        NB, BS = cache.shape[2], cache.shape[3]
        rope(p(qkv), cos_p, sin_p, p(qk), p(cache), slots_p, T, H, KH, D, NB * BS, nt)
        # q heads straight from qk's rows ((H + KH) * D apart); k/v are already in the cache
        rc = attend(
            p(qk),
            (H + KH) * D,
            p(cache),
            table_p,
            nbmax,
            kstart_p,
            kend_p,
            p(attn_out),
            T,
            KH,
            G,
            D,
            NB,
            BS,
            attn.attn.scale,
            *kind,
            nt,
        )
        if kv_q8 and rc:
            raise MemoryError("native decode: no memory for the int8 attention kernel's scores")
        gemm(attn.o_weight, attn.o_bias, attn_out, o, attn, "o")
        if tp is not None:  # row-parallel o: sum the ranks' partial outputs
            tp.all_reduce(o)
        rms(
            p(o),
            p(residual),
            p(layer.post_attention_layernorm.weight),
            p(h),
            T,
            hidden,
            layer.post_attention_layernorm.eps,
            nt,
        )
        gemm(mlp.gate_up_weight, None, h, gate_up, mlp, "gate_up")
        silu(p(gate_up), p(act), T, inter, nt)
        gemm(mlp.down_weight, None, act, mlp_out, mlp, "down")
        if tp is not None:  # row-parallel down
            tp.all_reduce(mlp_out)
    out = new(T, hidden)
    rms(p(mlp_out), p(residual), p(model.norm.weight), p(out), T, hidden, model.norm.eps, nt)
    return out


# ---------------------------------------------------------------- the one-call step


def _gemm_entry(entry: decode_layers.DLGemm, weight, bias: torch.Tensor | None, rows: int, dtype) -> bool:
    """Fill ``entry`` with ``weight``'s kernel for ``rows`` rows (the one ``native_gemm`` picks);
    False when it has none."""
    call = native_gemm(weight, bias, rows, dtype)
    if call is None:
        return False
    fn, w, b, n, k, panel = call
    if panel:
        kind = decode_layers.PANEL
    elif isinstance(weight, quant.QuantWeight):
        tile = quant.pick_kernel(rows, weight.qtype, dtype) == "tile"
        kind = decode_layers.TILE if tile else decode_layers.STATUS
    else:
        kind = decode_layers.AMX
    entry.fn, entry.kind, entry.w, entry.bias, entry.n, entry.k = (
        decode_layers.fn_address(fn),
        kind,
        w,
        b,
        n,
        k,
    )
    return True


class _StepPlan:
    """The dispatch table of ``decode_layers``' one-call step for one model and step regime
    (every row count that picks the same kernels: ``_regime``), with the activation buffers.

    It references every tensor whose address it holds (weights, biases, norms, caches,
    buffers), so none is freed while the C side may read it.
    """

    #: Gemma's layers (``is_gemma``): ``run`` binds each window's inputs and the local rotary table
    gemma = False

    def __init__(self, model, rows: int):
        dtype = model.dtype
        self.has_lora = False  # every target's LoRA slots in the table (``_lora_entries``)
        a0, m0 = model.layers[0].self_attn, model.layers[0].mlp
        self.H, self.KH, self.D, self.inter = a0.num_heads, a0.num_kv_heads, a0.head_dim, m0.inter
        self.hidden = model.embed_tokens.shape[1]
        self.dtype = dtype
        self.keep: list = []  # everything the table points into
        self.ok = self._fill(model, rows)

    def _norm(self, norm, size: int) -> int | None:
        """The address of ``norm``'s weight as the step reads it (kept alive): float32
        ``1 + weight`` of a Gemma norm, the model-dtype weight of an RMSNorm; None for another
        kind or shape."""
        if isinstance(norm, OffsetRMSNorm) and self.gemma:
            t = norm.scale()
        elif isinstance(norm, RMSNorm) and not self.gemma:
            t = norm.weight
            if t.dtype != self.dtype:
                return None
        else:
            return None
        if t.shape != (size,) or not t.is_contiguous():
            return None
        self.keep.append(t)
        return t.data_ptr()

    def _fill(self, model, rows: int) -> bool:
        sfx = DTYPE_SUFFIX[self.dtype]
        L = len(model.layers)
        self.layers = (decode_layers.DLLayer * L)()
        self.gemma = is_gemma(model)
        #: Gemma: each distinct window of the layers (``DLModel.keys`` in this order)
        self.windows: list[int | None] = []
        if self.gemma:
            self.windows = sorted({layer.self_attn.window for layer in model.layers}, key=lambda w: w or 0)
            if len(self.windows) > decode_layers.MAX_KEYS:
                return False
        for i, layer in enumerate(model.layers):
            attn, mlp, e = layer.self_attn, layer.mlp, self.layers[i]
            if (attn.q_norm is None) != (attn.k_norm is None):
                return False
            if attn.q_norm is not None:
                qn, kn = self._norm(attn.q_norm, self.D), self._norm(attn.k_norm, self.D)
                if qn is None or kn is None:
                    return False
                e.q_norm, e.k_norm, e.q_eps, e.k_eps = qn, kn, attn.q_norm.eps, attn.k_norm.eps
            if self.gemma:
                if attn.attn.softcap is not None or getattr(mlp, "approximate", None) != "tanh":
                    return False  # (no soft-capping decode kernel; only the tanh GELU)
                pre = self._norm(layer.pre_feedforward_layernorm, self.hidden)
                post = self._norm(layer.post_feedforward_layernorm, self.hidden)
                if pre is None or post is None:
                    return False
                e.pre_ff_norm, e.post_ff_norm = pre, post
                e.pre_ff_eps = layer.pre_feedforward_layernorm.eps
                e.post_ff_eps = layer.post_feedforward_layernorm.eps
                e.keys = self.windows.index(attn.window)
                e.local_rope = int(bool(model.layer_windows[i]))
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.inter) != (
                self.H,
                self.KH,
                self.D,
                self.inter,
            ):
                return False
            for entry, weight, bias in (
                (e.qkv, attn.qkv_weight, attn.qkv_bias),
                (e.o, attn.o_weight, attn.o_bias),
                (e.gate_up, mlp.gate_up_weight, None),
                (e.down, mlp.down_weight, None),
            ):
                if not _gemm_entry(entry, weight, bias, rows, self.dtype):
                    return False
                self.keep += [weight, bias]
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            for t in (attn.qkv_bias, attn.o_bias):
                if t is not None and (t.dtype != self.dtype or not t.is_contiguous()):
                    return False
            in_norm, post_norm = self._norm(n1, self.hidden), self._norm(n2, self.hidden)
            if in_norm is None or post_norm is None:
                return False
            e.in_norm, e.post_norm = in_norm, post_norm
            e.in_eps, e.post_eps, e.scale = n1.eps, n2.eps, attn.attn.scale
        final_norm = self._norm(model.norm, self.hidden)
        if final_norm is None:
            return False
        fn = decode_layers.fn_address
        self.struct = m = decode_layers.DLModel()
        if self.gemma:
            m.gemma, m.nkeys = 1, len(self.windows)
            m.offset_rms = fn(elementwise._LIB.fn(f"offset_rms_norm_{sfx}"))
            m.gelu = fn(elementwise._LIB.fn(f"gelu_tanh_and_mul_{sfx}"))
        m.rms = fn(elementwise._LIB.fn(f"rms_norm_{sfx}"))
        m.rope = fn(elementwise._LIB.fn(f"rope_write_kv_{sfx}"))
        m.silu = fn(elementwise._LIB.fn(f"silu_and_mul_{sfx}"))
        m.attend = fn(paged_attention._LIB.fn(f"kv_paged_decode_attention_{sfx}"))
        m.layers = ctypes.cast(self.layers, ctypes.POINTER(decode_layers.DLLayer))
        m.num_layers, m.hidden, m.H, m.KH, m.D, m.inter = L, self.hidden, self.H, self.KH, self.D, self.inter
        m.final_norm, m.final_eps = final_norm, model.norm.eps
        self.has_lora = self._lora_entries(model)
        self.addr = ctypes.addressof(m)
        self.fn = decode_layers.step_fn(self.dtype)
        self.cache_ptrs: list[int] = []
        self.caches: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self._grow(rows)
        return True

    def _lora_entries(self, model) -> bool:
        """Fill every layer's LoRA entries from the slots ``LoRAManager`` attached
        (``lora_stacks``, ``lora_parts``) and the model's LoRA kernel; False (entries left
        empty: LoRA steps run the per-layer path) when the model has no slots or the kernel
        does not take them (``lora_kernel.supported``: dtypes, contiguous innermost dimensions,
        the library built; and one slot dtype, ``A``'s input features the GEMM's)."""
        attn0 = model.layers[0].self_attn
        if attn0.lora_stacks is None or not lora_kernel.available():
            return False
        entries = []
        slot_dtype = attn0.lora_stacks["qkv"][0].dtype
        probe = torch.empty(1, 1, dtype=self.dtype)
        for i, layer in enumerate(model.layers):
            e = self.layers[i]
            for module, target, entry, dl_gemm in (
                (layer.self_attn, "qkv", e.lora_qkv, e.qkv),
                (layer.self_attn, "o", e.lora_o, e.o),
                (layer.mlp, "gate_up", e.lora_gate_up, e.gate_up),
                (layer.mlp, "down", e.lora_down, e.down),
            ):
                if module.lora_stacks is None or target not in module.lora_stacks:
                    return False
                a, b = module.lora_stacks[target]
                cols = (0, dl_gemm.n) if module.lora_parts is None else tuple(module.lora_parts[target])
                P = len(cols) - 1
                if (
                    a.dtype != slot_dtype
                    or not lora_kernel.supported(probe, probe, a, b)
                    or a.shape[1] != dl_gemm.k
                    or a.shape[2] % P
                    or tuple(b.shape[:2]) != (a.shape[0], a.shape[2])
                    or cols[-1] > min(dl_gemm.n, b.shape[2])
                ):
                    return False
                ct = torch.tensor(cols, dtype=torch.int64)
                entries.append((entry, a, b, P, ct))
        for entry, a, b, P, ct in entries:
            entry.a, entry.b = a.data_ptr(), b.data_ptr()
            entry.a_slot, entry.a_row, entry.b_slot, entry.b_row = (
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
            )
            entry.P, entry.R, entry.cols = P, a.shape[2] // P, ct.data_ptr()
            self.keep += [a, b, ct]
        sfx = DTYPE_SUFFIX[self.dtype]
        m = self.struct
        m.lora = decode_layers.fn_address(lora_kernel._LIB.fn(f"lora_add_{sfx}_w{DTYPE_SUFFIX[slot_dtype]}"))
        m.lora_wbf16 = int(slot_dtype == torch.bfloat16)
        return True

    def _grow(self, rows: int) -> None:
        """Activation buffers for at least ``rows`` rows (a power of two: few regrowths)."""
        rows = 1 << (rows - 1).bit_length()
        H, KH, D, hidden, inter = self.H, self.KH, self.D, self.hidden, self.inter
        new = lambda n: torch.empty(rows * n, dtype=self.dtype)  # noqa: E731
        names = ("h", "o", "mlp_out", "qkv", "qk", "attn_out", "gate_up", "act")
        sizes = (hidden, hidden, hidden, (H + 2 * KH) * D, (H + KH) * D, H * D, 2 * inter, inter)
        self.buffers = [new(n) for n in sizes]
        m = self.struct
        for name, buf in zip(names, self.buffers):
            setattr(m, name, buf.data_ptr())
        xf = None
        if self.dtype != torch.float32:  # the panel GEMM widens bfloat16 x into this
            xf = torch.empty(rows * max(hidden, H * D, inter), dtype=torch.float32)
            self.buffers.append(xf)
        m.xf = None if xf is None else xf.data_ptr()
        m.max_rows = rows

    def bind_caches(self, kv_caches: list[torch.Tensor], ptrs: list[int]) -> None:
        """Point every layer at its cache (``[2, KH, NB, BS, D]``, contiguous, the model dtype;
        or int8 ``[2, KH, NB, BS, D + 2]``, then with the int8 cache's rope and attention
        kernels).

        Raises:
            ValueError: a cache of another count, shape, dtype or layout.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"native decode: {len(kv_caches)} KV caches for {len(self.layers)} layers")
        kv_q8 = _kv_quant(kv_caches[0], self.dtype) if kv_caches else False
        cdtype = elementwise.QUANT_CACHE_DTYPE if kv_q8 else self.dtype
        width = self.D + 2 if kv_q8 else self.D
        for i, c in enumerate(kv_caches):
            if (
                c.dim() != 5
                or c.shape[0] != 2
                or c.shape[1] != self.KH
                or c.shape[4] != width
                or c.dtype != cdtype
                or not c.is_contiguous()
            ):
                raise ValueError(
                    f"native decode: layer {i}'s KV cache {tuple(c.shape)} {c.dtype} is not a contiguous "
                    f"[2, {self.KH}, blocks, block_size, {width}] {cdtype} tensor"
                )
            e = self.layers[i]
            e.cache, e.nb, e.bs = ptrs[i], c.shape[2], c.shape[3]
        sfx, q8, m = DTYPE_SUFFIX[self.dtype], "_q8" if kv_q8 else "", self.struct
        m.rope = decode_layers.fn_address(elementwise._LIB.fn(f"rope_write_kv{q8}_{sfx}"))
        m.attend = decode_layers.fn_address(paged_attention._LIB.fn(f"kv_paged_decode_attention{q8}_{sfx}"))
        m.kv_quant = int(bool(kv_q8))
        self.caches, self.cache_ptrs = list(kv_caches), ptrs

    def _bind_windows(
        self, T: int, meta: AttentionMetadata | None, local: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        """Point ``DLModel.keys`` at each window's decode inputs of this step and the local
        rotary table at ``local`` (both read during the call only)."""
        if meta is None or local is None:
            raise ValueError(
                "native decode: a Gemma step needs the step's metadata and the local rotary table"
            )
        m = self.struct
        for k, w in enumerate(self.windows):
            v = meta.for_window(w).native_decode
            if v is None or v.start != 0 or v.end != T:
                raise ValueError(f"native decode: window {w} has no native decode inputs for rows [0, {T})")
            for t in (v.table, v.kstart, v.kend):
                if t.dtype != torch.int64 or not t.is_contiguous():
                    raise ValueError(f"native decode: window {w}'s inputs must be contiguous int64")
            e = m.keys[k]
            e.table, e.nbmax, e.kstart, e.kend = (
                v.table.data_ptr(),
                v.table.shape[1],
                v.kstart.data_ptr(),
                v.kend.data_ptr(),
            )
        c, s = local
        if not (c.is_contiguous() and s.is_contiguous()):
            raise ValueError("native decode: the local rotary table must be contiguous")
        m.cos_local, m.sin_local = c.data_ptr(), s.data_ptr()

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        nd,
        lora=None,
        meta: AttentionMetadata | None = None,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The step for embedded tokens ``x`` ``[T, hidden]`` (updated in place, as the
        residual); returns the hidden states after the final norm (a new ``[T, hidden]``).
        ``lora``: the step's ``LoRAMapping`` (its rows and segments, read during the call), or
        None; only with ``has_lora``. Gemma plans: ``meta``, the step's metadata (each window's
        ``native_decode``), and ``local``, the sliding layers' ``(cos, sin)``.

        Raises:
            ValueError: ``lora`` given to a plan without LoRA entries, or of another row count;
                a Gemma plan without ``meta`` / ``local`` or a window's inputs that do not
                cover the rows as contiguous int64.
        """
        T = x.shape[0]
        if T > self.struct.max_rows:
            self._grow(T)
        m = self.struct
        if self.gemma:
            self._bind_windows(T, meta, local)
        if lora is None:
            m.lora_nseg = 0
        else:
            if not self.has_lora or lora.num_tokens != T:
                raise ValueError(
                    f"native decode: a LoRA mapping of {lora.num_tokens} rows for a {T}-row step "
                    f"(plan has LoRA entries: {self.has_lora})"
                )
            # (LoRAMapping builds both contiguous int64, rows and slots in range)
            m.lora_rows, m.lora_segs, m.lora_nseg = (
                lora.rows.data_ptr(),
                lora.segs.data_ptr(),
                lora.segs.shape[0],
            )
        out = torch.empty(T, self.hidden, dtype=x.dtype)
        p = torch.Tensor.data_ptr
        rc = self.fn(
            self.addr,
            T,
            p(cos),
            p(sin),
            p(slots),
            p(nd.table),
            nd.table.shape[1],
            p(nd.kstart),
            p(nd.kend),
            p(x),
            p(out),
            torch.get_num_threads(),
        )
        m.lora_nseg = 0  # (the mapping's arrays are not the table's to keep)
        if rc == decode_layers.ENOMEM:
            raise MemoryError(
                f"native decode: no memory for a quantized GEMM's or LoRA kernel's scratch ({T} rows)"
            )
        if rc:
            raise RuntimeError(
                f"native decode: the one-call step refused its dispatch table ({rc}, {T} rows)"
            )
        return out


#: model -> ``(sentinel, {regime: _StepPlan or None}, quantized)``: the plans of each model,
#: dropped when its linear weights are replaced (prepacked or quantized again: the sentinel is
#: its first and last linear weight objects and its dtype) or LoRA slots are attached (the
#: first layer's ``lora_stacks`` object).
_PLANS: weakref.WeakKeyDictionary[object, tuple[tuple, dict[tuple, _StepPlan | None], bool]] = (
    weakref.WeakKeyDictionary()
)


def _regime(rows: int, quantized: bool, dtype: torch.dtype) -> tuple:
    """What decides the kernels ``native_gemm`` picks for ``rows`` rows of ``dtype``: for a
    quantized model the kernel ``quant.pick_kernel`` picks per weight type (so every one of
    its row thresholds, its mode and switches) and the x4 switch (which bytes they read); the
    AMX kernel's and the bfloat16 panels' row limits."""
    return (
        rows >= quant.PANEL_ROWS,
        (
            tuple(quant.pick_kernel(rows, t, dtype) for t in quant.BLOCK_BYTES),
            quant.x4_enabled(),
        )
        if quantized
        else None,
        rows <= gemm_amx.MAX_ROWS,
        rows <= gemm.BF16_DOT_MAX_ROWS,
    )


def lora_kernel_seconds(model) -> float:
    """Wall seconds the one-call steps of ``model`` have spent in the LoRA kernel so far (all
    its plans; ``DLModel.lora_seconds``; 0.0 for None or a model without plans): what a profile of LoRA steps counts as the LoRA op
    there, the calls being made from C."""
    hit = None if model is None else _PLANS.get(model)
    if hit is None:
        return 0.0
    return sum(p.struct.lora_seconds for p in hit[1].values() if p is not None)


def step_plan(model, rows: int, kv_caches: list[torch.Tensor]) -> _StepPlan | None:
    """The one-call step's dispatch table for ``rows`` rows of ``model``, its caches bound to
    ``kv_caches``; None when the fused library is unavailable or a layer has no native kernel
    for this step (then the per-layer path runs)."""
    layers = model.layers
    # (the LoRA slots too: a manager attached after a plan was built gets new plans)
    sentinel = (
        layers[0].self_attn.qkv_weight,
        layers[-1].mlp.down_weight,
        model.dtype,
        layers[0].self_attn.lora_stacks,
    )
    hit = _PLANS.get(model)
    if (
        hit is None
        or hit[0][0] is not sentinel[0]
        or hit[0][1] is not sentinel[1]
        or hit[0][2] != sentinel[2]
        or hit[0][3] is not sentinel[3]
    ):
        if not decode_layers.available():
            return None
        quantized = any(
            isinstance(w, quant.QuantWeight)
            for layer in layers
            for w in (
                layer.self_attn.qkv_weight,
                layer.self_attn.o_weight,
                layer.mlp.gate_up_weight,
                layer.mlp.down_weight,
            )
        )
        hit = _PLANS[model] = (sentinel, {}, quantized)
    regime = _regime(rows, hit[2], model.dtype)
    plans = hit[1]
    if regime in plans:
        plan = plans[regime]
    else:
        built = _StepPlan(model, rows)
        plan = plans[regime] = built if built.ok else None
    if plan is None:
        return None
    ptrs = [c.data_ptr() for c in kv_caches]
    if ptrs != plan.cache_ptrs:
        plan.bind_caches(kv_caches, ptrs)
    return plan
