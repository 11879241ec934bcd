"""``kvserve bench moe``: the grouped MoE layer against a per-expert loop, in one run.

For each shape (hidden H, expert intermediate I, E experts, top-k) and row count (64: a decode
batch; 512 to 2048: prefill chunks) it times, on the same random weights and routing:

- ``per_expert_loop``: ``fused_moe.per_expert_loop``, the straightforward form (per expert: a token mask,
  its rows indexed, its MLP, an ``index_add_``);
- ``grouped``: ``fused_moe.grouped_experts`` with ``mode="auto"`` (what the model runs: on CPU
  the native call, the stacks k-major as ``FusedMoE`` keeps them), and each fixed mode
  (``native``, ``grouped_mm``, ``bmm``, ``loop``) for the record.

Each time is the median of ``--repeats`` calls after ``--warmup`` calls (CUDA: synchronised);
outputs are checked equal (to float tolerance) before timing. The table's ``speedup`` is
per-expert loop / auto; ``--target`` (2.0) is the pass line. ``--json-out`` writes every cell.

``--end-to-end`` runs whole tiny checkpoints instead (``moe_end_to_end``): a tiny Mixtral and
a tiny Qwen3-MoE on the workload's first ``--num-prompts`` prompts, every MoE layer on the
per-expert torch loop then on the grouped path, greedy outputs compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.model_executor.layers import fused_moe
from kvserve.ops import moe as native_moe
from kvserve.workload.io import write_json

#: ``(name, hidden, intermediate, experts, top_k)``: tiny-Mixtral and Qwen3-MoE-like layers.
SHAPES = [
    ("mixtral-like", 1024, 1408, 8, 2),
    ("qwen3-moe-like", 1024, 512, 64, 8),
]
ROWS = [64, 512, 2048]


def _time(fn, repeats: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_cell(
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    rows: int,
    dtype: torch.dtype,
    device: str,
    repeats: int,
    warmup: int,
    modes: list[str],
) -> dict:
    """Times of the loop and each grouped mode (seconds) for one shape and row count."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(device, dtype)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    gate = torch.randn(experts, hidden, generator=g).to(device, dtype)
    weights, ids = fused_moe.route(x @ gate.T, top_k, renormalize=True, weight_dtype=dtype)
    cuda = torch.device(device).type == "cuda"
    with torch.inference_mode():
        ref = fused_moe.per_expert_loop(x, weights, ids, w13, w2)
        out: dict = {
            "rows": rows,
            "active_experts": int(torch.unique(ids).numel()),
            "per_expert_loop_s": _time(
                lambda: fused_moe.per_expert_loop(x, weights, ids, w13, w2), repeats, warmup, cuda
            ),
        }
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        # the native call reads the stacks in the layout FusedMoE keeps them in for it
        w13k, w2k = native_moe.k_major(w13), native_moe.k_major(w2)
        for mode in modes:
            a, b = (w13k, w2k) if mode in ("auto", "native") else (w13, w2)
            try:
                got = fused_moe.grouped_experts(x, weights, ids, a, b, mode)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # mode not on this device/dtype
                out[f"{mode}_error"] = str(e).splitlines()[0][:120]
                continue
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
            if err > tol:
                raise AssertionError(f"grouped mode {mode!r} differs from the loop: relative {err:.2e}")
            out[f"{mode}_s"] = _time(
                lambda m=mode, a=a, b=b: fused_moe.grouped_experts(x, weights, ids, a, b, m),
                repeats,
                warmup,
                cuda,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvserve bench moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        help="NAME:H:I:E:K (repeatable); default: " + ", ".join(":".join(map(str, s)) for s in SHAPES),
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--target", type=float, default=2.0, help="pass line for loop / grouped (auto)")
    p.add_argument("--json-out", default=None)
    e2e = p.add_argument_group("end to end (--end-to-end)")
    e2e.add_argument(
        "--end-to-end", action="store_true", help="tiny Mixtral and Qwen3-MoE checkpoints, whole"
    )
    e2e.add_argument("--workload", default=None, help="workload JSONL (default: w64)")
    e2e.add_argument("--num-prompts", type=int, default=64)
    e2e.add_argument("--max-tokens", type=int, default=32, help="cap on each request's output tokens")
    e2e.add_argument(
        "--rounds", type=int, default=2, help="timed rounds per implementation (after a warm-up)"
    )
    e2e.add_argument("--family", action="append", default=None, help="one of the tiny families (repeatable)")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
        # the engines of --end-to-end set their own thread count from the environment
        os.environ["KVSERVE_NUM_THREADS"] = str(ns.threads)
    if ns.end_to_end:
        return _main_end_to_end(ns, p)
    shapes = SHAPES
    if ns.shape:
        shapes = []
        for s in ns.shape:
            parts = s.split(":")
            if len(parts) != 5:
                p.error(f"--shape {s!r}: expected NAME:H:I:E:K")
            h, i, e, k = map(int, parts[1:])
            shapes.append((parts[0], h, i, e, k))
    rows_list = [int(r) for r in ns.rows.split(",") if r]
    dtype = getattr(torch, ns.dtype)
    modes = ["auto", "native", "grouped_mm", "bmm", "loop"]
    cells = []
    table = []
    for name, h, i, e, k in shapes:
        for rows in rows_list:
            c = run_cell(h, i, e, k, rows, dtype, ns.device, ns.repeats, ns.warmup, modes)
            c.update(shape=name, hidden=h, intermediate=i, experts=e, top_k=k)
            c["speedup"] = c["per_expert_loop_s"] / c["auto_s"]
            cells.append(c)

            def ms(key, c=c):
                return f"{c[key] * 1e3:.2f}" if key in c else "n/a"

            table.append(
                [name, f"{e}x{k}", rows, c["active_experts"], ms("per_expert_loop_s"), ms("auto_s")]
                + [ms(f"{m}_s") for m in modes[1:]]
                + [f"{c['speedup']:.2f}x"]
            )
    headers = ["shape", "E x k", "rows", "active", "per-expert loop ms", "grouped ms"]
    headers += [f"mode {m} ms" for m in modes[1:]] + ["speedup"]
    print(f"device={ns.device} dtype={ns.dtype} threads={torch.get_num_threads()}")
    print(fmt_table(headers, table))
    fields = {"device": ns.device, "dtype": ns.dtype, "threads": torch.get_num_threads()}
    return _verdict(ns, "speedup", min(c["speedup"] for c in cells), {**fields, "cells": cells})


def _main_end_to_end(ns, p: argparse.ArgumentParser) -> int:
    from kvserve.benchmarks import moe_end_to_end as e2e
    from kvserve.benchmarks.shape_checkpoints import default_tokenizer_dir
    from kvserve.workload.workload import default_workload_path, load_workload

    if ns.device != "cpu":
        p.error("--end-to-end runs on CPU only")
    families = ns.family or list(e2e.FAMILIES)
    for f in families:
        if f not in e2e.FAMILIES:
            p.error(f"--family {f!r}: choose from {', '.join(e2e.FAMILIES)}")
    requests = load_workload(ns.workload or default_workload_path(), ns.num_prompts)
    tok_dir = default_tokenizer_dir()
    results = {}
    table = []
    for f in families:
        r = e2e.run_family(f, requests, ns.dtype, ns.max_tokens, ns.rounds, tok_dir)
        best = {impl: min(r[impl], key=lambda run: run["moe_s"]) for impl in e2e.IMPLS}
        r["moe_speedup"] = best["per_expert"]["moe_s"] / best["auto"]["moe_s"]
        r["wall_speedup"] = min(x["wall_s"] for x in r["per_expert"]) / min(x["wall_s"] for x in r["auto"])
        results[f] = r
        fields = e2e.FAMILIES[f][1]
        ek = f"{fields.get('num_local_experts', fields.get('num_experts'))}x{fields['num_experts_per_tok']}"
        for impl in e2e.IMPLS:
            runs = r[impl]
            wall = min(x["wall_s"] for x in runs)
            table.append(
                [
                    f,
                    ek,
                    impl,
                    f"{wall:.2f}",
                    f"{runs[0]['output_tokens'] / wall:.1f}",
                    " / ".join(f"{x['moe_s']:.3f}" for x in runs),
                    f"{r['moe_speedup']:.2f}x" if impl == "auto" else "",
                    f"{r['wall_speedup']:.2f}x" if impl == "auto" else "",
                    f"{r['equal_sequences']}/{r['sequences']}" if impl == "auto" else "",
                ]
            )
    headers = ["model", "E x k", "MoE impl", "wall s (best)", "output tok/s", "MoE layers s (rounds)"]
    headers += ["MoE speedup", "wall speedup", "greedy sequences equal"]
    print(
        f"end to end: dtype={ns.dtype} threads={torch.get_num_threads()} prompts={len(requests)} "
        f"max_tokens={ns.max_tokens} rounds={ns.rounds}"
    )
    print(fmt_table(headers, table))
    worst = min(r["moe_speedup"] for r in results.values())
    payload = {
        "dtype": ns.dtype,
        "threads": torch.get_num_threads(),
        "num_prompts": len(requests),
        "max_tokens": ns.max_tokens,
        "families": results,
    }
    return _verdict(ns, "MoE-layer speedup", worst, payload)


def _verdict(ns, what: str, worst: float, fields: dict) -> int:
    """Print the lowest ``what`` against ``--target``, write ``fields`` (with the target and the
    system) to ``--json-out``; the exit status: 0 when the target is met."""
    ok = worst >= ns.target
    print(f"lowest {what} {worst:.2f}x; target {ns.target:.1f}x: {'PASS' if ok else 'FAIL'}")
    if ns.json_out:
        write_json(ns.json_out, {**fields, "target": ns.target, "system": system_info()})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
