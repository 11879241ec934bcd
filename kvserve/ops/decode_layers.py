"""Every decoder layer of a pure-decode CPU step in one native call (``kvserve/csrc/decode_layers.c``:
the sequence, why, and what it does not cover).

The C side reads a dispatch table (``DLModel`` with one ``DLLayer`` per layer, one ``DLGemm``
per weight): the entry points of the other kernel libraries as addresses (``fn_address``), the
weights' and caches' data pointers, shapes, and the activation buffers. ``model_executor/models/cpu_decode_step.py``
builds it once per model and step regime and calls ``step``; this module only holds the
layout and the call.
"""

from __future__ import annotations

import ctypes

from kvserve.ops.library import DTYPE_SUFFIX, NativeLibrary

_p, _i64, _f, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

#: ``DLGemm.kind``: how the kernel is called (``decode_layers.c``'s ``DL_*``).
TILE, STATUS, PANEL, AMX = 0, 1, 2, 3
#: ``step`` results (``DL_OK``, ``DL_ENOMEM``, ``DL_EINVAL``).
OK, ENOMEM, EINVAL = 0, -1, -2


class DLGemm(ctypes.Structure):
    """One weight's GEMM: kernel address, kind, weight bytes, bias (or 0), out / in features."""

    _fields_ = [("fn", _p), ("kind", _i64), ("w", _p), ("bias", _p), ("n", _i64), ("k", _i64)]


class DLLora(ctypes.Structure):
    """One target's LoRA slots as ``lora.c``'s ``lora_add`` reads them: ``A`` / ``B`` data
    pointers (``a`` 0: no delta for this target) and element strides (slot, row), the fused
    parts ``P``, the rank per part ``R`` and the parts' ``P + 1`` output column bounds."""

    _fields_ = [
        ("a", _p),
        ("b", _p),
        ("a_slot", _i64),
        ("a_row", _i64),
        ("b_slot", _i64),
        ("b_row", _i64),
        ("P", _i64),
        ("R", _i64),
        ("cols", _p),
    ]


class DLKeys(ctypes.Structure):
    """One window's decode attention inputs: block table ``[T, nbmax]``, ``kstart`` / ``kend``
    ``[T]`` (``NativeDecode``'s tensors, int64)."""

    _fields_ = [("table", _p), ("nbmax", _i64), ("kstart", _p), ("kend", _p)]


#: ``DLModel.keys`` entries: the most distinct attention windows of a model's layers.
MAX_KEYS = 4


class DLLayer(ctypes.Structure):
    """One decoder layer: norm weights and eps, the four GEMMs, its KV cache
    (``[2, KH, nb, bs, D]``), the softmax scale and each GEMM's LoRA slots; the per-head
    ``q_norm`` / ``k_norm`` weights (0: none; the model dtype under RMSNorm, float32 ``1 + w``
    for Gemma), Gemma's pre- / post-feedforward norms (float32 ``1 + w``), the layer's window
    (an index into ``DLModel.keys``) and whether it rotates by the local table."""

    _fields_ = [
        ("in_norm", _p),
        ("post_norm", _p),
        ("in_eps", _f),
        ("post_eps", _f),
        ("qkv", DLGemm),
        ("o", DLGemm),
        ("gate_up", DLGemm),
        ("down", DLGemm),
        ("cache", _p),
        ("nb", _i64),
        ("bs", _i64),
        ("scale", _f),
        ("lora_qkv", DLLora),
        ("lora_o", DLLora),
        ("lora_gate_up", DLLora),
        ("lora_down", DLLora),
        ("q_norm", _p),
        ("k_norm", _p),
        ("q_eps", _f),
        ("k_eps", _f),
        ("pre_ff_norm", _p),
        ("post_ff_norm", _p),
        ("pre_ff_eps", _f),
        ("post_ff_eps", _f),
        ("keys", _i64),
        ("local_rope", _i64),
    ]


