"""Where a batch-1 decode step's time goes: the decoder layers as one native call against the
per-layer calls (``native_decode``), per format.

Per format (``kvserve bench quantized``'s paths) one engine runs ``--rounds`` greedy requests
of ``--max-tokens`` tokens with the layers fused (``LlamaForCausalLM.fuse_native_decode``) and
as many with the per-layer calls, alternately (the machine is shared: alternating spreads other
load over both). Per decode step it records the wall time of ``native_decode.forward_layers``
(every decoder layer and the final norm: the kernels, plus the Python between them on the
per-layer path) and the step's TPOT; the table gives medians:

- ``layers ms``: ``forward_layers`` per step, wall clock; fused = the kernels (one call);
  ``layers CPU ms``: the same as CPU time of the calling thread (with ``KVSERVE_NUM_THREADS=1``
  all of the step's work, and little disturbed by other load on a shared machine);
- ``python ms`` / ``python CPU ms``: per-layer minus fused (the ctypes calls and Python between
  the kernels, which the fused call removes);
- ``rest ms``: TPOT minus ``layers ms`` (embedding, LM head, sampling, scheduling, outputs);
- ``tok/s`` (1 / TPOT) and its ratio fused / per-layer.

Usage: [KVSERVE_NUM_THREADS=1] python benchmarks/native_decode_split.py
       [--paths "gguf float32,int8 float32"] [--rounds 2] [--max-tokens 64] [--json-out R.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.benchmarks.quantized import PATHS, prompt_token_ids
from kvserve.workload.io import write_json

DEFAULT_PATHS = ("bfloat16", "gguf float32", "gguf bfloat16", "int8 float32", "int4 float32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated subset of {list(PATHS)}"
    )
    ap.add_argument("--rounds", type=int, default=2, help="requests per format and mode")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (ignore_eos)")
    ap.add_argument("--json-out", default=None)
    ns = ap.parse_args(argv)
    names = [p.strip() for p in ns.paths.split(",") if p.strip()]
    bad = [n for n in names if n not in PATHS]
    if bad or not names:
        print(f"Error: --paths: unknown {bad}; choose from {list(PATHS)}", file=sys.stderr)
        return 2
    if ns.rounds < 1 or ns.max_tokens < 2:
        print("Error: --rounds must be >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2

    from kvserve import LLM, SamplingParams
    from kvserve.model_executor.models import llama, native_decode

    real = native_decode.forward_layers
    layer_ns: list[int] = []
    layer_cpu_ns: list[int] = []

    def timed(model, x, *rest):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out = real(model, x, *rest)
        if x.shape[0] == 1:
            layer_cpu_ns.append(time.thread_time_ns() - c0)
            layer_ns.append(time.perf_counter_ns() - t0)
        return out

    native_decode.forward_layers = timed
    rows, doc = [], {"benchmark": "native_decode_split", "system": system_info(), "paths": {}}
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        for name in names:
            llm = LLM(num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=1, **PATHS[name])
            _, ids = prompt_token_ids(llm)
            llm.generate(
                [{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
            )
            res: dict[str, dict[str, list[float]]] = {
                m: {"layers": [], "layers_cpu": [], "tpot": []} for m in ("fused", "per-layer")
            }
            tokens: dict[str, list[int]] = {}
            for r in range(ns.rounds):
                for mode in ("fused", "per-layer") if r % 2 == 0 else ("per-layer", "fused"):
                    llama.LlamaForCausalLM.fuse_native_decode = mode == "fused"
                    layer_ns.clear()
                    layer_cpu_ns.clear()
                    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                    m, n = out.metrics, len(out.outputs[0].token_ids)
                    res[mode]["tpot"].append((m.finished_time - m.first_token_time) / (n - 1) * 1e3)
                    res[mode]["layers"].extend(t / 1e6 for t in layer_ns)
                    res[mode]["layers_cpu"].extend(t / 1e6 for t in layer_cpu_ns)
                    tokens[mode] = list(out.outputs[0].token_ids)
            llama.LlamaForCausalLM.fuse_native_decode = True
            med = {m: {k: statistics.median(v) for k, v in d.items() if v} for m, d in res.items()}
            py = med["per-layer"].get("layers", 0.0) - med["fused"].get("layers", 0.0)
            py_cpu = med["per-layer"].get("layers_cpu", 0.0) - med["fused"].get("layers_cpu", 0.0)
            for mode in ("per-layer", "fused"):
                d = med[mode]
                rows.append(
                    [
                        name,
                        mode,
                        d.get("layers"),
                        d.get("layers_cpu"),
                        py if mode == "per-layer" else 0.0,
                        py_cpu if mode == "per-layer" else 0.0,
                        d["tpot"] - d.get("layers", 0.0),
                        d["tpot"],
                        1e3 / d["tpot"],
                        med["per-layer"]["tpot"] / d["tpot"],
                    ]
                )
            same = tokens["fused"] == tokens["per-layer"]
            doc["paths"][name] = {
                "medians_ms": med,
                "python_ms": py,
                "python_cpu_ms": py_cpu,
                "same_tokens": same,
                "raw_ms": res,
            }
            print(
                f"{name}: fused and per-layer greedy tokens {'equal' if same else 'DIFFER'}", file=sys.stderr
            )
            del llm
    finally:
        native_decode.forward_layers = real
        llama.LlamaForCausalLM.fuse_native_decode = True
    headers = [
        "path",
        "layers",
        "layers ms",
        "layers CPU ms",
        "python ms",
        "python CPU ms",
        "rest ms",
        "TPOT ms",
        "tok/s",
        "x per-layer",
    ]
    print(fmt_table(headers, rows))
    if ns.json_out:
        write_json(ns.json_out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
