"""Batch-1 decode cost in CPU seconds, one thread: kvserve's one-call decode step, kvserve's
module path and llama.cpp's ``llama-server`` on the same GGUF and prompt ids, rounds alternating.

Why CPU seconds: on a shared host the wall-clock rate of a one-thread engine is mostly its share
of the cores (``kvserve bench quantized`` measures wall clock); the CPU time a token costs is
much less sensitive to the other load. kvserve's is this process's process time, llama.cpp's
the server's ``utime + stime`` (``/proc/<pid>/stat``). A row's decode cost is
``(t(1 + N tokens) - t(1 token)) / N``, so the prefill and the request overhead cancel out.
The module path is the same engine with ``LlamaForCausalLM.use_native_decode`` off.

    python benchmarks/decode_cpu_time.py --model gemma-3-270m-Q4_K_M.gguf --rounds 5
    python benchmarks/decode_cpu_time.py --model m.gguf --no-peer --json-out cpu.json
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

PROMPT = "The Eiffel Tower is"


def _server_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file (both engines read it)")
    ap.add_argument("--dtype", default="bfloat16", help="kvserve's activation dtype (quantization gguf)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64, help="decode tokens per timed request (N)")
    ap.add_argument("--no-peer", action="store_true", help="kvserve's two paths only")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1:
        ap.error("--rounds and --max-tokens must be >= 1")
    torch.set_num_threads(1)
    os.environ["KVSERVE_NUM_THREADS"] = "1"

    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.llama_cpp import LlamaServer
    from kvserve.model_executor.models import llama

    llm = LLM(model=args.model, quantization="gguf", dtype=args.dtype, max_model_len=512)
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    n = args.max_tokens

    def kvserve_cost(native: bool):
        def run(tokens: int) -> float:
            llama.LlamaForCausalLM.use_native_decode = native
            sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            t = time.process_time()
            llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
            return time.process_time() - t

        return run

    server = None if args.no_peer else LlamaServer(args.model, threads=1).start()
    try:

        def peer_cost(tokens: int) -> float:
            assert server is not None and server.proc is not None
            t = _server_cpu_s(server.proc.pid)
            server.complete(ids, tokens)
            return _server_cpu_s(server.proc.pid) - t

        engines = {"kvserve one-call step": kvserve_cost(True), "kvserve module path": kvserve_cost(False)}
        if server is not None:
            engines["llama.cpp"] = peer_cost
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for run in engines.values():  # warm-up
            run(8)
        for _ in range(args.rounds):
            for name, run in engines.items():
                base = (run(1) + run(1)) / 2
                rates[name].append(n / max(run(1 + n) - base, 1e-9))
    finally:
        llama.LlamaForCausalLM.use_native_decode = True
        if server is not None:
            server.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    ref = med.get("llama.cpp")
    print(f"\n{'engine':<24} {'decode tok/s per CPU second (rounds)':<44} {'median':>7} {'x llama.cpp':>12}")
    for k, v in rates.items():
        x = f"{med[k] / ref:.2f}x" if ref else "-"
        print(f"{k:<24} {' '.join(f'{r:.1f}' for r in v):<44} {med[k]:>7.1f} {x:>12}")
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.1f}")
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": n,
        "rounds": rates,
        "median": med,
        "load": load,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
