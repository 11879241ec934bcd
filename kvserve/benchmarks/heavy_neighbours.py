"""``kvserve bench heavy-neighbours``: what requests that are heavy but within every limit do to
the requests beside them, and to the server's memory.

Starts ``kvserve serve`` (the default model unless ``--model``) as a child process, then:

1. **solo**: a neighbour (a short streamed completion) alone, ``--repeats`` times: its TTFT;
2. per heavy scenario, one at a time on the idle server: a *decoding neighbour* starts streaming
   first; the heavy request is sent; ``--delay-s`` later a *new neighbour* is sent. Measured:
   the new neighbour's TTFT (it queues behind whatever prefill the heavy request put in the
   queue first), the decoding neighbour's longest gap between streamed chunks while the heavy
   request runs, the heavy request's own latency and status, and the server's resident memory
   (``/proc/PID/status`` ``VmRSS``, sampled every 0.1 s: the peak growth over the value before
   the scenario, and what is left after it).

Scenarios (sizes from flags): ``plain`` (the ``prompt_logprobs`` prompts without it: the
FCFS baseline of the same prefill), ``prompt_logprobs`` (``--pl-prompts`` x ``--pl-len``-token
prompts with ``prompt_logprobs: 20``), ``echo`` (``--echo-prompts`` prompts, ``echo`` +
``logprobs: 20``), ``beam`` (``use_beam_search`` with ``best_of: --beam-width``,
``max_tokens: --beam-tokens``). Prints a table and writes ``--json-out``.

``--server-root DIR`` runs the server from another checkout (``PYTHONPATH=DIR``: e.g. a git
worktree of an older commit), so that a before/after pair is measured by the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

from kvserve.benchmarks.common import fmt_table, system_info, wait_ready
from kvserve.workload.io import check_output_path, write_json

SCENARIOS = ("plain", "prompt_logprobs", "echo", "beam")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    """``VmRSS`` of process ``pid`` in MiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's RSS every ``period_s`` on a background task; ``peak`` in MiB."""

    def __init__(self, pid: int, period_s: float = 0.1):
        self.pid, self.period_s, self.peak = pid, period_s, 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            v = rss_mib(self.pid)
            if v is not None:
                self.peak = max(self.peak, v)
            await asyncio.sleep(self.period_s)

    def __enter__(self) -> RssSampler:
        self.peak = rss_mib(self.pid) or 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()


