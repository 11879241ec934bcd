"""Each GEMV of a batch-1 int8 decode step alone, cold, in GB/s of weights, against the float32 and
bfloat16 GEMV of the same shape and a pure streaming read of the same bytes (issue 20).

Shapes: the default model's (SmolLM2-135M): q/o 576->576, k/v 576->192, gate/up 576->1536, down
1536->576, the LM head 576->49152, and the fused q/k/v 576->960 and gate/up 576->3072 the engine
actually runs. Kernels (1 activation row, float32 activations unless named):
- ``int8 x4``: act8 on the x4 copy (the int8 mode's kernel; ``act16 x4`` for the LM head, two
  int8 planes, as ``compute_logits`` runs it);
- ``int8 gguf``: act8 (LM head: act16) on the GGUF layout (the previous kernel);
  the weights Q8_0, or Q4_1 with ``--qtype q4_1`` (random codes, scales and minima; the default
  model's layer type);
- ``float32``: gemm.c's panels; ``bfloat16``: the engine's 1-row bfloat16 kernel (amx_gemm where
  AMX exists, else gemm.c's bfloat16 panels), bfloat16 activations;
- ``read``: ``quant_stream_read`` over the int8 weights' bytes (the ceiling; with the x4
  kernels' software prefetch distance, and without: the better is the ceiling).
Cold: each kernel cycles over ``--copies`` distinct copies of its weight (30, as a step's 30
layers; fewer where 30 would pass ``--budget-mb``, at least 2), so the weights come from L3 /
memory as in a real step, not from L2. The copies' calls run in a row from Python as raw ctypes
calls (as native_decode makes them); the kernels alternate per round; best and median over
``--rounds``. The ctypes call overhead (a call that reads nothing) is printed, not subtracted.

    python benchmarks/int8_gemv.py                          # 1 and 2 threads, every shape
    python benchmarks/int8_gemv.py --threads 1 --shapes lm_head --json-out g.json
    python benchmarks/int8_gemv.py --prefetch 0,4096,12288,24576   # tune the x4 prefetch
    python benchmarks/int8_gemv.py --qtype q4_1 --threads 2 --shapes qkv_fused,gate_up_fused,down
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
from kvserve.model_executor.layers import quant_gemm as qg

#: name -> (out_features N, in_features K)
SHAPES = {
    "q_o": (576, 576),
    "k_v": (192, 576),
    "qkv_fused": (960, 576),
    "gate_up": (1536, 576),
    "gate_up_fused": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def _copies(nbytes: int, want: int, budget_mb: float) -> int:
    return max(2, min(want, int(budget_mb * 1e6 // max(nbytes, 1))))


def _weight(qtype: str, n: int, k: int):
    """A random ``qtype`` weight ``[n, k]`` (Q8_0 of Gaussian weights; Q4_1 of random codes)."""
    if qtype == "q8_0":
        return qg.quantize_q8_0(torch.randn(n, k) * 0.05)
    from kvserve.model_executor.layers.quant_pack import pack_q4_1

    d = torch.rand(n, k // 32) * 0.01
    return pack_q4_1(torch.randint(0, 16, (n, k), dtype=torch.uint8), d, -7.5 * d)


def _cases(n: int, k: int, copies: int, budget_mb: float, head: bool, qtype: str = "q8_0") -> dict:
    """name -> (call(i, threads): run copy i once, weight bytes per call, copies)."""
    torch.manual_seed(n * 7 + k)
    x32 = torch.randn(1, k)
    x16 = x32.to(torch.bfloat16)
    y32 = torch.empty(1, n)
    y16 = torch.empty(1, n, dtype=torch.bfloat16)
    qbytes = n * qg.row_bytes(qtype, k)
    nq = _copies(qbytes, copies, budget_mb)
    qws = [_weight(qtype, n, k) for _ in range(nq)]
    kind = "act16" if head else "act8"
    cases = {}
    for label, kern in ((f"int8 x4 ({kind})", kind), (f"int8 gguf ({kind})", f"{kind}_gguf")):
        fn = qg.kernel_fn(qws[0], 1, torch.float32, kern)
        ptrs = [qg.kernel_weight(w, 1, kern).data_ptr() for w in qws]
        cases[label] = (  # (qws: the weights stay alive while their raw pointers are called)
            lambda i, t, fn=fn, ptrs=ptrs, qws=qws: fn(
                x32.data_ptr(), ptrs[i], None, y32.data_ptr(), 1, n, k, t
            ),
            qbytes,
            nq,
        )
    reads = [w.x4 for w in qws]
    pf = qg.set_x4_prefetch(12288)
    qg.set_x4_prefetch(pf)
    for label, dist in (("read (hw prefetch)", 0), (f"read (sw prefetch {pf})", pf)):
        cases[label] = (lambda i, t, d=dist: qg.stream_read(reads[i], t, d), qbytes, nq)
    n32 = _copies(n * k * 4, copies, budget_mb)
    p32 = [native_gemm.PanelWeight(torch.randn(n, k) * 0.05) for _ in range(n32)]
    g32 = native_gemm._LIB.fn("gemm_f32")
    cases["float32 (gemm.c)"] = (
        lambda i, t: g32(
            x32.data_ptr(), x32.data_ptr(), p32[i].panels.data_ptr(), None, y32.data_ptr(), 1, n, k, t
        ),
        n * k * 4,
        n32,
    )
    n16 = _copies(n * k * 2, copies, budget_mb)
    if amx_gemm.available():
        a16 = [amx_gemm.AmxWeight((torch.randn(n, k) * 0.05).to(torch.bfloat16)) for _ in range(n16)]
        amx = amx_gemm._LIB.fn("amx_gemm_bf16")
        cases["bfloat16 (amx)"] = (
            lambda i, t: amx(x16.data_ptr(), a16[i].tiles.data_ptr(), None, y16.data_ptr(), 1, n, k, t),
            n * k * 2,
            n16,
        )
    else:
        p16 = [native_gemm.PanelWeight((torch.randn(n, k) * 0.05).to(torch.bfloat16)) for _ in range(n16)]
        xf = torch.empty(1, k)
        g16 = native_gemm._LIB.fn("gemm_bf16")
        cases["bfloat16 (gemm.c)"] = (
            lambda i, t: g16(
                x16.data_ptr(),
                xf.data_ptr(),
                p16[i].panels.data_ptr(),
                None,
                y16.data_ptr(),
                1,
                n,
                k,
                t,
            ),
            n * k * 2,
            n16,
        )
    return cases


def measure(
    shapes, thread_counts, copies: int, rounds: int, budget_mb: float, qtype: str = "q8_0"
) -> list[dict]:
    """One row per shape, threads and kernel (see the module doc)."""
    out = []
    null = qg._LIB.fn("quant_stream_read")
    empty = torch.empty(0, dtype=torch.uint8)
    t = time.perf_counter()
    for _ in range(1000):
        null(empty.data_ptr(), 0, 1, 0)
    overhead_us = (time.perf_counter() - t) * 1e3
    print(f"ctypes call overhead (a 1-thread call reading nothing): {overhead_us:.2f} us", flush=True)
    for name in shapes:  # the weights are made once per shape, for every thread count
        n, k = SHAPES[name]
        cases = _cases(n, k, copies, budget_mb, head=name == "lm_head", qtype=qtype)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {c: [] for c in cases}
            for call, _, nc in cases.values():  # warm-up: every copy once
                for i in range(nc):
                    call(i, threads)
            for _ in range(rounds):
                for c, (call, _, nc) in cases.items():
                    t = time.perf_counter()
                    for i in range(nc):
                        call(i, threads)
                    times[c].append((time.perf_counter() - t) / nc)
            ceiling = max(cases[c][1] / min(times[c]) for c in cases if c.startswith("read"))
            for c, (_, nbytes, nc) in cases.items():
                best, med = min(times[c]), statistics.median(times[c])
                row = {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "threads": threads,
                    "kernel": c,
                    "qtype": qtype,
                    "copies": nc,
                    "weight_bytes": nbytes,
                    "best_us": best * 1e6,
                    "median_us": med * 1e6,
                    "gb_s": nbytes / best / 1e9,
                    "gb_s_median": nbytes / med / 1e9,
                    "x_ceiling": nbytes / best / ceiling,
                    "call_overhead_us": overhead_us,
                }
                out.append(row)
                print(
                    f"{name:<13} {n:>5}x{k:<4} t={threads} {c:<26} x{nc:<2} {best * 1e6:9.1f} us "
                    f"(med {med * 1e6:9.1f}) {row['gb_s']:6.1f} GB/s (med {row['gb_s_median']:5.1f}) "
                    f"{row['x_ceiling']:5.2f}x read",
                    flush=True,
                )
        del cases
    return out


def prefetch_sweep(
    distances, shapes, thread_counts, copies: int, rounds: int, budget_mb: float
) -> list[dict]:
    """The x4 kernel per software prefetch distance (bytes ahead; 0: none)."""
    out = []
    old = qg.set_x4_prefetch(0)
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for name in shapes:
                n, k = SHAPES[name]
                kern = "act16" if name == "lm_head" else "act8"
                nbytes = n * qg.row_bytes("q8_0", k)
                nc = _copies(nbytes, copies, budget_mb)
                qws = [qg.quantize_q8_0(torch.randn(n, k) * 0.05) for _ in range(nc)]
                ptrs = [w.x4.data_ptr() for w in qws]
                fn = qg.kernel_fn(qws[0], 1, torch.float32, kern)
                x, y = torch.randn(1, k), torch.empty(1, n)
                times: dict[int, list[float]] = {d: [] for d in distances}
                for _ in range(rounds + 1):  # the first round warms up
                    for d in distances:
                        qg.set_x4_prefetch(d)
                        t = time.perf_counter()
                        for p in ptrs:
                            fn(x.data_ptr(), p, None, y.data_ptr(), 1, n, k, threads)
                        times[d].append((time.perf_counter() - t) / nc)
                for d in distances:
                    best = min(times[d][1:])
                    out.append(
                        {
                            "shape": name,
                            "threads": threads,
                            "prefetch": d,
                            "best_us": best * 1e6,
                            "gb_s": nbytes / best / 1e9,
                        }
                    )
                    print(
                        f"{name:<13} t={threads} prefetch {d:>6} B: {best * 1e6:9.1f} us "
                        f"{nbytes / best / 1e9:6.1f} GB/s",
                        flush=True,
                    )
    finally:
        qg.set_x4_prefetch(old)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--copies", type=int, default=30, help="distinct weights each kernel cycles over")
    ap.add_argument(
        "--budget-mb", type=float, default=240.0, help="at most this many MB of copies per kernel"
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefetch", help="instead: sweep the x4 prefetch distance (comma-separated bytes)")
    ap.add_argument("--qtype", default="q8_0", choices=list(qg.X4_TYPES), help="weight type (not --prefetch)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if not qg.available() or not native_gemm.available():
        sys.exit("the native kernels are unavailable (no C compiler, or KVSERVE_NATIVE=0)")
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        sys.exit(f"--shapes: unknown {bad}; known: {list(SHAPES)}")
    threads = tuple(int(t) for t in args.threads.split(","))
    if args.prefetch:
        dists = [int(d) for d in args.prefetch.split(",")]
        rows = prefetch_sweep(dists, shapes, threads, args.copies, args.rounds, args.budget_mb)
    else:
        rows = measure(shapes, threads, args.copies, args.rounds, args.budget_mb, args.qtype)
    if args.json_out:
        from kvserve.benchmarks.common import system_info

        with open(args.json_out, "w") as f:
            json.dump({"benchmark": "int8_gemv", "system": system_info(), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
