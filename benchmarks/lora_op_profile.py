#!/usr/bin/env python
"""Where the batched LoRA op's time goes in one decode step, by target and component.

    KVSERVE_NUM_THREADS=1 python benchmarks/lora_op_profile.py [--rows 8,16,64]
        [--dtypes float32,bfloat16] [--slots 4] [--reps 7]

The default model's shapes (its config: 30 layers, four fused targets qkv / o / gate_up / down),
rank 16, ``max_loras=4`` slots laid out and typed as ``LoRAManager`` lays them out (float32 on
CPU, also for a bfloat16 model), one set of slots per layer (so a pass streams 30 layers'
weights, as a step does; the base weights a real step streams in between are not, so these
weights stay in cache more than in a step), rows round-robin over ``--slots`` adapters.

Per (dtype, rows), microseconds per step (30 layers) of thread CPU time, best of ``--reps``
passes, the variants alternated pass by pass: each torch component of the form ``add_lora``
chooses alone (``cast in``: the rows to float32; ``shrink``: ``x @ A``; ``mask`` / ``gather``:
the stacked form's row mask multiply or the segment form's index_selects; ``expand``:
``@ B`` and the add; ``cast out``: the delta back to the model dtype), the whole torch op,
the glue (whole minus its components: Python, views, argument checks, dispatch), the native
kernel, and the step's metadata (``LoRAMapping.build`` and, for the stacked form, its masks).
"""

