"""``kvserve bench embed --online``: embedding requests from many concurrent clients to a server.

``--concurrency`` clients (64 by default) each send ``POST /v1/embeddings`` with one text (a
sentence of 10-60 words from ``kvserve bench embed``'s seeded generator), the next as soon as
the answer is back (a closed loop), until ``--num-requests`` have been sent. Per request: the
latency (send -> whole answer); per run: sentences/s and prompt tokens/s over the run (first
send -> last answer), latency p50/p90/p99 and the maximum, failures. The server is started on
the model (all-MiniLM-L6-v2 by default, ``--model DIR`` otherwise; ``--threads`` sets its
``KVSERVE_NUM_THREADS``) unless ``--url`` names a running one. Prints a table; ``--output``
writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvserve.benchmarks.common import fmt_table, system_info, wait_ready
from kvserve.benchmarks.embed_inputs import default_model_dir, make_texts
from kvserve.workload.stats import percentile


async def run_clients(
    base_url: str,
    texts: list[str],
    concurrency: int,
    model: str | None = None,
    api_key: str | None = None,
) -> dict:
    """Send each of ``texts`` as one ``/v1/embeddings`` request (``model`` in the body when
    set, ``api_key`` as a bearer token when set) from ``concurrency`` closed-loop clients;
    returns the run's figures (``summarize``), ``latencies_ms`` per request in text order
    (None for a failed one) and the first ``errors``.

    A request fails on a non-200 status, a transport error or an answer without one embedding.
    """
    import httpx

    latencies: list[float | None] = [None] * len(texts)
    tokens = [0] * len(texts)
    errors: list[str] = []
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600, headers=headers) as client:

        async def client_loop() -> None:
            nonlocal next_index
            while next_index < len(texts):
                i = next_index
                next_index += 1
                body: dict = {"input": texts[i]}
                if model is not None:
                    body["model"] = model
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/embeddings", json=body)
                    data = r.json() if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                if data is None or len(data.get("data", [])) != 1:
                    errors.append(f"status {r.status_code}: {r.text[:200]}")
                    continue
                latencies[i] = (time.perf_counter() - t0) * 1000.0
                tokens[i] = int(data["usage"]["prompt_tokens"])

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    result = summarize(latencies, tokens, duration)
    result.update(concurrency=concurrency, errors=errors[:5], latencies_ms=latencies)
    return result


def summarize(latencies_ms: list[float | None], tokens: list[int], duration_s: float) -> dict:
    """Counts, sentences/s and tokens/s over ``duration_s``, latency p50/p90/p99/max (ms) of
    the successful requests (``latencies_ms`` None: failed)."""
    ok = [x for x in latencies_ms if x is not None]
    d = max(duration_s, 1e-9)
    return {
        "num_requests": len(latencies_ms),
        "num_ok": len(ok),
        "num_failed": len(latencies_ms) - len(ok),
        "duration_s": duration_s,
        "sentences_per_s": len(ok) / d,
        "prompt_tokens": sum(tokens),
        "prompt_tokens_per_s": sum(tokens) / d,
        "latency_p50_ms": percentile(ok, 50),
        "latency_p90_ms": percentile(ok, 90),
        "latency_p99_ms": percentile(ok, 99),
        "latency_max_ms": max(ok) if ok else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, threads: int | None, server_args: list[str]) -> subprocess.Popen:
    """``kvserve serve`` on ``model_dir`` at ``127.0.0.1:port`` (served as ``bench``)."""
    env = dict(os.environ)
    if threads:
        env["KVSERVE_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "kvserve.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model", str(model_dir), "--served-model-name", "bench"]
    cmd += ["--log-level", "warning", *server_args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvserve bench embed --online", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one on --model)")
    ap.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--served-model-name", default=None, help="the model name sent with --url")
    ap.add_argument("--api-key", default=None, help="bearer token for --url")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64, help="clients, each one request at a time")
    ap.add_argument("--warmup", type=int, default=16, help="requests sent (and not counted) first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="the started server's KVSERVE_NUM_THREADS")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to the started server")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    ns = ap.parse_args(argv)
    for name in ("num_requests", "concurrency"):
        if getattr(ns, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    texts = make_texts(ns.num_requests, ns.seed)
    proc = None
    model_name = ns.served_model_name
    if ns.url:
        base_url = ns.url.rstrip("/")
        model_dir = ns.model
    else:
        model_dir = str(Path(ns.model) if ns.model else default_model_dir())
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        proc = start_server(Path(model_dir), port, ns.threads, ns.server_arg)
        model_name = "bench"
    try:
        if proc is not None:
            wait_ready(base_url, proc, ns.ready_timeout)
        if ns.warmup:
            asyncio.run(
                run_clients(
                    base_url, make_texts(ns.warmup, ns.seed + 1), ns.concurrency, model_name, ns.api_key
                )
            )
        result = asyncio.run(run_clients(base_url, texts, ns.concurrency, model_name, ns.api_key))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    headers = [
        "clients",
        "requests",
        "failed",
        "sentences/s",
        "tokens/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
    ]
    row = [
        result["concurrency"],
        result["num_requests"],
        result["num_failed"],
        result["sentences_per_s"],
        result["prompt_tokens_per_s"],
        result["latency_p50_ms"],
        result["latency_p90_ms"],
        result["latency_p99_ms"],
        result["latency_max_ms"],
    ]
    print(fmt_table(headers, [row]))
    if result["errors"]:
        print("first errors: " + "; ".join(result["errors"]), file=sys.stderr)
    if ns.output:
        out = {"model": model_dir, "url": ns.url, "threads": ns.threads, **result, "system": system_info()}
        Path(ns.output).write_text(json.dumps(out, indent=1))
    return 0 if result["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
