"""Batch-1 decode speed of the GGUF-quantized path (``--quantization gguf``) against the float32
and bfloat16 paths on the default model (SmolLM2-135M-Instruct: its shipped Q4_1 GGUF, whose
token embedding / tied LM head is Q8_0).

All engines live in one process and run alternately, one request at a time (the machine is
shared: alternating spreads other load over all of them), ``--rounds`` times each. Per run:
decode rate = 1 / TPOT (TPOT = (finished - first token) / (output tokens - 1)), overall output
tok/s (prefill included), TTFT. The table gives medians, the weight bytes one decode step reads
(linear layers + LM head) and the bandwidth that implies (bytes / TPOT: how close a step is to
the memory-bandwidth roof), plus load time and the resident-memory growth of each load.

    python benchmarks/quantized.py                       # 5 engines x 5 rounds, 128 new tokens
    python benchmarks/quantized.py --rounds 3 --max-tokens 64 --json-out q.json
    python benchmarks/quantized.py --kernels      # the GEMV/GEMM kernels alone: GB/s, GFMA/s

``--kernels`` times each quantized kernel and the float32 panel GEMM on the default model's
largest shapes (gate/up 3072 x 576, the LM head 49152 x 576; the LM head's weights exceed the
caches in every format) at 1, 8 and 64 rows, on 1 and 2 threads, best of 15 calls: the weight
bytes streamed per second say whether a GEMV is at the memory-bandwidth roof (the float32
kernel at 1 row is) or compute-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
    "bottle, and what she decides to do about it.<|im_end|>\n<|im_start|>assistant\n"
)
PATHS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "gguf float32": dict(dtype="float32", quantization="gguf"),
    "gguf bfloat16": dict(dtype="bfloat16", quantization="gguf"),
    "int8 float32": dict(dtype="float32", quantization="int8"),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every linear weight and the LM head."""
    from kvserve.model_executor.layers.quant_gemm import QuantWeight

    def nbytes(w) -> int:
        if isinstance(w, QuantWeight):
            return w.nbytes
        out, inp = w.shape
        return out * inp * w.dtype.itemsize

    total = nbytes(model.lm_head)
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        total += sum(nbytes(w) for w in (a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight))
    return total


def kernels() -> list[dict]:
    """Best-of-15 time of each kernel per shape, rows and threads (see the module doc)."""
    import torch

    from kvserve.model_executor.layers import native_gemm
    from kvserve.model_executor.layers import quant_gemm as qg

    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n, k in ((3072, 576), (49152, 576)):
            w32 = torch.randn(n, k) * 0.05
            weights = {"float32": (native_gemm.PanelWeight(w32), n * k * 4)}
            for qt in qg.BLOCK_BYTES:
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize

                q = quantize(w32.numpy(), GGMLQuantizationType[qt.upper()])
                qw = qg.QuantWeight(torch.from_numpy(q), qt, k)
                weights[qt] = (qw, qw.nbytes)
            for m in (1, 8, 64):
                x = torch.randn(m, k)
                for name, (w, nbytes) in weights.items():
                    f = native_gemm.linear if name == "float32" else qg.linear
                    f(x, w)
                    best = min(_timed(f, x, w) for _ in range(15))
                    row = {
                        "kernel": name,
                        "threads": threads,
                        "n": n,
                        "k": k,
                        "rows": m,
                        "ms": best * 1e3,
                        "weights_gb_s": nbytes / best / 1e9,
                        "gfma_s": m * n * k / best / 1e9,
                    }
                    out.append(row)
                    print(
                        f"{name:<8} threads={threads} {n:>5}x{k} rows={m:<3} {row['ms']:8.3f} ms "
                        f"{row['weights_gb_s']:6.1f} GB/s {row['gfma_s']:6.1f} GFMA/s",
                        flush=True,
                    )
    return out


def _timed(f, x, w) -> float:
    t = time.perf_counter()
    f(x, w)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    ap.add_argument("--json-out")
    ap.add_argument("--kernels", action="store_true", help="time the kernels alone (see the module doc)")
    args = ap.parse_args(argv)
    if args.kernels:
        rows = kernels()
        if args.json_out:
            from kvserve.benchmarks.common import system_info

            with open(args.json_out, "w") as f:
                json.dump(
                    {"benchmark": "quant_gemm_kernels", "system": system_info(), "results": rows}, f, indent=1
                )
        return 0

    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.common import system_info

    names = [p.strip() for p in args.paths.split(",")]
    engines, info = {}, {}
    for name in names:
        rss0, t0 = _rss_mib(), time.perf_counter()
        llm = LLM(num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=1, **PATHS[name])
        model = llm.llm_engine.executor.model
        info[name] = {
            "load_s": time.perf_counter() - t0,
            "rss_growth_mib": _rss_mib() - rss0,
            "step_weight_mb": step_weight_bytes(model) / 1e6,
        }
        engines[name] = llm
        print(f"loaded {name}: {info[name]}", file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for llm in engines.values():  # one warm-up request each
        llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            out = engines[name].generate([PROMPT], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            m, n = out.metrics, len(out.outputs[0].token_ids)
            tpot = (m.finished_time - m.first_token_time) / (n - 1)
            runs[name].append(
                {"decode_tok_s": 1 / tpot, "overall_tok_s": n / wall, "ttft_s": m.ttft, "tokens": n}
            )
    rows = []
    base = None
    for name in names:
        med = {
            k: statistics.median(x[k] for x in runs[name])
            for k in ("decode_tok_s", "overall_tok_s", "ttft_s")
        }
        gbps = info[name]["step_weight_mb"] * med["decode_tok_s"] / 1e3
        base = base or med["decode_tok_s"]
        rows.append({"path": name, **info[name], **med, "weights_gb_s": gbps, "runs": runs[name]})
    bf16 = next((r["decode_tok_s"] for r in rows if r["path"] == "bfloat16"), None)
    print(
        f"\n{'path':<15} {'weights/step':>12} {'decode tok/s':>13} {'x bf16':>7} {'overall tok/s':>14} "
        f"{'TTFT ms':>8} {'GB/s':>6} {'load s':>7} {'RSS +MiB':>9}"
    )
    for r in rows:
        rel = f"{r['decode_tok_s'] / bf16:.2f}" if bf16 else "-"
        print(
            f"{r['path']:<15} {r['step_weight_mb']:>9.0f} MB {r['decode_tok_s']:>13.1f} {rel:>7} "
            f"{r['overall_tok_s']:>14.1f} {r['ttft_s'] * 1e3:>8.0f} {r['weights_gb_s']:>6.1f} "
            f"{r['load_s']:>7.1f} {r['rss_growth_mib']:>9.0f}"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "benchmark": "quantized_batch1",
                    "system": system_info(),
                    "max_tokens": args.max_tokens,
                    "rounds": args.rounds,
                    "prompt": PROMPT,
                    "results": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