# The timing thunks close over loop variables on purpose: each is called within its iteration.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rank", type=int, default=16)
    ns = p.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoConfig

    from kvserve.lora import ops
    from kvserve.lora.manager import FUSED_PARTS
    from kvserve.lora.ops import LoRAMapping, add_lora, lora_compute_dtype, stacked_views
    from kvserve.lora.peft import ModelShapes
    from kvserve.model_executor.layers import native_lora
    from kvserve.model_executor.model_loader import resolve_model_dir

    torch.set_num_threads(int(os.environ.get("KVSERVE_NUM_THREADS", "1")))
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(None)))
    L, S, R = shapes.num_layers, 4, ns.rank
    targets = {}
    for fused, parts in FUSED_PARTS.items():
        fin = shapes.in_out[parts[0]][0]
        bounds = [0]
        for q in parts:
            bounds.append(bounds[-1] + shapes.in_out[q][1])
        targets[fused] = (fin, bounds[-1], len(parts), tuple(bounds))
    have_native = native_lora.available()
    print(
        f"{L} layers, targets {', '.join(f'{k} {v[0]}->{v[1]}' for k, v in targets.items())}, rank {R}, "
        f"{ns.slots} adapters; native kernel: {'yes' if have_native else native_lora.failure_reason()}"
    )
    g = torch.Generator().manual_seed(0)

    for dname in ns.dtypes.split(","):
        dt = getattr(torch, dname)
        cdt = lora_compute_dtype(dt, "cpu")
        stacks = {
            k: [
                (
                    (torch.randn(fin, S, parts * R, generator=g) * 0.05).to(cdt).permute(1, 0, 2),
                    (torch.randn(S, parts * R, fout, generator=g) * 0.05).to(cdt),
                )
                for _ in range(L)
            ]
            for k, (fin, fout, parts, _) in targets.items()
        }
        # the slots a bfloat16 model keeps where the kernel runs (``lora_slot_dtype``)
        stacks16 = (
            {k: [(a.to(dt), b.to(dt)) for a, b in v] for k, v in stacks.items()}
            if have_native and cdt != dt
            else None
        )
        for rows in [int(r) for r in ns.rows.split(",")]:
            row_slots = np.arange(rows) % ns.slots
            m = LoRAMapping.build(row_slots)
            stacked = ops.use_stacked(m)
            xs = {k: torch.randn(rows, fin, generator=g).to(dt) for k, (fin, _, _, _) in targets.items()}
            outs = {k: torch.zeros(rows, fout, dtype=dt) for k, (_, fout, _, _) in targets.items()}

            def components(k, a, b, x, out):
                """The torch form's pieces for one linear: name -> thunk (as _add_lora_* run them)."""
                R_ = a.shape[2]
                if stacked:
                    a_cat, b_cat = stacked_views(a, b)
                    w = m.num_stacked_slots * R_
                    aw, bw = a_cat[:, :w], b_cat[:w]
                    xc = x.to(cdt)
                    h = torch.mm(xc, aw)
                    mask = m.row_mask(R_, cdt)
                    d = torch.mm(h, bw)
                    parts = {"shrink": lambda: torch.mm(xc, aw), "mask/gather": lambda: h.mul(mask)}
                    if cdt == dt:
                        parts["expand"] = lambda: out.addmm_(h, bw)
                    else:
                        parts["cast in"] = lambda: x.to(cdt)
                        parts["expand"] = lambda: torch.mm(h, bw)
                        parts["cast out"] = lambda: out.add_(d.to(dt))
                    return parts
                xg = x.index_select(0, m.rows).to(cdt)
                n = xg.shape[0]
                mid = torch.empty(n, R_, dtype=cdt)
                delta = torch.zeros(n + 1, b.shape[2], dtype=cdt)

                def shrink():
                    for s, lo, hi in m.segments:
                        torch.mm(xg[lo:hi], a[s], out=mid[lo:hi])

                def expand():
                    for s, lo, hi in m.segments:
                        torch.mm(mid[lo:hi], b[s], out=delta[lo:hi])

                parts = {
                    "shrink": shrink,
                    "expand": expand,
                    "mask/gather": lambda: (
                        (x.index_select(0, m.rows), out.add_(delta.index_select(0, m.inverse)))
                        if cdt == dt
                        else (x.index_select(0, m.rows), delta.to(dt).index_select(0, m.inverse))
                    ),
                }
                if cdt != dt:
                    parts["cast in"] = lambda: x.index_select(0, m.rows).to(cdt)
                    parts["cast out"] = lambda: delta.to(dt)
                return parts

            comp = {k: [components(k, a, b, xs[k], outs[k]) for a, b in stacks[k]] for k in targets}
            names = sorted({n for k in comp for n in comp[k][0]})
            best: dict = {}

            def timed(key, fn):
                t = time.thread_time()
                fn()
                best[key] = min(best.get(key, float("inf")), time.thread_time() - t)

            for _ in range(ns.reps):
                for k in targets:
                    bounds = targets[k][3]
                    for name in names:
                        if name in comp[k][0]:
                            timed((k, name), lambda: [c[name]() for c in comp[k]])
                    timed(
                        (k, "torch op"),
                        lambda: [
                            add_lora(outs[k], xs[k], a, b, m, path="stacked" if stacked else "segment")
                            for a, b in stacks[k]
                        ],
                    )
                    if have_native:
                        timed(
                            (k, "native"),
                            lambda: [
                                add_lora(outs[k], xs[k], a, b, m, path="native", parts=bounds)
                                for a, b in stacks[k]
                            ],
                        )
                    if stacks16 is not None:
                        timed(
                            (k, "native16"),
                            lambda: [
                                add_lora(outs[k], xs[k], a, b, m, path="native", parts=bounds)
                                for a, b in stacks16[k]
                            ],
                        )

                def metadata():
                    mm = LoRAMapping.build(row_slots)
                    if stacked:
                        for _, _, parts, _ in targets.values():
                            mm.row_mask(parts * R, cdt)

                timed(("step", "metadata"), metadata)

            us = lambda key: 1e6 * best.get(key, float("nan"))  # noqa: E731
            cols = [n for n in ("cast in", "shrink", "mask/gather", "expand", "cast out") if n in names]
            print(
                f"\n{dname}, {rows} rows, {ns.slots} adapters, torch form: {'stacked' if stacked else 'segment'}"
                f"  (us per step = {L} layers; metadata once per step: {us(('step', 'metadata')):.0f} us)"
            )
            shown = [*cols, "glue", "torch op", "native"] + (["native16"] if stacks16 is not None else [])
            print(
                "target | "
                + " | ".join(c if c != "native16" else "native, bf16 slots" for c in shown)
                + " | torch/native"
            )
            tot = dict.fromkeys(shown, 0.0)
            for k in targets:
                vals = {c: us((k, c)) for c in shown}
                vals["glue"] = vals["torch op"] - sum(vals[c] for c in cols)
                for c in tot:
                    tot[c] += vals[c]
                fast = min(vals["native"], vals.get("native16", float("inf")))
                print(
                    f"{k} | "
                    + " | ".join(f"{vals[c]:.0f}" for c in shown)
                    + f" | {vals['torch op'] / fast:.2f}x"
                )
            fast = min(tot["native"], tot.get("native16", float("inf")))
            print(
                "all | " + " | ".join(f"{tot[c]:.0f}" for c in shown) + f" | {tot['torch op'] / fast:.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
