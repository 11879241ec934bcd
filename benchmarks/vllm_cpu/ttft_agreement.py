#!/usr/bin/env python
"""Does vLLM's own ``vllm bench serve`` see the TTFT that kvserve's metrics record?

    .venv/bin/kvserve serve --served-model-name default --port 8002 &
    .venv/bin/python benchmarks/vllm_cpu/ttft_agreement.py --base-url http://127.0.0.1:8002

For each of vLLM's ``openai`` (``/v1/completions``) and ``openai-chat`` (``/v1/chat/completions``)
backends: reads the server's ``kvserve:time_to_first_token_seconds`` histogram (sum and count),
runs ``bench_serve.sh`` (random prompts, all sent at once), reads the histogram again, and prints
the benchmark's mean TTFT beside the mean of the histogram's new observations (the benchmark's one
warm-up request included, so the server counts one more). A client times the first streamed chunk
that carries text; the server times the first token; they agree only when the first chunk
carries the first token. Writes the rows as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def ttft_histogram(base_url: str) -> tuple[float, float]:
    """``(sum seconds, count)`` of the server's TTFT histogram (all label sets added)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    total = {"sum": 0.0, "count": 0.0}
    for kind in total:
        pattern = rf"^kvserve:time_to_first_token_seconds_{kind}(?:\{{[^}}]*\}})? (\S+)$"
        total[kind] = sum(float(v) for v in re.findall(pattern, text, flags=re.M))
    return total["sum"], total["count"]


def one_backend(base_url: str, backend: str, num_prompts: int, input_len: int, output_len: int) -> dict:
    """One ``vllm bench serve`` run with ``backend``; the client's and the server's mean TTFT."""
    s0, c0 = ttft_histogram(base_url)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["bash", str(HERE / "bench_serve.sh"), "--base-url", base_url, "--backend", backend]
        cmd += ["--endpoint", ENDPOINTS[backend], "--num-prompts", str(num_prompts)]
        cmd += ["--random-input-len", str(input_len), "--random-output-len", str(output_len)]
        cmd += ["--save-result", "--result-dir", tmp, "--result-filename", "r.json"]
        subprocess.run(cmd, check=True)
        bench = json.loads((Path(tmp) / "r.json").read_text())
    s1, c1 = ttft_histogram(base_url)
    server_mean_ms = 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else float("nan")
    return {
        "backend": backend,
        "completed": bench.get("completed"),
        "bench_mean_ttft_ms": bench["mean_ttft_ms"],
        "server_mean_ttft_ms": server_mean_ms,
        "server_requests": int(c1 - c0),
        "ratio": bench["mean_ttft_ms"] / server_mean_ms,
        "command": " ".join(cmd),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8002")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [
        one_backend(args.base_url, b, args.num_prompts, args.input_len, args.output_len) for b in ENDPOINTS
    ]
    print("| backend | completed | vllm bench serve mean TTFT ms | kvserve metrics mean TTFT ms | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['completed']} | {r['bench_mean_ttft_ms']:.0f} | "
            f"{r['server_mean_ttft_ms']:.0f} ({r['server_requests']} requests) | {r['ratio']:.3f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
