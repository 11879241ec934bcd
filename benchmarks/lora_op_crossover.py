#!/usr/bin/env python
"""The batched LoRA op alone: stacked vs segment form, by rows and active slots.

    KVSERVE_NUM_THREADS=1 python benchmarks/lora_op_crossover.py [--rows 1,8,16,32,64,256,2048]
        [--slots 1,2,4] [--dtypes float32,bfloat16] [--reps 7]

Shapes of the default model's four fused targets (SmolLM-135M-like: hidden 576, q/k/v
576+192+192, MLP 1536), rank 16, ``max_loras=4`` slots laid out as ``LoRAManager`` lays them
out; rows round-robin over the active slots. Per cell: best-of-``--reps`` microseconds of
thread CPU time for one pass over the four targets (what one decoder layer adds), the two
forms measured alternately, and their ratio segment / stacked (> 1: stacked is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,64,256,2048")
    p.add_argument("--slots", default="1,2,4")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rank", type=int, default=16)
    ns = p.parse_args(argv)

    import numpy as np
    import torch

    from kvserve.lora.ops import LoRAMapping, add_lora, lora_compute_dtype

    torch.set_num_threads(int(os.environ.get("KVSERVE_NUM_THREADS", "1")))

    S, R, hid = 4, ns.rank, 576
    targets = {
        "qkv": (hid, 960, 3),
        "o": (hid, hid, 1),
        "gate_up": (hid, 2 * 1536, 2),
        "down": (1536, hid, 1),
    }
    print("dtype    | rows | slots | segment us | stacked us | segment/stacked")
    for dname in ns.dtypes.split(","):
        dt = getattr(torch, dname)
        cdt = lora_compute_dtype(dt, "cpu")
        g = torch.Generator().manual_seed(0)
        stacks = {
            k: (
                (torch.randn(fin, S, parts * R, generator=g) * 0.05).to(cdt).permute(1, 0, 2),
                (torch.randn(S, parts * R, fout, generator=g) * 0.05).to(cdt),
            )
            for k, (fin, fout, parts) in targets.items()
        }
        for rows in [int(r) for r in ns.rows.split(",")]:
            xs = {k: torch.randn(rows, fin, generator=g).to(dt) for k, (fin, _, _) in targets.items()}
            outs = {k: torch.zeros(rows, fout, dtype=dt) for k, (_, fout, _) in targets.items()}
            for k_active in [int(s) for s in ns.slots.split(",")]:
                slots = np.arange(rows) % k_active
                best = {"segment": float("inf"), "stacked": float("inf")}
                for _ in range(ns.reps):
                    for path in ("segment", "stacked"):
                        m = LoRAMapping.build(slots)  # per step, as the runner builds it
                        t = time.thread_time()
                        for k, (a, b) in stacks.items():
                            add_lora(outs[k], xs[k], a, b, m, path=path)
                        best[path] = min(best[path], time.thread_time() - t)
                seg, stk = 1e6 * best["segment"], 1e6 * best["stacked"]
                print(
                    f"{dname:8s} | {rows:4d} | {k_active:5d} | {seg:10.1f} | {stk:10.1f} | {seg / stk:6.2f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