async def stream_completion(client, model: str, prompt, max_tokens: int) -> dict:
    """One greedy streamed completion: ``ttft_s``, ``max_gap_s`` between chunks after the
    first, ``e2e_s``, ``status``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, last, max_gap = None, None, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "ttft_s": None, "max_gap_s": None, "e2e_s": None}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            elif last is not None:
                max_gap = max(max_gap, now - last)
            last = now
    return {"status": 200, "ttft_s": ttft, "max_gap_s": max_gap, "e2e_s": time.perf_counter() - t0}


def heavy_body(name: str, ns, rng: random.Random, model: str) -> dict:
    """The heavy request of a scenario (token-id prompts, so the sizes are exact)."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    if name in ("plain", "prompt_logprobs"):
        body = {"prompt": [ids(ns.pl_len) for _ in range(ns.pl_prompts)], "max_tokens": 1}
        if name == "prompt_logprobs":
            body["prompt_logprobs"] = 20
    elif name == "echo":
        prompts = [ids(ns.pl_len) for _ in range(ns.echo_prompts)]
        body = {"prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 1}
    else:
        body = {
            "prompt": ids(ns.beam_prompt_len),
            "use_beam_search": True,
            "best_of": ns.beam_width,
            "n": 1,
            "temperature": 0,
            "ignore_eos": True,
            "max_tokens": ns.beam_tokens,
        }
    return {"model": model, "temperature": 0, **body}


async def run_scenario(client, ns, name: str, pid: int, model: str, neighbour_prompt) -> dict:
    """One heavy scenario on an idle server (see the module doc)."""
    rng = random.Random(1 + SCENARIOS.index(name))
    before = rss_mib(pid)
    with RssSampler(pid) as sampler:
        decoding = asyncio.create_task(stream_completion(client, model, neighbour_prompt, ns.decode_tokens))
        await asyncio.sleep(ns.delay_s)  # the decoding neighbour is streaming
        t0 = time.perf_counter()
        heavy = asyncio.create_task(client.post("/v1/completions", json=heavy_body(name, ns, rng, model)))
        await asyncio.sleep(ns.delay_s)
        newcomer = await stream_completion(client, model, neighbour_prompt, ns.neighbour_tokens)
        r = await heavy
        heavy_s = time.perf_counter() - t0
        dec = await decoding
    await asyncio.sleep(0.5)
    after = rss_mib(pid)
    return {
        "scenario": name,
        "heavy_status": r.status_code,
        "heavy_s": heavy_s,
        "heavy_response_bytes": len(r.content),
        "neighbour_ttft_s": newcomer["ttft_s"],
        "decoding_max_gap_s": dec["max_gap_s"],
        "rss_before_mib": before,
        "rss_peak_growth_mib": None if before is None else sampler.peak - before,
        "rss_after_growth_mib": None if before is None or after is None else after - before,
    }


async def measure(ns, base_url: str, pid: int, model: str) -> dict:
    import httpx

    rng = random.Random(0)
    neighbour_prompt = [rng.randrange(100, 40000) for _ in range(ns.neighbour_len)]
    async with httpx.AsyncClient(base_url=base_url, timeout=ns.timeout_s) as client:
        await stream_completion(client, model, neighbour_prompt, 2)  # warm-up
        solo = [
            await stream_completion(client, model, neighbour_prompt, ns.neighbour_tokens) for _ in range(3)
        ]
        solo_ttft = sorted(s["ttft_s"] for s in solo)[1]
        rows = []
        for name in ns.scenarios:
            row = await run_scenario(client, ns, name, pid, model, neighbour_prompt)
            t = row["neighbour_ttft_s"]
            row["neighbour_ttft_x_solo"] = None if t is None else t / solo_ttft
            rows.append(row)
            print(f"  {name}: {json.dumps(row)}", file=sys.stderr)
    return {"solo_ttft_s": solo_ttft, "scenarios": rows}


def start_server(ns, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    if ns.server_root:
        env["PYTHONPATH"] = os.path.abspath(ns.server_root) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "kvserve.entrypoints.openai.api_server", "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--log-level", "warning"]
    if ns.model:
        cmd += ["--model", ns.model]
    cmd += ns.server_args
    cwd = ns.server_root or None
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvserve bench heavy-neighbours", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model of the server (default: the default model)")
    p.add_argument("--server-root", default=None, help="run the server from this checkout")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated of {SCENARIOS}")
    p.add_argument("--pl-prompts", type=int, default=16)
    p.add_argument("--pl-len", type=int, default=300, help="tokens per prompt (prompt_logprobs, echo)")
    p.add_argument("--echo-prompts", type=int, default=8)
    p.add_argument("--beam-width", type=int, default=10)
    p.add_argument("--beam-tokens", type=int, default=48)
    p.add_argument("--beam-prompt-len", type=int, default=32)
    p.add_argument("--neighbour-len", type=int, default=32)
    p.add_argument("--neighbour-tokens", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64, help="the decoding neighbour's max_tokens")
    p.add_argument("--delay-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json-out", default="heavy_neighbours.json")
    p.add_argument("server_args", nargs="*", help="more `kvserve serve` flags (after --)")
    ns = p.parse_args(argv)
    ns.scenarios = [s for s in ns.scenarios.split(",") if s]
    bad = [s for s in ns.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: unknown {bad}; choose from {SCENARIOS}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        check_output_path("--json-out", ns.json_out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(ns, port)
    try:
        wait_ready(base_url, proc, 600)
        result = asyncio.run(measure(ns, base_url, proc.pid, "bench"))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    solo = result["solo_ttft_s"]
    rows = [
        [
            r["scenario"],
            r["heavy_status"],
            f"{r['heavy_s']:.1f}",
            "-" if r["neighbour_ttft_s"] is None else f"{r['neighbour_ttft_s']:.2f}",
            "-" if r["neighbour_ttft_x_solo"] is None else f"{r['neighbour_ttft_x_solo']:.1f}x",
            "-" if r["decoding_max_gap_s"] is None else f"{r['decoding_max_gap_s']:.2f}",
            "-" if r["rss_peak_growth_mib"] is None else f"{r['rss_peak_growth_mib']:.0f}",
            "-" if r["rss_after_growth_mib"] is None else f"{r['rss_after_growth_mib']:.0f}",
        ]
        for r in result["scenarios"]
    ]
    print(f"neighbour solo TTFT: {solo:.3f} s")
    headers = ["scenario", "status", "heavy s", "nbr TTFT s", "x solo", "decode max gap s"]
    print(fmt_table(headers + ["RSS peak +MiB", "RSS after +MiB"], rows))
    out = {"system": system_info(), "args": {k: v for k, v in vars(ns).items()}, **result}
    write_json(ns.json_out, out)
    print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
