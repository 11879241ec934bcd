"""Micro benchmark of the CPU linear layers: ours (``gemm`` panels; for bfloat16 also
``gemm_amx`` tiles with ``--kernel amx`` and ``gemm_bf16dot``'s AVX512-BF16 dot product with
``--kernel bf16dot``) against oneDNN's prepacked matmul, on the four GEMM shapes of each
SmolLM2-135M layer (q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536), or with
``--model llama-3.2-1b`` of each Llama-3.2-1B layer (3072x2048, 2048x2048, 16384x2048,
2048x8192: 122 MB per layer in bfloat16, past any last-level cache), random weights.

All run in one process, alternating (the order rotates each pass), so the machine's load affects
them alike; the table gives the minimum and median time of one pass over all layers per kernel,
and each kernel's median of the per-pass ratios to oneDNN. ``--kernel`` takes several kernels
(``--kernel bf16dot panels``: both against oneDNN; the JSON's ``ours_*`` fields are the first).
``--layers 120`` (4x the model, 1.7 GB in float32) keeps the weights out of the last-level cache,
as in a real step where the KV cache and activations evict them.

    python benchmarks/gemm_micro.py                          # float32, 1-2,048 rows
    python benchmarks/gemm_micro.py --rows 1 8 59 --layers 120 --json-out gemm.json
    python benchmarks/gemm_micro.py --dtype bfloat16 --kernel amx --rows 1 16 64 128
    python benchmarks/gemm_micro.py --dtype bfloat16 --kernel bf16dot panels --rows 16 64 256
    python benchmarks/gemm_micro.py --model llama-3.2-1b --layers 2 --dtype bfloat16 --kernel bf16dot panels
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

from kvserve.ops import gemm, gemm_amx, gemm_bf16dot

#: --model name -> the (out, in) GEMM shapes of one layer: fused q/k/v, o, fused gate/up, down.
MODELS = {
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
#: --kernel name -> (pack, run, available, bfloat16 only)
KERNELS = {
    "panels": (gemm.PanelWeight, gemm.linear, gemm.available, False),
    "amx": (gemm_amx.AmxWeight, gemm_amx.linear, gemm_amx.available, True),
    "bf16dot": (gemm_bf16dot.DotWeight, gemm_bf16dot.linear, gemm_bf16dot.available, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 32, 59, 128, 512, 2048],
        help="GEMM row counts (tokens in the step)",
    )
    ap.add_argument("--layers", type=int, default=30, help="layers of weights (SmolLM2-135M has 30)")
    ap.add_argument("--model", choices=list(MODELS), default="smollm2-135m", help="the layer's GEMM shapes")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--kernel",
        nargs="+",
        choices=list(KERNELS),
        default=["panels"],
        help="ours: gemm panels (float32/bfloat16), gemm_amx tiles or the gemm_bf16dot "
        "dot product (bfloat16); several: each against oneDNN",
    )
    ap.add_argument("--reps", type=int, default=6, help="alternating passes per row count")
    ap.add_argument("--json-out", help="write the table as JSON here")
    args = ap.parse_args()
    kernels = list(dict.fromkeys(args.kernel))
    for name in kernels:
        avail, need_bf16 = KERNELS[name][2:]
        if need_bf16 and args.dtype != "bfloat16":
            sys.exit(f"--kernel {name} needs --dtype bfloat16")
        if not avail():
            sys.exit(f"--kernel {name}: unavailable on this CPU/build (see kvserve doctor)")
    dtype = getattr(torch, args.dtype)
    SHAPES = MODELS[args.model]
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(args.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in weights]
    packed = {name: [[KERNELS[name][0](w) for w in ws] for ws in weights] for name in kernels}
    del weights
    flops_per_row = 2 * args.layers * sum(n * k for n, k in SHAPES)
    rows = []
    head = f"{'rows':>6} {'oneDNN min/med ms':>18}"
    for name in kernels:
        head += f" {name + ' min/med ms':>20} {name + ' GFLOP/s':>16} {'vs oneDNN':>9}"
    print(head)
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
        fns = {
            "onednn": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                for ws in onednn
                for w, (_, k) in zip(ws, SHAPES)
            ]
        }
        for name in kernels:
            run = KERNELS[name][1]
            fns[name] = lambda xs=xs, run=run, ws_=packed[name]: [
                run(xs[w.in_features], w) for ws in ws_ for w in ws
            ]
        times = {k: [] for k in fns}
        for f in fns.values():
            f()  # warm-up (oneDNN primitive creation)
        order = list(fns)
        for i in range(args.reps):
            for name in order[i % len(order) :] + order[: i % len(order)]:
                t = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t)
        row = {
            "rows": m,
            "onednn_min_s": min(times["onednn"]),
            "onednn_median_s": statistics.median(times["onednn"]),
        }
        line = f"{m:>6} {row['onednn_min_s'] * 1e3:>8.1f}/{row['onednn_median_s'] * 1e3:<9.1f}"
        for j, name in enumerate(kernels):
            ratio = statistics.median(a / b for a, b in zip(times["onednn"], times[name]))
            stats = {
                "min_s": min(times[name]),
                "median_s": statistics.median(times[name]),
                "gflops": flops_per_row * m / min(times[name]) / 1e9,
                "speedup_median": ratio,
            }
            row.update({f"{name}_{k}": v for k, v in stats.items()})
            if j == 0:
                row.update({f"ours_{k}" if k != "speedup_median" else k: v for k, v in stats.items()})
            line += (
                f" {stats['min_s'] * 1e3:>10.1f}/{stats['median_s'] * 1e3:<9.1f}"
                f" {stats['gflops']:>16.1f} {ratio:>8.2f}x"
            )
        rows.append(row)
        print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "dtype": args.dtype,
                    "kernel": kernels[0],
                    "kernels": kernels,
                    "layers": args.layers,
                    "model": args.model,
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