class DLModel(ctypes.Structure):
    """The step's kernels, the layers, shapes, the final norm and the activation buffers
    (``max_rows`` rows each; ``xf`` float32, bfloat16 models only); the LoRA kernel
    (``lora``, its slots' dtype ``lora_wbf16``) and the step's LoRA rows and segments
    (``lora_nseg`` 0: none), set before each call; ``lora_seconds``: wall seconds the C side
    spent in the LoRA kernel, accumulated over calls. Gemma layers (``gemma`` 1): the
    ``offset_rms`` and ``gelu`` kernels; layers of several windows: each window's attention
    inputs in ``keys`` (``nkeys`` of them, 0: every layer takes the step's arguments) and the
    local rotary table (``cos_local`` / ``sin_local``), set before each call. ``kv_quant``: 1
    for int8 KV caches (then ``rope`` and ``attend`` are the int8 cache's kernels:
    ``rope_write_kv_q8``, ``kv_paged_decode_attention_q8``), 0 for caches of the model dtype."""

    _fields_ = [
        ("rms", _p),
        ("rope", _p),
        ("silu", _p),
        ("attend", _p),
        ("layers", ctypes.POINTER(DLLayer)),
        ("num_layers", _i64),
        ("hidden", _i64),
        ("H", _i64),
        ("KH", _i64),
        ("D", _i64),
        ("inter", _i64),
        ("final_norm", _p),
        ("final_eps", _f),
        ("max_rows", _i64),
        ("h", _p),
        ("o", _p),
        ("mlp_out", _p),
        ("qkv", _p),
        ("qk", _p),
        ("attn_out", _p),
        ("gate_up", _p),
        ("act", _p),
        ("xf", _p),
        ("lora", _p),
        ("lora_wbf16", _i64),
        ("lora_rows", _p),
        ("lora_segs", _p),
        ("lora_nseg", _i64),
        ("lora_seconds", ctypes.c_double),
        ("gemma", _i64),
        ("offset_rms", _p),
        ("gelu", _p),
        ("keys", DLKeys * MAX_KEYS),
        ("nkeys", _i64),
        ("cos_local", _p),
        ("sin_local", _p),
        ("kv_quant", _i64),
    ]


# (model, T, cos, sin, slots, table, nbmax, kstart, kend, residual, out, nthreads) -> int
_SIGS: dict[str, list] = {
    f"decode_layers_{s}": [_p, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _i] for s in DTYPE_SUFFIX.values()
}
_SIGS["decode_layers_struct_sizes"] = [_i64]
_LIB = NativeLibrary("kv_decode_layers", "decode_layers.c", _SIGS)
_layout_ok: bool | None = None


def available() -> bool:
    """True when the library is built and loaded and its struct layout is this module's."""
    global _layout_ok
    if _layout_ok is None:
        if not _LIB.available():
            _layout_ok = False
        else:
            sizes = _LIB.fn("decode_layers_struct_sizes")
            sizes.restype = ctypes.c_int64
            _layout_ok = [sizes(i) for i in range(5)] == [
                ctypes.sizeof(DLGemm),
                ctypes.sizeof(DLLayer),
                ctypes.sizeof(DLModel),
                ctypes.sizeof(DLLora),
                ctypes.sizeof(DLKeys),
            ]
    return _layout_ok


def failure_reason() -> str | None:
    if _LIB.failure_reason():
        return _LIB.failure_reason()
    if _layout_ok is False:
        return "decode_layers.c's structs differ from decode_layers.py's"
    return None


def fn_address(fn) -> int:
    """The address of a loaded ctypes function (for a dispatch-table entry)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def step_fn(dtype):
    """The C step for the storage ``dtype`` (float32 or bfloat16), returning an ``int``."""
    fn = _LIB.fn(f"decode_layers_{DTYPE_SUFFIX[dtype]}")
    if fn.restype is not ctypes.c_int:
        fn.restype = ctypes.c_int
    return fn
