"""Where a batch-1 decode step's wall time goes, per format: the layers' one native call, the LM
head, the rest of ``ModelRunner.execute`` (embedding, input preparation, sampling) and the rest
of the step (scheduler, outputs, Python around them: TPOT minus ``execute``).

Per format (``kvserve bench quantized``'s paths) one engine runs ``--rounds`` greedy requests of
``--max-tokens`` tokens; the phases are wrapped with ``perf_counter_ns`` (and the calling
thread's CPU time) and their medians per decode step printed, the prefill step left out, with
the layers' weight bytes over their time (GB/s). ``--compare-x4``: each GGUF path also runs
first with ``KVSERVE_QUANT_X4=0`` (its Q4_1 weights on the GGUF-layout int8 kernels), the engines
one after the other in this process.

Usage: python benchmarks/decode_phase_split.py [--paths "bfloat16,gguf float32,int8 float32"]
       [--rounds 2] [--max-tokens 128] [--compare-x4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kvserve.benchmarks.quantized import PATHS, prompt_token_ids, step_weight_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="bfloat16,gguf float32,int8 float32", help=f"subset of {list(PATHS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compare-x4", action="store_true", help="GGUF paths also with KVSERVE_QUANT_X4=0 first")
    ns = ap.parse_args(argv)
    names = [p.strip() for p in ns.paths.split(",") if p.strip()]
    if not names or any(n not in PATHS for n in names) or ns.rounds < 1 or ns.max_tokens < 2:
        print(f"Error: bad --paths / --rounds / --max-tokens (paths: {list(PATHS)})", file=sys.stderr)
        return 2

    from kvserve import LLM, SamplingParams
    from kvserve.model_executor.models import llama, native_decode
    from kvserve.worker import model_runner

    rec: dict[str, list[float]] = {}

    def wrap(obj, name: str, key: str) -> None:
        real = getattr(obj, name)

        def timed(*a, **k):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            out = real(*a, **k)
            rec.setdefault(key, []).append((time.perf_counter_ns() - t0) / 1e6)
            rec.setdefault(key + " CPU", []).append((time.thread_time_ns() - c0) / 1e6)
            return out

        setattr(obj, name, timed)

    wrap(native_decode, "forward_layers", "layers")
    wrap(llama.LlamaForCausalLM, "compute_logits", "head")
    wrap(model_runner.ModelRunner, "execute", "execute")
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    for name in names:
        if ns.compare_x4 and PATHS[name].get("quantization") == "gguf":
            runs.append((f"{name} (KVSERVE_QUANT_X4=0)", name, "0"))
        runs.append((name, name, None))
    for label, name, x4 in runs:
        if x4 is None:
            os.environ.pop("KVSERVE_QUANT_X4", None)
        else:
            os.environ["KVSERVE_QUANT_X4"] = x4
        llm = LLM(num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=1, **PATHS[name])
        model = llm.llm_engine.executor.model
        layer_bytes = step_weight_bytes(model) - step_weight_bytes(model, layers=False)
        _, ids = prompt_token_ids(llm)
        llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
        )
        steps: dict[str, list[float]] = {"TPOT": []}
        for _ in range(ns.rounds):
            rec.clear()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            m, n = out.metrics, len(out.outputs[0].token_ids)
            steps["TPOT"].append((m.finished_time - m.first_token_time) / (n - 1) * 1e3)
            for k, v in rec.items():  # v[0]: the prefill step
                steps.setdefault(k, []).extend(v[1:])
        med = {k: statistics.median(v) for k, v in steps.items() if v}
        other = med.get("execute", 0.0) - med.get("layers", 0.0) - med.get("head", 0.0)
        gbs = layer_bytes / (med["layers"] * 1e6) if med.get("layers") else 0.0
        print(
            f"{label}: {1e3 / med['TPOT']:.1f} tok/s, TPOT {med['TPOT']:.2f} ms = layers {med.get('layers', 0):.2f}"
            f" ({layer_bytes / 1e6:.1f} MB, {gbs:.1f} GB/s)"
            f" + head {med.get('head', 0):.2f} + rest of execute {other:.2f}"
            f" + outside execute {med['TPOT'] - med.get('execute', 0):.2f}",
            flush=True,
        )
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
