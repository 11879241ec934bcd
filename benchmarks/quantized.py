"""Batch-1 decode speed of the GGUF-quantized path (``--quantization gguf``) and int8 against the
float32 and bfloat16 paths on the default model (SmolLM2-135M-Instruct: its shipped Q4_1 GGUF,
whose token embedding / tied LM head is Q8_0), optionally against llama.cpp's ``llama-server`` on
the same file (``--peer llama.cpp``), and the w64 workload offline per format (``--w64``).

Everything but ``--kernels`` is ``kvserve bench quantized`` (``kvserve/benchmarks/quantized.py``:
what is measured and how); the llama-server binary comes from ``benchmarks/llama_cpp/setup.sh``.

    python benchmarks/quantized.py                       # 5 engines x 5 rounds, 128 new tokens
    python benchmarks/quantized.py --rounds 3 --max-tokens 64 --json-out q.json
    python benchmarks/quantized.py --peer llama.cpp --json-out q.json   # + llama-server, same GGUF
    python benchmarks/quantized.py --w64 --peer llama.cpp --json-out w.json
    python benchmarks/quantized.py --kernels      # the GEMV/GEMM kernels alone: GB/s, GFMA/s

``--kernels`` times each quantized kernel (each of ``quant_gemm.linear``'s kernels forced:
``tile``, ``act8``, ``panel``), the float32 panel GEMM and the bfloat16 linear on the default
model's largest shapes (gate/up 3072 x 576, the LM head 49152 x 576; the LM head's weights
exceed the caches in every format) at 1, 8, 64 and 256 rows (``--kernel-rows``), on 1 and 2
threads (``--kernel-threads``), best of 15 calls taken alternately: the weight
bytes streamed per second say whether a GEMV is at the memory-bandwidth roof (the float32
kernel at 1 row is) or compute-bound.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def kernels(rows=(1, 8, 64, 256), thread_counts=(1, 2), repeats: int = 15) -> list[dict]:
    """Best-of-``repeats`` time of each kernel per shape, rows and threads (see the module doc).

    Kernels: ``float32`` (``gemm.c`` panels), ``bfloat16`` (the bfloat16 linear the engine runs:
    ``native_gemm``'s AMX kernel where AMX exists, else torch), and per quantized type each of
    ``quant_gemm.linear``'s kernels forced (``tile``: float activations, dequantized in
    registers; ``act8``: int8 activations; ``panel``: dequantized float32 panels); the
    kernels are timed alternately, one call each per round.
    """
    import torch
    import torch.nn.functional as F

    from kvserve.model_executor.layers import native_gemm
    from kvserve.model_executor.layers import quant_gemm as qg

    out = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for n, k in ((3072, 576), (49152, 576)):
            w32 = torch.randn(n, k) * 0.05
            w16 = w32.to(torch.bfloat16)
            cases = {
                "float32": (native_gemm.linear, native_gemm.PanelWeight(w32), n * k * 4, torch.float32),
                "bfloat16": (F.linear, w16, n * k * 2, torch.bfloat16),
            }
            for qt in qg.BLOCK_BYTES:
                if k % qg.BLOCK_WEIGHTS[qt]:  # the K-quants need K % 256 == 0
                    continue
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize

                q = quantize(w32.numpy(), GGMLQuantizationType[qt.upper()])
                qw = qg.QuantWeight(torch.from_numpy(q), qt, k)
                for kern in ("tile", "act8", "panel"):
                    if kern == "act8" and qt not in qg.ACT8_TYPES:
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


def _timed(f, x, w) -> float:
    t = time.perf_counter()
    f(x, w)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    from kvserve.benchmarks import quantized as bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_args(ap)
    ap.add_argument("--kernels", action="store_true", help="time the kernels alone (see the module doc)")
    ap.add_argument("--kernel-rows", default="1,8,64,256", help="--kernels: comma-separated row counts")
    ap.add_argument("--kernel-threads", default="1,2", help="--kernels: comma-separated thread counts")
    args = ap.parse_args(argv)
    if args.kernels:
        rows = kernels(
            tuple(int(r) for r in args.kernel_rows.split(",")),
            tuple(int(t) for t in args.kernel_threads.split(",")),
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
