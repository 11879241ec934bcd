#!/usr/bin/env python
"""How fast the native LoRA kernel streams a decode step's slot weights, by slot layout.

    python benchmarks/lora_kernel_stream.py [--rows 4,8,16] [--dtypes float32,bfloat16]
        [--slots 4] [--reps 7] [--evict-mb 18]

The default model's shapes (30 layers; the four fused targets qkv / o / gate_up / down), rank 16
on every target, ``--slots`` adapters in ``max_loras = --slots`` slots, rows round-robin over
them. One "step" is the kernel's 120 calls (every target of every layer, as the fused decode
step makes them), wall time with the process's threads (``torch.get_num_threads()``), best of
``--reps`` alternated passes. Between layers a ``--evict-mb`` buffer is read (the base model's
weights a real step streams between the LoRA calls: ~18 MB per layer in float32, 9 in
bfloat16), so the slots come from memory as in a step, not from cache (0: no eviction).

Layouts of ``A`` (``[S, in, P * R]`` as the op sees it): ``strided`` = stored ``[in, S, P * R]``
(every slot side by side, the torch stacked form's view; a slot's rows 4 x apart), ``slot`` =
stored ``[S, in, P * R]`` (each slot's ``A`` one contiguous block). Prints ms per step, the
slot bytes read per step (active slots' ``A`` and ``B``'s diagonal blocks) and their rate, and
for reference the rate of one plain read (``torch.sum``) of a buffer of that size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4,8,16")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--evict-mb", type=float, default=18.0)
    p.add_argument("--layouts", default="strided,slot")
    ns = p.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoConfig

    from kvserve.lora.manager import FUSED_PARTS
    from kvserve.lora.ops import LoRAMapping
    from kvserve.lora.peft import ModelShapes
    from kvserve.model_executor.layers import native_lora
    from kvserve.model_executor.model_loader import resolve_model_dir

    if not native_lora.available():
        print(f"no native LoRA kernel: {native_lora.failure_reason()}")
        return 1
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(None)))
    L, S, R = shapes.num_layers, ns.slots, ns.rank
    targets = {}
    for fused, parts in FUSED_PARTS.items():
        bounds = [0]
        for q in parts:
            bounds.append(bounds[-1] + shapes.in_out[q][1])
        targets[fused] = (shapes.in_out[parts[0]][0], bounds[-1], len(parts), tuple(bounds))
    evict = torch.ones(max(1, int(ns.evict_mb * 2**20 / 4)), dtype=torch.float32) if ns.evict_mb > 0 else None
    print(
        f"{L} layers, rank {R}, {S} slots, {torch.get_num_threads()} threads, evict {ns.evict_mb} MB per layer"
    )
    print("dtype | rows | layout | ms per step | MB read | GB/s | plain read GB/s")
    g = torch.Generator().manual_seed(0)
    for dname in ns.dtypes.split(","):
        dt = getattr(torch, dname)
        esz = torch.empty(0, dtype=dt).element_size()
        stacks: dict[str, list] = {}
        for layout in ns.layouts.split(","):
            per_layer = []
            for _ in range(L):
                st = {}
                for k, (fin, fout, parts, _) in targets.items():
                    w = parts * R
                    if layout == "strided":
                        a = (torch.randn(fin, S, w, generator=g) * 0.05).to(dt).permute(1, 0, 2)
                    else:
                        a = (torch.randn(S, fin, w, generator=g) * 0.05).to(dt)
                    st[k] = (a, (torch.randn(S, w, fout, generator=g) * 0.05).to(dt))
                per_layer.append(st)
            stacks[layout] = per_layer
        for rows in [int(r) for r in ns.rows.split(",")]:
            m = LoRAMapping.build(np.arange(rows) % S)
            active = len(m.segments)
            nbytes = 0
            for fin, _fout, parts, bounds in targets.values():
                nbytes += active * (fin * parts * R + R * bounds[-1]) * esz
            nbytes *= L
            xs = {k: torch.randn(rows, fin, generator=g).to(dt) for k, (fin, _, _, _) in targets.items()}
            outs = {k: torch.zeros(rows, fout, dtype=dt) for k, (_, fout, _, _) in targets.items()}
            best = {}
            for _ in range(ns.reps):
                for layout, per_layer in stacks.items():
                    t = 0.0
                    for st in per_layer:
                        if evict is not None:
                            evict.sum()
                        t0 = time.perf_counter()
                        for k, (a, b) in st.items():
                            native_lora.lora_add(outs[k], xs[k], a, b, targets[k][3], m.rows, m.segs)
                        t += time.perf_counter() - t0
                    best[layout] = min(best.get(layout, float("inf")), t)
            plain = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            tp = float("inf")
            for _ in range(ns.reps):
                t0 = time.perf_counter()
                plain.sum()
                tp = min(tp, time.perf_counter() - t0)
            for layout, t in best.items():
                print(
                    f"{dname} | {rows} | {layout} | {1000 * t:.2f} | {nbytes / 1e6:.1f} | {nbytes / t / 1e9:.1f} | "
                    f"{nbytes / tp / 1e9:.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
