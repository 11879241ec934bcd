#!/usr/bin/env python
"""Offline throughput of vLLM's CPU backend on a kvserve workload (run with the vLLM venv).

    /work/vllm-venv/bin/python benchmarks/vllm_cpu/offline.py [--workload W] [--num-prompts N]
        [--dtype float32|bfloat16] [--model HF_DIR] [--load-format dummy] [--json-out F]

Feeds the workload's ``prompt_token_ids`` to ``vllm.LLM.generate`` with
``SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)``, all at once, and prints
output tokens/s (timed around ``generate`` only, model load excluded, like kvserve's bench).
Re-executes itself under ``env.sh`` (OpenMP binding to all cores, tcmalloc + libiomp5
preloaded) unless that environment is already set. ``--load-format dummy`` gives the model random
weights (only ``config.json`` and the tokenizer are read from ``--model``). Needs nothing from kvserve's venv except, when
``--model`` is not given, kvserve's Python to find the default model directory.

``--batch1-tokens T`` measures batch-1 decode instead: the workload's first prompt, alone,
``--batch1-rounds`` times with ``max_tokens=T`` (each run's prompt made unique by its first
token, so no prefix is cached); decode rate = 1 / TPOT from vLLM's own request stats (its
first and last token timestamps; the engine is built with ``disable_log_stats=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_WORKLOAD = REPO.parent / "shared" / "workloads" / "w64.jsonl"


def reexec_with_env() -> None:
    """Re-run this script under ``source env.sh`` (LD_PRELOAD must be set before the process starts)."""
    if os.environ.get("KVSERVE_VLLM_ENV") == "1":
        return
    venv = os.environ.get("VLLM_VENV") or (sys.prefix if sys.prefix != sys.base_prefix else "/work/vllm-venv")
    env = dict(os.environ, VLLM_VENV=venv)
    os.execvpe(
        "bash",
        [
            "bash",
            "-c",
            'source "$1" && shift && exec "$@"',
            "bash",
            str(HERE / "env.sh"),
            sys.executable,
            str(Path(__file__).resolve()),
            *sys.argv[1:],
        ],
        env,
    )


def default_model_dir() -> str:
    py = os.environ.get("KVSERVE_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    code = "from kvserve.model_executor.model_loader import resolve_model_dir; print(resolve_model_dir(None))"
    out = subprocess.run([py, "-c", code], cwd=str(REPO), check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def rss_with_children_mib():
    """Current RSS of this process plus its children (vLLM runs the engine core in a child)."""
    try:
        import psutil

        me = psutil.Process()
        return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**20
    except Exception:
        return None


def peak_rss_with_children_mib():
    """Peak RSS (``VmHWM``) of this process plus that of each live child, summed: an upper bound
    on their peak together (the engine-core child holds the weights and the KV cache)."""
    try:
        import psutil

        me = psutil.Process()
        total = 0
        for p in [me, *me.children(recursive=True)]:
            with open(f"/proc/{p.pid}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
        return total / 1024
    except Exception:
        return None


def load_workload(path, n=None):
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                o = json.loads(line)
                reqs.append((list(o["prompt_token_ids"]), int(o["output_len"])))
                if n is not None and len(reqs) >= n:
                    break
    return reqs


def batch1(llm, prompt: list[int], ns, load_s: float, model: str) -> int:
    """Batch-1 decode rate of ``prompt`` (see the module docstring); prints it, writes JSON."""
    import statistics

    from vllm import SamplingParams

    tokens = ns.batch1_tokens
    if tokens < 2:
        raise SystemExit(f"--batch1-tokens must be >= 2, got {tokens}")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": [99, *prompt[1:]]}], SamplingParams(max_tokens=4), use_tqdm=False)
    runs = []
    for r in range(ns.batch1_rounds):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": [100 + r, *prompt[1:]]}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m is None or not m.first_token_ts:
            raise SystemExit("vLLM returned no request metrics (disable_log_stats must be False)")
        tpot = (m.last_token_ts - m.first_token_ts) / (n - 1)
        runs.append({"decode_tok_s": 1 / tpot, "wall_s": wall, "tokens": n})
    res = {
        "engine": "vllm-cpu",
        "model_dir": model,
        "dtype": ns.dtype,
        "load_s": load_s,
        "prompt_tokens": len(prompt),
        "batch1_tokens": tokens,
        "batch1": {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs), "runs": runs},
        "peak_rss_with_children_mib": peak_rss_with_children_mib(),
    }
    print(
        f"[vllm offline] batch 1, {len(prompt)}-token prompt: {res['batch1']['decode_tok_s']:.2f} decode tok/s"
    )
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json_out).write_text(json.dumps(res, indent=2))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    p.add_argument("--num-prompts", type=int, default=None, help="first N requests only")
    p.add_argument("--output-len", type=int, default=None, help="override every request's output_len")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--model", default=None, help="HF model dir (default: kvserve's default model)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default=None, help="vLLM load_format, e.g. dummy (random weights)")
    p.add_argument("--batch1-tokens", type=int, default=None, help="batch-1 decode of the first prompt")
    p.add_argument("--batch1-rounds", type=int, default=3)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args()
    reexec_with_env()

    reqs = load_workload(ns.workload, ns.num_prompts)
    if ns.output_len is not None:
        reqs = [(ids, ns.output_len) for ids, _ in reqs]
    model = ns.model or default_model_dir()
    n_in = sum(len(ids) for ids, _ in reqs)
    n_out = sum(o for _, o in reqs)
    print(
        f"[vllm offline] {ns.workload}: {len(reqs)} requests, {n_in} prompt + {n_out} output tokens; "
        f"model {model}; dtype {ns.dtype}",
        flush=True,
    )

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs = dict(model=model, dtype=ns.dtype)
    if ns.max_model_len:
        kwargs["max_model_len"] = ns.max_model_len
    if ns.load_format:
        kwargs["load_format"] = ns.load_format
    if ns.batch1_tokens is not None:
        kwargs["disable_log_stats"] = False  # per-request token timestamps
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    if ns.batch1_tokens is not None:
        return batch1(llm, reqs[0][0], ns, load_s, model)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    secs = time.perf_counter() - t1
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    import vllm

    res = {
        "benchmark": "throughput",
        "engine": "vllm-cpu",
        "vllm_version": getattr(vllm, "__version__", None),
        "workload": ns.workload,
        "num_requests": len(reqs),
        "prompt_tokens": n_in,
        "output_tokens_expected": n_out,
        "output_tokens": produced,
        "dtype": ns.dtype,
        "model_dir": model,
        "load_s": load_s,
        "elapsed_s": secs,
        "requests_per_s": len(reqs) / secs,
        "output_tokens_per_s": produced / secs,
        "total_tokens_per_s": (n_in + produced) / secs,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "rss_with_children_mib": rss_with_children_mib(),
        "peak_rss_with_children_mib": peak_rss_with_children_mib(),
        "load_format": ns.load_format,
        "env": {
            k: os.environ.get(k)
            for k in (
                "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_CPU_KVCACHE_SPACE",
                "LD_PRELOAD",
            )
        },
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "first_output_token_ids": list(outs[0].outputs[0].token_ids[:16]) if outs else [],
    }
    print(
        f"[vllm offline] {produced} output tokens in {secs:.2f} s: {res['output_tokens_per_s']:.1f} output tok/s, "
        f"{res['requests_per_s']:.2f} req/s, {res['total_tokens_per_s']:.1f} total tok/s "
        f"(load {load_s:.1f} s; RSS incl. engine-core child {res['rss_with_children_mib'] or 0:.0f} MiB)"
    )
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.json_out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"[vllm offline] wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
