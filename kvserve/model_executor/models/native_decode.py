"""The decoder layers of a pure-decode CPU step as a straight run of native calls.

Why: the kernels of a decode step are few and short (4 GEMMs, attention, 2 RMSNorms, rotary +
cache write, SiLU-and-mul per layer), and the Python around each -- nn.Module calls, argument
checks, output allocation, ctypes conversion -- cost 6.4-7 ms per step at 8 sequences and
13.5 ms at 64 on this project's 2-core machine (a 30-layer model with tiny matrices, whose
kernels cost next to nothing), 15-20% of a real SmolLM2-135M step. Here the checks run once per
step, the activations live in nine buffers allocated once per step and reused by every layer,
and each layer is nine ctypes calls with integer arguments.

The kernels and their order are those of ``LlamaForCausalLM``'s module path, so the hidden
states are bit-identical to it (``tests/executor/test_native_decode.py``). Under tensor
parallelism every rank runs its shard's layers here too (H/T heads, KV heads and MLP columns per
rank: the kernels take any shape), with the same all-reduce after o and down as the module path.

Applies when (``applies``): CPU, float32 or bfloat16, every linear weight packed for a native
kernel that takes this step's row count (``native_gemm.PanelWeight`` of the model dtype, or
``amx_gemm.AmxWeight`` up to ``amx_gemm.MAX_ROWS`` rows), all rows single-token decodes on the
native attention kernel (``meta.native_decode``), and the native ops available. Otherwise the
module path runs. A step with LoRA adapters (``meta.lora``) adds their deltas right after each
GEMM, as the module path does (``kvserve.lora.ops.add_lora``).
"""

from __future__ import annotations

import torch

from kvserve.lora.ops import add_lora
from kvserve.model_executor.layers import amx_gemm, native_attention, native_gemm, native_ops, quant_gemm
from kvserve.model_executor.layers.attention import AttentionMetadata
from kvserve.model_executor.layers.native_lib import DTYPE_SUFFIX


def _gemm_call(weight, bias: torch.Tensor | None, rows: int, dtype: torch.dtype):
    """``(fn, weight_ptr, bias_ptr, out_features, in_features, is_panel)`` for a native GEMM of
    ``rows`` rows, or ``None`` when ``weight`` has none."""
    b = None if bias is None else bias.data_ptr()
    if isinstance(weight, quant_gemm.QuantWeight) and quant_gemm.available():
        return (
            quant_gemm.kernel_fn(weight, rows, dtype),
            quant_gemm.kernel_weight(weight, rows).data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            False,
        )
    if isinstance(weight, amx_gemm.AmxWeight) and rows <= amx_gemm.MAX_ROWS and amx_gemm.available():
        return (
            amx_gemm._LIB.fn("amx_gemm_bf16"),
            weight.tiles.data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            False,
        )
    if isinstance(weight, native_gemm.PanelWeight) and weight.dtype == dtype and native_gemm.available():
        return (
            native_gemm._LIB.fn(f"gemm_{DTYPE_SUFFIX[dtype]}"),
            weight.panels.data_ptr(),
            b,
            weight.out_features,
            weight.in_features,
            True,
        )
    return None


#: The tensor holding each native weight kind's bytes (the pointer ``_gemm_call`` passes; a
#: ``QuantWeight``'s depends on the kernel: ``quant_gemm.weight_attr``).
_WEIGHT_BYTES = {
    quant_gemm.QuantWeight: "data",
    amx_gemm.AmxWeight: "tiles",
    native_gemm.PanelWeight: "panels",
}


def applies(model, kv_caches: list[torch.Tensor] | None, meta: AttentionMetadata, num_tokens: int) -> bool:
    """True when ``forward_layers`` can run this step (see the module doc)."""
    nd = meta.native_decode
    if (
        kv_caches is None
        or nd is None
        or meta.prefills
        or meta.decode_buckets
        or nd.start != 0
        or nd.end != num_tokens
        or model.dtype not in DTYPE_SUFFIX
        or model.embed_tokens.device.type != "cpu"
        or not native_ops.available()
        or not native_attention.available()
    ):
        return False
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    return all(
        _gemm_call(w, None, num_tokens, model.dtype) is not None
        for w in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)
    )


def forward_layers(
    model,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """All decoder layers and the final norm for embedded tokens ``x`` ``[T, hidden]``.

    Args:
        cos, sin: ``[T, 1, head_dim / 2]`` rotary tables of the tokens' positions.
        kv_caches: one ``[2, kv_heads, num_blocks, block_size, head_dim]`` per layer.
        meta: the step's metadata; ``applies`` must have returned True for it.
    Returns:
        ``[T, hidden]`` hidden states after the final norm, in the model dtype.
    """
    T, hidden = x.shape
    sfx = DTYPE_SUFFIX[model.dtype]
    nt = torch.get_num_threads()
    a0 = model.layers[0].self_attn
    H, KH, D = a0.num_heads, a0.num_kv_heads, a0.head_dim
    G = H // KH
    inter = model.layers[0].mlp.inter
    tp = getattr(model, "tp", None)
    nd = meta.native_decode
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = meta.slot_mapping.contiguous()
    for name, t in (("table", nd.table), ("kstart", nd.kstart), ("kend", nd.kend), ("slot_mapping", slots)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"native decode: {name} must be contiguous int64, got {t.dtype} {t.stride()}")
    new = lambda *shape: torch.empty(*shape, dtype=x.dtype)  # noqa: E731
    residual = x  # F.embedding's fresh output: updated in place from here on
    h, o, mlp_out = new(T, hidden), new(T, hidden), new(T, hidden)
    qkv = new(T, (H + 2 * KH) * D)
    qk = new(T, H + KH, D)
    attn_out = new(T, H * D)
    gate_up, act = new(T, 2 * inter), new(T, inter)
    rms = native_ops._LIB.fn(f"rms_norm_{sfx}")
    rope = native_ops._LIB.fn(f"rope_write_kv_{sfx}")
    silu = native_ops._LIB.fn(f"silu_and_mul_{sfx}")
    attend = native_attention._LIB.fn(f"kv_paged_decode_attention_{sfx}")
    p = lambda t: t.data_ptr()  # noqa: E731
    cos_p, sin_p, slots_p = p(cos), p(sin), p(slots)
    table_p, nbmax, kstart_p, kend_p = p(nd.table), nd.table.shape[1], p(nd.kstart), p(nd.kend)

    lora = meta.lora

    # the panel GEMM reads float32 x: float32 x is its own, bfloat16 x is widened into this
    xf = None if x.dtype == torch.float32 else torch.empty(T * max(hidden, H * D, inter), dtype=torch.float32)

    # the kernel of each kind of weight, resolved once per step (its lookup cost ~3-6 us a call)
    resolved: dict = {}

    def gemm(weight, bias, src, dst, module=None, target=""):
        key = (type(weight), getattr(weight, "qtype", None), getattr(weight, "dtype", None))
        hit = resolved.get(key)
        if hit is None:
            fn, _, _, _, _, panel = _gemm_call(weight, bias, T, x.dtype)
            if isinstance(weight, quant_gemm.QuantWeight):
                attr = quant_gemm.weight_attr(T, weight.qtype)
            else:
                attr = _WEIGHT_BYTES[type(weight)]
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
        NB, BS = cache.shape[2], cache.shape[3]
        rope(p(qkv), cos_p, sin_p, p(qk), p(cache), slots_p, T, H, KH, D, NB * BS, nt)
        # q heads straight from qk's rows ((H + KH) * D apart); k/v are already in the cache
        attend(
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
            nt,
        )
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
