"""Micro benchmark of the CPU linear layers: ours (``native_gemm`` panels, or ``amx_gemm`` tiles
for bfloat16 with ``--kernel amx``) against oneDNN's prepacked matmul, on the four GEMM shapes of each SmolLM2-135M layer (q/k/v 960x576, o 576x576,
gate/up 3072x576, down 576x1536), random weights.

Both run in one process, alternating, so the machine's load affects both alike; the table gives
the minimum and median time of one pass over all layers and the median of the per-pass ratios.
``--layers 120`` (4x the model, 1.7 GB in float32) keeps the weights out of the last-level cache,
as in a real step where the KV cache and activations evict them.

    python benchmarks/gemm_micro.py                          # float32, 1-2,048 rows
    python benchmarks/gemm_micro.py --rows 1 8 59 --layers 120 --json-out gemm.json
    python benchmarks/gemm_micro.py --dtype bfloat16 --kernel amx --rows 1 16 64 128
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

from kvserve.model_executor.layers import amx_gemm, native_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


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
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--kernel",
        choices=["panels", "amx"],
        default="panels",
        help="ours: native_gemm panels (float32/bfloat16) or amx_gemm tiles (bfloat16)",
    )
    ap.add_argument("--reps", type=int, default=6, help="alternating passes per row count")
    ap.add_argument("--json-out", help="write the table as JSON here")
    args = ap.parse_args()
    if args.kernel == "amx" and (args.dtype != "bfloat16" or not amx_gemm.available()):
        sys.exit("--kernel amx needs --dtype bfloat16 and a CPU and kernel with AMX tiles")
    if args.kernel == "panels" and not native_gemm.available():
        sys.exit("native_gemm is unavailable (no C compiler, or KVSERVE_NATIVE=0)")
    pack, run = (
        (amx_gemm.AmxWeight, amx_gemm.linear)
        if args.kernel == "amx"
        else (native_gemm.PanelWeight, native_gemm.linear)
    )
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(args.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in weights]
    ours = [[pack(w) for w in ws] for ws in weights]
    del weights
    flops_per_row = 2 * args.layers * sum(n * k for n, k in SHAPES)
    rows = []
    print(
        f"{'rows':>6} {'oneDNN min/med ms':>18} {args.kernel + ' min/med ms':>18} {args.kernel + ' GFLOP/s':>15} "
        f"{'speedup (median)':>17}"
    )
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
        fns = {
            "onednn": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                for ws in onednn
                for w, (_, k) in zip(ws, SHAPES)
            ],
            "ours": lambda xs=xs: [run(xs[w.in_features], w) for ws in ours for w in ws],
        }
        times = {k: [] for k in fns}
        for f in fns.values():
            f()  # warm-up (oneDNN primitive creation)
        for i in range(args.reps):
            for name in list(fns) if i % 2 == 0 else list(fns)[::-1]:
                t = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t)
        ratio = statistics.median(a / b for a, b in zip(times["onednn"], times["ours"]))
        row = {
            "rows": m,
            "onednn_min_s": min(times["onednn"]),
            "onednn_median_s": statistics.median(times["onednn"]),
            "ours_min_s": min(times["ours"]),
            "ours_median_s": statistics.median(times["ours"]),
            "ours_gflops": flops_per_row * m / min(times["ours"]) / 1e9,
            "speedup_median": ratio,
        }
        rows.append(row)
        print(
            f"{m:>6} {row['onednn_min_s'] * 1e3:>8.1f}/{row['onednn_median_s'] * 1e3:<9.1f} "
            f"{row['ours_min_s'] * 1e3:>8.1f}/{row['ours_median_s'] * 1e3:<9.1f} "
            f"{row['ours_gflops']:>15.1f} {ratio:>16.2f}x",
            flush=True,
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "dtype": args.dtype,
                    "kernel": args.kernel,
                    "layers": args.layers,
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
