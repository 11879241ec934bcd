"""``kvserve doctor``: what this host gives the CPU engine.

Prints the CPU's relevant instruction sets, the C compiler, each kernel library of
``kvserve/csrc/`` (built and loaded, or why not), which implementation every hot-path operation
uses here per dtype, the thread count the engine would choose now and why, and every
``KVSERVE_*`` variable with its current value, and how many KV-cache tokens a GiB holds per
``--kv-cache-dtype`` for a model shape (``--model DIR``: its config.json; default SmolLM2-135M's).
``--json`` prints
the same as one JSON object. Nothing is loaded but the kernels (no model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from kvserve import envs
from kvserve.ops.cpu import cpu_flags, cpu_model

#: /proc/cpuinfo flags that decide a kernel path: name -> what it enables.
CPU_FEATURES = {
    "avx2": "16-lane vectors as two AVX2 registers (the portable fallback)",
    "avx512f": "16-lane vectors in one register (every kernel)",
    "avx512_bf16": "bfloat16 dot products in decode attention (vdpbf16ps), one-instruction bf16 rounding",
    "amx_tile": "AMX tiles (with amx_bf16): bfloat16 decode GEMM and prefill attention",
    "amx_bf16": "AMX bfloat16 tile products",
}


def _quant_gemm_path(flags: set[str]) -> str:
    """The quantized GEMMs' route on this host (``quant.pick_kernel``'s choices), or what
    is wrong with ``KVSERVE_QUANT_ACT`` (a quantized model then refuses to load)."""
    from kvserve.ops import quant

    vec = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "scalar"
    try:
        mode = quant.activation_mode()
    except ValueError as e:
        return f"kvserve quantized GEMM ({vec}); {e}: a quantized model refuses to load"
    if mode == "int8":
        few = f"int8 activations, int8 dot products {quant.act8_isa()}"
    else:
        few = "float activations, weights dequantized in registers"
    if quant.amx_enabled():
        rows = quant.AMX_ROWS
        many = f"AMX bfloat16 tiles from {rows['q4_1']} (Q4_1) / {rows['q8_0']} (Q8_0) rows"
    elif quant.vnni_enabled("q8_0"):  # (Q4_1 too unless KVSERVE_QUANT_X4=0)
        vnni = [t for t in quant.VNNI_TYPES if quant.vnni_enabled(t)]
        many = (
            "VNNI int8 panels from "
            + " / ".join(str(quant.VNNI_ROWS[t]) for t in vnni)
            + f" ({' / '.join(t.upper() for t in vnni)}) rows (bfloat16 up to "
            f"{quant.VNNI_BF16_MAX_ROWS}), "
            f"other types and larger bfloat16 steps dequantized float32 panels from {quant.PANEL_ROWS}"
        )
    else:
        many = f"dequantized float32 panels from {quant.PANEL_ROWS}"
    return f"kvserve quantized GEMM ({vec}; few rows: {few}; more rows: {many})"


def _compiler() -> dict:
    from kvserve.ops import library

    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    version = None
    if path:
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
            version = version.splitlines()[0] if version else None
        except (OSError, subprocess.SubprocessError):
            version = None
    return {
        "cc": cc,
        "path": path,
        "version": version,
        "cflags": " ".join(library.CFLAGS),
        "extra_cflags": envs.KVSERVE_NATIVE_CFLAGS,
    }


def _libraries() -> list[dict]:
    from kvserve.ops import library

    return [
        {
            "name": lib.name,
            "source": f"kvserve/csrc/{lib.source}",
            "loaded": lib.available(),
            "path": str(lib.path) if lib.path else None,
            "failure": lib.failure_reason(),
        }
        for lib in library.all_libraries()
    ]


def _paths(flags: set[str]) -> dict[str, dict[str, str]]:
    """Operation -> dtype -> the implementation the CPU engine uses for it on this host (the
    same tests as ``linear.prepack_weight``, ``attention`` and the model runner make)."""
    from kvserve.ops import attention as paged_attention
    from kvserve.ops import bitmask as bitmask_kernel
    from kvserve.ops import decode_layers, elementwise, gemm, gemm_amx, gemm_bf16dot, prefill_attention, quant
    from kvserve.ops import lora as lora_kernel

    amx = gemm_amx.available()
    if {"amx_tile", "amx_bf16"} <= flags:
        bf16_isa = "AMX"
    elif "avx512_bf16" in flags:
        bf16_isa = "AVX512-BF16"
    else:
        bf16_isa = "no bfloat16 instructions: emulated, slower than float32"
    vec = "AVX-512" if "avx512f" in flags else "AVX2"
    torch_ = "torch (no native kernel)"
    # whether prepack_weight puts the model dtype's dense weights on a native kernel
    dense_native = {
        "float32": gemm.beats_onednn(),
        "bfloat16": amx or gemm.beats_onednn() or gemm_bf16dot.dot_beats_fma(),
    }
    return {
        "linear": {
            "float32": (
                f"kvserve panel GEMM ({vec})"
                if gemm.beats_onednn()
                else "oneDNN via torch (kvserve's panels need AVX-512 to beat it)"
                if gemm.available()
                else "oneDNN via torch"
            ),
            "bfloat16": (
                f"kvserve AMX tiles up to {gemm_amx.MAX_ROWS} rows, oneDNN ({bf16_isa}) above"
                if amx
                else f"kvserve panel GEMM ({vec}, widened to float32), every step size{_dot_note(flags)}"
                if gemm.packs_bfloat16()
                else "kvserve AVX512-BF16 dot-product GEMM, every step size, one copy of the weights"
                f"{_dot_note(flags)}"
                if gemm_bf16dot.dot_beats_fma()
                else f"kvserve panel GEMM up to {gemm.BF16_DOT_MAX_ROWS} rows, oneDNN ({bf16_isa}) above"
                if gemm.beats_onednn()
                else f"oneDNN ({bf16_isa}) via torch"
            ),
        },
        "linear, gguf quantized": {
            d: _quant_gemm_path(flags) if quant.available() else "torch: dequantized on every call (slow)"
            for d in ("float32", "bfloat16")
        },
        "decode attention": {
            "float32": f"kvserve paged kernel ({vec})" if paged_attention.available() else torch_,
            "bfloat16": (
                f"kvserve paged kernel ({'vdpbf16ps' if 'avx512_bf16' in flags else vec + ', widened'})"
                if paged_attention.available()
                else torch_
            ),
        },
        "decode attention, int8/fp8 KV cache": {
            d: f"kvserve paged kernel ({vec}, codes and scales read in place)"
            if paged_attention.available()
            else "torch: gathered rows dequantized, then SDPA"
            for d in ("float32", "bfloat16")
        },
        "prefill attention": {
            "float32": f"kvserve flash kernel ({vec})" if prefill_attention.available() else torch_,
            "bfloat16": (
                ("kvserve flash kernel (AMX tiles)" if amx else f"kvserve flash kernel ({vec})")
                if prefill_attention.available()
                else torch_
            ),
        },
        "rms_norm, silu_and_mul, rope + KV write": {
            d: f"kvserve fused kernels ({vec})" if elementwise.available() else torch_
            for d in ("float32", "bfloat16")
        },
        "decoder layers of a pure-decode step": {
            d: (
                _fused_decode_text(d, dense_native[d])
                if decode_layers.available()
                else f"per-layer kvserve calls ({decode_layers.failure_reason()})"
            )
            if elementwise.available() and paged_attention.available()
            else "the module path (no native ops or decode attention)"
            for d in ("float32", "bfloat16")
        },
        "greedy sampling": {
            "float32 logits": "kvserve kernel" if elementwise.available() else "torch argmax + log_softmax",
        },
        "LoRA deltas": {
            d: (_lora_native_text(vec) if lora_kernel.available() else "torch (float32 on CPU)")
            for d in ("float32", "bfloat16")
        },
        "structured-output token masks": {
            "float32 logits": (
                "kvserve kernel (greedy fused)"
                if bitmask_kernel.available()
                else "torch bit expansion + masked_fill"
            ),
        },
    }


def _fused_decode_text(dtype: str, dense_native: bool) -> str:
    """What runs the decoder layers of a pure-decode step on ``dtype`` weights (the one-call
    step needs every GEMM native: dense weights on oneDNN keep the module path)."""
    fused = (
        f"one kvserve call for all layers ({_fused_decode_lora_text()}; per-layer calls under "
        "tensor parallelism)"
    )
    if dense_native:
        return fused
    return f"GGUF-quantized weights: {fused}; dense {dtype} weights: the module path (oneDNN's GEMM)"


def _fused_decode_lora_text() -> str:
    """Whether a pure-decode step with LoRA adapters stays in the one native call."""
    from kvserve.model_executor.models import cpu_decode_step
    from kvserve.ops import lora as lora_kernel

    if cpu_decode_step.FUSE_LORA and lora_kernel.available():
        return "LoRA deltas included"
    return "per-layer calls with LoRA"


def _dot_note(flags: set[str]) -> str:
    """The CPU's bfloat16 dot-product speed, which picks the panels or the dot-product GEMM,
    where it has one."""
    from kvserve.ops import gemm_bf16dot

    if "avx512_bf16" not in flags:
        return ""
    return (
        f" (this CPU's VDPBF16PS: {gemm_bf16dot.dot_speed():.2f}x the multiply-adds per second of "
        f"its float32 FMAs; above {gemm_bf16dot.DOT_FAST}x the dot-product GEMM runs every step)"
    )


def _lora_native_text(vec: str) -> str:
    import sys

    from kvserve.model_executor.layers.lora import NATIVE_MAX_ROWS

    if NATIVE_MAX_ROWS >= sys.maxsize:
        return f"kvserve kernel ({vec}), every step size"
    return f"kvserve kernel ({vec}) up to {NATIVE_MAX_ROWS} rows, torch above (float32)"


def _threads() -> dict:
    from kvserve.worker.worker import _cpu_count, choose_threads

    choice = choose_threads(_cpu_count())
    return {"cores_usable": _cpu_count(), "chosen": choice.num_threads, "why": choice.reason}


#: SmolLM2-135M-Instruct (the default model): layers, KV heads, head_dim.
DEFAULT_KV_SHAPE = (30, 3, 64)


def kv_tokens_per_gib(model_dir: str | None = None, block_size: int = 16) -> dict:
    """KV-cache tokens one GiB holds per cache dtype (float32 and bfloat16: ``auto`` for that
    model dtype), for ``model_dir``'s config.json shape or ``DEFAULT_KV_SHAPE``.

    Raises:
        ValueError: config.json unreadable or without the attention fields.
    """
    import torch

    from kvserve.worker.cache_engine import bytes_per_block

    layers, kv_heads, head_dim = DEFAULT_KV_SHAPE
    if model_dir is not None:
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
            layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--model: cannot read the attention shape from {path}: {e}") from e
    tokens = {}
    for name, dtype, kv in (
        ("float32", torch.float32, "auto"),
        ("bfloat16", torch.bfloat16, "auto"),
        ("int8", torch.bfloat16, "int8"),
        ("fp8_e4m3", torch.bfloat16, "fp8_e4m3"),
        ("fp8_e5m2", torch.bfloat16, "fp8_e5m2"),
    ):
        tokens[name] = (
            2**30 // bytes_per_block(layers, block_size, kv_heads, head_dim, dtype, kv) * block_size
        )
    return {
        "model": model_dir or "SmolLM2-135M-Instruct",
        "shape": [layers, kv_heads, head_dim],
        "tokens": tokens,
    }


def gather(model_dir: str | None = None) -> dict:
    """Everything ``kvserve doctor`` reports, as a JSON-serialisable dict (``model_dir``: the
    model whose KV-cache shape ``kv_cache`` counts tokens for)."""
    from kvserve.ops import gemm_amx

    flags = cpu_flags()
    native_off = not envs.KVSERVE_NATIVE
    return {
        "cpu": cpu_model(),
        "python": sys.version.split()[0],
        "cpu_features": {f: f in flags for f in CPU_FEATURES},
        "native_disabled": native_off,
        "compiler": _compiler(),
        "libraries": _libraries(),
        "amx_granted": gemm_amx.available(),
        "paths": _paths(flags),
        "threads": _threads(),
        "environment": envs.describe(),
        "kv_cache": kv_tokens_per_gib(model_dir),
    }


def _print(r: dict) -> None:
    print(f"CPU: {r['cpu']} (Python {r['python']})")
    for f, ok in r["cpu_features"].items():
        print(f"  {'yes' if ok else 'no ':3}  {f:12} {CPU_FEATURES[f]}")
    print(f"  AMX tiles granted to this process: {'yes' if r['amx_granted'] else 'no'}")
    c = r["compiler"]
    print(
        f"\nC compiler: {c['cc']} -> {c['path'] or 'NOT FOUND'}"
        + (f" ({c['version']})" if c["version"] else "")
    )
    print(f"  flags: {c['cflags']}" + (f" + {c['extra_cflags']}" if c["extra_cflags"] else ""))
    if r["native_disabled"]:
        print("  KVSERVE_NATIVE=0: native kernels disabled, torch everywhere")
    print("\nKernel libraries:")
    for lib in r["libraries"]:
        state = f"loaded  {lib['path']}" if lib["loaded"] else f"UNAVAILABLE: {lib['failure']}"
        print(f"  {lib['name']:22} {lib['source']:34} {state}")
    print("\nUsed on this host:")
    for op, by_dtype in r["paths"].items():
        for dtype, impl in by_dtype.items():
            print(f"  {op:40} {dtype:15} {impl}")
    t = r["threads"]
    print(f"\nThreads: {t['chosen']} of {t['cores_usable']} usable cores: {t['why']}")
    kv = r["kv_cache"]
    layers, kv_heads, head_dim = kv["shape"]
    print(
        f"\nKV-cache tokens per GiB (--kv-cache-dtype; {kv['model']}: {layers} layers, {kv_heads} KV heads, "
        f"head_dim {head_dim}):"
    )
    for name, n in kv["tokens"].items():
        print(f"  {name:10} {n:>9,}  ({n / kv['tokens']['bfloat16']:.2f}x bfloat16)")
    print("\nEnvironment (kvserve.envs):")
    for v in r["environment"]:
        shown = f"{v['value']!r}" + ("" if v["set"] else " (unset)")
        print(f"  {v['name']:28} {shown:22} {v['meaning']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve doctor", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--model", default=None, help="a model directory: count KV tokens for its shape")
    ns = p.parse_args(argv)
    try:
        r = gather(ns.model)
    except ValueError as e:
        print(f"kvserve doctor: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
