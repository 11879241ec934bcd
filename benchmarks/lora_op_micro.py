#!/usr/bin/env python
"""The batched LoRA op (``kvserve.model_executor.layers.lora.add_lora``) alone at the default model's shapes:
bfloat16 activations with the slots in bfloat16 (computing in bfloat16) vs in float32 (the CPU
path, ``lora_compute_dtype``), and float32 for reference.

    python benchmarks/lora_op_micro.py [--threads 1] [--reps 30]

One decoder layer's four targets (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down
1536 -> 576), rank 16, 4 slots; decode shapes (rows round-robin over the slots, or half of
them base rows) and prefill shapes (512 rows of one adapter, a 2,048-row chunk over 4). Prints
the best of ``--rounds`` x ``--reps`` per shape, the variants alternating. With ``--threads 1``
the time is the thread's CPU time (steadier on a shared machine), else wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from kvserve.model_executor.layers.lora import LoRAMapping, add_lora

S, R = 4, 16
TARGETS = {"qkv": (576, 3, 960), "o": (576, 1, 576), "gate_up": (576, 2, 3072), "down": (1536, 1, 576)}
SHAPES = [(16, "decode"), (64, "decode"), (64, "decode-half-base"), (512, "prefill-1"), (2048, "prefill-4")]


def _slots(T: int, mode: str) -> np.ndarray:
    if mode == "decode":
        return np.arange(T) % S
    if mode == "decode-half-base":
        return np.where(np.arange(T) % 2 == 0, np.arange(T) % S, -1)
    if mode == "prefill-1":
        return np.zeros(T, dtype=np.int64)
    return np.repeat(np.arange(S), T // S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--reps", type=int, default=30, help="calls per round at decode shapes (prefill: reps // 6)"
    )
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args(argv)
    clock = time.perf_counter
    if ns.threads:
        torch.set_num_threads(ns.threads)
        if ns.threads == 1:
            clock = time.thread_time
    g = torch.Generator().manual_seed(0)
    variants = {  # name -> (activation dtype, slot dtype)
        "bf16 slots bf16": (torch.bfloat16, torch.bfloat16),
        "bf16 slots f32": (torch.bfloat16, torch.float32),
        "f32": (torch.float32, torch.float32),
    }
    stacks = {
        dt: {
            k: (torch.randn(S, i, p_ * R, generator=g) * 0.05, torch.randn(S, p_ * R, o, generator=g) * 0.05)
            for k, (i, p_, o) in TARGETS.items()
        }
        for dt in (torch.float32, torch.bfloat16)
    }
    stacks = {dt: {k: (a.to(dt), b.to(dt)) for k, (a, b) in st.items()} for dt, st in stacks.items()}
    print(f"threads {torch.get_num_threads()}, ms per layer (4 targets), best of {ns.rounds} rounds")
    print(f"{'rows':>5} {'shape':17s}" + "".join(f"{v:>17s}" for v in variants))
    for T, mode in SHAPES:
        m = LoRAMapping.build(_slots(T, mode))
        reps = ns.reps if T <= 64 else max(1, ns.reps // 6)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(ns.rounds):
            for name, (xdt, sdt) in variants.items():
                xs = {k: torch.randn(T, i, generator=g).to(xdt) for k, (i, _, _) in TARGETS.items()}
                outs = {k: torch.randn(T, o, generator=g).to(xdt) for k, (_, _, o) in TARGETS.items()}
                for k in TARGETS:  # warm-up
                    add_lora(outs[k], xs[k], *stacks[sdt][k], m)
                for _ in range(reps):
                    t = clock()
                    for k in TARGETS:
                        add_lora(outs[k], xs[k], *stacks[sdt][k], m)
                    best[name] = min(best[name], clock() - t)
        print(f"{T:5d} {mode:17s}" + "".join(f"{1000 * best[v]:17.3f}" for v in variants), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
