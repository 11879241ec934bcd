"""Batch-1 decode speed of the GGUF-quantized path (``--quantization gguf``) and int8 against the
float32 and bfloat16 paths on the default model (SmolLM2-135M-Instruct: its shipped Q4_1 GGUF,
whose token embedding / tied LM head is Q8_0), optionally against llama.cpp's ``llama-server`` on
the same file (``--peer llama.cpp``), and the w64 workload offline per format (``--w64``).

Everything but ``--kernels`` and ``--layer-kernels`` is ``kvserve bench quantized`` (``kvserve/benchmarks/quantized.py``:
what is measured and how); the llama-server binary comes from ``benchmarks/llama_cpp/setup.sh``.

    python benchmarks/quantized.py                       # 5 engines x 5 rounds, 128 new tokens
    python benchmarks/quantized.py --rounds 3 --max-tokens 64 --json-out q.json
    python benchmarks/quantized.py --peer llama.cpp --json-out q.json   # + llama-server, same GGUF
    python benchmarks/quantized.py --w64 --peer llama.cpp --json-out w.json
    python benchmarks/quantized.py --kernels      # the GEMV/GEMM kernels alone: GB/s, GFMA/s
    python benchmarks/quantized.py --kernels --kernel-shapes 640x2048,640x1024 --kernel-types q4_k,q6_k \
        --kernel-rows 1 --kernel-threads 1    # Gemma 3 270M's down / o shapes, its K-quants
    python benchmarks/quantized.py --layer-kernels --json-out l.json   # 30 layers' GEMMs per step

``--kernels`` times each quantized kernel (each of ``quant.linear``'s kernels forced:
``tile``, ``act8``, ``panel``, ``amx`` where AMX exists, ``vnni`` where AVX-512 VNNI does), the float32 panel GEMM and the bfloat16 linear on the default
model's largest shapes (gate/up 3072 x 576, the LM head 49152 x 576; the LM head's weights
exceed the caches in every format; other shapes: ``--kernel-shapes``, other types:
``--kernel-types``; the K-quants, which the gguf package cannot quantize to, as random blocks
with float16 scales ~0.01: their speed does not depend on the values) at 1, 8, 64 and 256 rows
(``--kernel-rows``), on 1 and 2 threads (``--kernel-threads``), best of 15 calls taken
alternately: the weight
bytes streamed per second say whether a GEMV is at the memory-bandwidth roof (the float32
kernel at 1 row is) or compute-bound.

``--layer-kernels`` times one pass over the GEMMs of all 30 SmolLM2-135M layers (q/k/v 960 x
576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536; each layer its own random weights, so a
pass streams them from memory as a decode step does) at 4-64 rows (``--kernel-rows``, default
4,8,12,16,24,32,64), on all threads: bfloat16 as a bfloat16 model runs it (``linear.linear`` on
``linear.prepack_weight``'s form: AMX tiles, bfloat16 panels or oneDNN, whichever this CPU takes)
against the Q4_1 (x4 layout, as the int8 mode keeps it) and Q8_0 weights on each of their
kernels (``amx``: dequantized into bfloat16 AMX tiles, where AMX exists; ``vnni``: int8 panels
and vpdpbusd, where AVX-512 VNNI exists; ``act8``: the int8 GEMV; ``panel``: float32 panels),
best of ``--kernel-reps`` passes taken alternately, bfloat16 activations: where the many-row
kernels take over from the int8 GEMV (``quant.AMX_ROWS``, ``VNNI_ROWS``) and how they
compare with bfloat16.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def _random_kquant(qt: str, n: int, k: int):
    """``[n, k / 256 * block_bytes]`` uint8 random ``qt`` K-quant blocks: random codes and
    sub-scales, float16 super-scales (and minima) ~0.01."""
    import numpy as np
    import torch

    from kvserve.ops import quant as qg

    rng = np.random.default_rng(0)
    nb, bb = k // 256, qg.BLOCK_BYTES[qt]
    data = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    d = (np.abs(rng.standard_normal((n, nb, 2))) * 0.01).astype(np.float16).view(np.uint8).reshape(n, nb, 4)
    if qt == "q6_k":
        data[..., 208:210] = d[..., 0:2]
    else:
        data[..., 0:4] = d
    return torch.from_numpy(data.reshape(n, -1))


def kernels(
    rows=(1, 8, 64, 256),
    thread_counts=(1, 2),
    repeats: int = 15,
    shapes=((3072, 576), (49152, 576)),
    types: tuple[str, ...] | None = None,
) -> list[dict]:
    """Best-of-``repeats`` time of each kernel per shape (``shapes``: (out, in) pairs), rows and
    threads (see the module doc); ``types``: the quantized types (None: every one).

    Kernels: ``float32`` (``gemm.c`` panels), ``bfloat16`` (the bfloat16 linear the engine runs:
    ``gemm_amx``'s AMX kernel where AMX exists, else torch), and per quantized type each of
    ``quant.linear``'s kernels forced (``tile``: float activations, dequantized in
    registers; ``act8``: int8 activations; ``panel``: dequantized float32 panels); the
    kernels are timed alternately, one call each per round.
    """
    import torch
    import torch.nn.functional as F

    from kvserve.ops import gemm
    from kvserve.ops import quant as qg

    out = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n, k in shapes:
            w32 = torch.randn(n, k) * 0.05
            w16 = w32.to(torch.bfloat16)
            cases = {
                "float32": (gemm.linear, gemm.PanelWeight(w32), n * k * 4, torch.float32),
                "bfloat16": (F.linear, w16, n * k * 2, torch.bfloat16),
            }
            for qt in types or tuple(qg.BLOCK_BYTES):
                if k % qg.BLOCK_WEIGHTS[qt]:  # the K-quants need K % 256 == 0
                    continue
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize

                if qt.endswith("_k"):
                    qw = qg.QuantWeight(_random_kquant(qt, n, k), qt, k)
                else:
                    q = quantize(w32.numpy(), GGMLQuantizationType[qt.upper()])
                    qw = qg.QuantWeight(torch.from_numpy(q), qt, k)
                for kern in ("tile", "act8", "panel", "amx", "vnni"):
                    if (
                        (kern == "act8" and qt not in qg.ACT8_TYPES)
                        or (kern == "amx" and not qg.amx_supported())
                        or (kern == "vnni" and (qt not in qg.VNNI_TYPES or qg.act8_isa() != "avx512-vnni"))
                    ):
                        continue
                    cases[f"{qt} {kern}"] = (
                        functools.partial(qg.linear, kernel=kern),
                        qw,
                        qw.nbytes,
                        torch.float32,
                    )
            for m in rows:
                xs = {dt: torch.randn(m, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
                best = {name: float("inf") for name in cases}
                for f, w, _, dt in cases.values():
                    f(xs[dt], w)
                for _ in range(repeats):
                    for name, (f, w, _, dt) in cases.items():
                        best[name] = min(best[name], _timed(f, xs[dt], w))
                for name, (_, _, nbytes, _) in cases.items():
                    t = best[name]
                    row = {
                        "kernel": name,
                        "threads": threads,
                        "n": n,
                        "k": k,
                        "rows": m,
                        "ms": t * 1e3,
                        "weights_gb_s": nbytes / t / 1e9,
                        "gfma_s": m * n * k / t / 1e9,
                    }
                    out.append(row)
                    print(
                        f"{name:<11} threads={threads} {n:>5}x{k} rows={m:<3} {row['ms']:8.3f} ms "
                        f"{row['weights_gb_s']:6.1f} GB/s {row['gfma_s']:6.1f} GFMA/s",
                        flush=True,
                    )
    return out


#: The GEMM shapes (out, in) of one SmolLM2-135M layer.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def layer_kernels(rows=(4, 8, 12, 16, 24, 32, 64), layers: int = 30, repeats: int = 5) -> list[dict]:
    """Best-of-``repeats`` time of one pass over ``layers`` layers' GEMMs per kernel and row
    count (see the module doc); rows ``{"kernel", "rows", "ms", "x_bf16"}``."""
    import torch

    from kvserve.model_executor.layers.linear import linear, prepack_weight
    from kvserve.ops import quant as qg

    if not qg.available():
        raise SystemExit("--layer-kernels needs the quantized kernels")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(0)
    weights = []  # per layer and shape: (bf16 AMX weight, Q4_1 x4-only, Q8_0)
    for _ in range(layers):
        for n, k in LAYER_SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.05).numpy()
            q41 = qg.QuantWeight(torch.from_numpy(quantize(w, GGMLQuantizationType.Q4_1)), "q4_1", k)
            q41.drop_gguf()
            q8 = qg.QuantWeight(torch.from_numpy(quantize(w, GGMLQuantizationType.Q8_0)), "q8_0", k)
            q8.x4  # noqa: B018 (its int8 GEMV's copy, made before timing)
            weights.append((prepack_weight(torch.from_numpy(w).to(torch.bfloat16)), q41, q8))
    kernels = ["act8", "panel"]
    kernels += ["amx"] if qg.amx_supported() else []
    kernels += ["vnni"] if qg.act8_isa() == "avx512-vnni" else []
    kinds = {"bfloat16": None}
    for qt in ("q4_1", "q8_0"):
        for kern in kernels:
            kinds[f"{qt} {kern}"] = (1 if qt == "q4_1" else 2, kern)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in {k for _, k in LAYER_SHAPES}}

        def run(kind, xs=xs) -> float:
            t = time.perf_counter()
            for ws in weights:
                x = xs[ws[1].in_features]
                if kind is None:
                    linear(x, ws[0])
                else:
                    qg.linear(x, ws[kind[0]], kernel=kind[1])
            return time.perf_counter() - t

        best = {name: float("inf") for name in kinds}
        for kind in kinds.values():
            run(kind)
        for _ in range(repeats):
            for name, kind in kinds.items():
                best[name] = min(best[name], run(kind))
        for name, t in best.items():
            out.append({"kernel": name, "rows": m, "ms": t * 1e3, "x_bf16": best["bfloat16"] / t})
        print(
            f"rows={m:<3} "
            + "  ".join(f"{n} {best[n] * 1e3:6.2f} ms ({best['bfloat16'] / best[n]:.2f}x)" for n in kinds),
            flush=True,
        )
    return out


def _timed(f, x, w) -> float:
    t = time.perf_counter()
    f(x, w)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    from kvserve.benchmarks import quantized as bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_args(ap)
    ap.add_argument("--kernels", action="store_true", help="time the kernels alone (see the module doc)")
    ap.add_argument(
        "--kernel-rows",
        default=None,
        help="--kernels / --layer-kernels: comma-separated row counts (defaults: 1,8,64,256 / 4,8,12,16,24,32,64)",
    )
    ap.add_argument("--kernel-threads", default="1,2", help="--kernels: comma-separated thread counts")
    ap.add_argument(
        "--kernel-shapes",
        default="3072x576,49152x576",
        help="--kernels: comma-separated OUTxIN weight shapes (default: the default model's gate/up and LM head)",
    )
    ap.add_argument(
        "--kernel-types", default=None, help="--kernels: comma-separated quantized types (default: all)"
    )
    ap.add_argument("--layer-kernels", action="store_true", help="30 layers' GEMMs per kernel (module doc)")
    ap.add_argument("--kernel-reps", type=int, default=5, help="--layer-kernels: passes per kernel")
    args = ap.parse_args(argv)
    if args.layer_kernels:
        rows = layer_kernels(
            tuple(int(r) for r in (args.kernel_rows or "4,8,12,16,24,32,64").split(",")),
            repeats=args.kernel_reps,
        )
        if args.json_out:
            from kvserve.benchmarks.common import system_info

            with open(args.json_out, "w") as f:
                json.dump(
                    {"benchmark": "quant_layer_kernels", "system": system_info(), "results": rows},
                    f,
                    indent=1,
                )
        return 0
    if args.kernels:
        rows = kernels(
            tuple(int(r) for r in (args.kernel_rows or "1,8,64,256").split(",")),
            tuple(int(t) for t in args.kernel_threads.split(",")),
            shapes=tuple(tuple(int(v) for v in s.split("x")) for s in args.kernel_shapes.split(",")),
            types=tuple(args.kernel_types.split(",")) if args.kernel_types else None,
        )
        if args.json_out:
            from kvserve.benchmarks.common import system_info

            with open(args.json_out, "w") as f:
                json.dump(
                    {"benchmark": "quant_gemm_kernels", "system": system_info(), "results": rows}, f, indent=1
                )
        return 0
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
