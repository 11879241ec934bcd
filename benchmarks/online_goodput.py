"""Online goodput at rising request rates: kvserve's server against vLLM CPU's, same run.

    .venv/bin/python benchmarks/online_goodput.py [--dtype float32] [--engines kvserve,vllm]
        [--time-scales 3,2,1.5,1,0.75] [--trace-duration-s 30] [--slo-ttft-ms 2000]
        [--slo-tpot-ms 200] [--out online_goodput.json]

Each engine's own OpenAI server is started on the default model (kvserve: ``kvserve serve``;
vLLM: ``benchmarks/vllm_cpu/serve.sh``, which needs its venv), one at a time, and
``kvserve bench serve`` replays the same window of the shared Azure code trace at each time
scale (a scale of 0.5 doubles the trace's request rate): its arrivals, its prompt and output
lengths (prompts clipped to ``--max-input-len``); or, with ``--rates``, the first
``--num-prompts`` requests of the w64 workload at each Poisson rate. Per run: request rate, the fraction of
requests that met every SLO bound, goodput (good requests per second) and TTFT / TPOT p90.

The two figures the table ends with:

- at the highest rate where vLLM's good fraction is >= 90%, kvserve's goodput over vLLM's;
- the highest rate where kvserve's good fraction is >= 90% over vLLM's (the rate where each
  starts to drop requests out of the SLO).

Prints a table and writes the runs and both figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.workload.io import write_json

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVSERVE_SHARED_DIR", REPO.parent / "shared"))
AZURE = SHARED / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
GOOD = 0.9  # the good fraction a rate must keep to count as served within the SLO


def server_command(engine: str, dtype: str, port: int) -> list[str]:
    """The command line that starts ``engine``'s OpenAI server on the default model."""
    if engine == "kvserve":
        return [sys.executable, "-m", "kvserve", "serve", "--dtype", dtype, "--port", str(port)]
    if engine == "vllm":
        return [
            "bash",
            str(REPO / "benchmarks" / "vllm_cpu" / "serve.sh"),
            "--dtype",
            dtype,
            "--port",
            str(port),
        ]
    raise ValueError(f"--engines: unknown engine {engine!r} (kvserve, vllm)")


def sweep(engine: str, ns: argparse.Namespace, port: int) -> list[dict]:
    """Start ``engine``'s server, replay the trace at every time scale, stop the server.
    Returns ``kvserve bench serve``'s runs (``summary`` and ``request_rate`` each)."""
    log = open(Path(ns.log_dir) / f"server_{engine}.log", "w")
    server = subprocess.Popen(
        server_command(engine, ns.dtype, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            cmd = [
                sys.executable, "-m", "kvserve", "bench", "serve",
                "--base-url", f"http://127.0.0.1:{port}", "--label", engine,
                "--slo-ttft-ms", str(ns.slo_ttft_ms), "--slo-tpot-ms", str(ns.slo_tpot_ms),
                "--wait-for-server-s", "600", "--no-tqdm", "--json-out", str(out),
            ]  # fmt: skip
            if ns.rates:
                cmd += ["--sweep-rates", ns.rates, "--num-prompts", str(ns.num_prompts)]
            else:
                cmd += [
                    "--trace", str(ns.trace), "--trace-start-s", str(ns.trace_start_s),
                    "--trace-duration-s", str(ns.trace_duration_s), "--sweep-time-scales", ns.time_scales,
                    "--max-input-len", str(ns.max_input_len), "--max-output-len", str(ns.max_output_len),
                ]  # fmt: skip
            subprocess.run(cmd, check=False)
            if not out.exists():
                raise RuntimeError(f"{engine}: the load generator wrote nothing (server log: {log.name})")
            return json.loads(out.read_text())["runs"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def highest_good_rate(runs: list[dict]) -> float | None:
    """The highest request rate whose good fraction is >= ``GOOD`` (None: no such rate)."""
    ok = [r["request_rate"] for r in runs if r["summary"]["good_fraction"] >= GOOD]
    return max(ok) if ok else None


def verdict(by_engine: dict[str, list[dict]]) -> dict:
    """The two figures of the module docstring (None where a side kept no rate within the SLO)."""
    k, v = by_engine.get("kvserve"), by_engine.get("vllm")
    if not k or not v:
        return {}
    v_rate, k_rate = highest_good_rate(v), highest_good_rate(k)
    out: dict = {"vllm_highest_good_rate": v_rate, "kvserve_highest_good_rate": k_rate}
    if v_rate is not None:
        kv = {r["request_rate"]: r for r in k}
        vv = {r["request_rate"]: r for r in v}
        at = kv.get(v_rate)
        if at is not None:
            out["goodput_ratio_at_vllm_rate"] = at["summary"]["goodput_req_s"] / max(
                vv[v_rate]["summary"]["goodput_req_s"], 1e-12
            )
        if k_rate is not None:
            out["good_rate_ratio"] = k_rate / v_rate
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--engines", default="kvserve,vllm")
    p.add_argument("--trace", default=str(AZURE))
    p.add_argument("--trace-start-s", type=float, default=0.0)
    p.add_argument("--trace-duration-s", type=float, default=30.0, help="trace seconds replayed per run")
    p.add_argument("--time-scales", default="3,2,1.5,1,0.75", help="slowest (lowest rate) first")
    p.add_argument(
        "--rates", default=None, help="Poisson request rates over the w64 workload instead of the trace"
    )
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate (with --rates)")
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--out", default="online_goodput.json")
    ns = p.parse_args(argv)
    if not ns.rates and not Path(ns.trace).exists():
        p.error(f"--trace: {ns.trace} does not exist (the shared Azure trace; KVSERVE_SHARED_DIR to move it)")
    engines = [e.strip() for e in ns.engines.split(",") if e.strip()]
    for e in engines:
        server_command(e, ns.dtype, ns.port)  # an unknown engine fails before anything starts
    by_engine: dict[str, list[dict]] = {}
    for i, e in enumerate(engines):
        t0 = time.perf_counter()
        by_engine[e] = sweep(e, ns, ns.port + i)
        print(f"[{e}] sweep done in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for e, runs in by_engine.items():
        for r in runs:
            s = r["summary"]
            rows.append(
                [
                    e,
                    r["label"],
                    f"{r['request_rate']:.2f}",
                    f"{s['num_requests']}",
                    f"{100 * s['good_fraction']:.0f}%",
                    f"{s['goodput_req_s']:.2f}",
                    f"{(s['ttft_ms']['p90'] or math.nan) / 1000:.2f}",
                    f"{s['tpot_ms']['p90'] or math.nan:.0f}",
                ]
            )
    hdr = ["engine", "run", "req/s", "requests", "good", "goodput req/s", "TTFT p90 s", "TPOT p90 ms"]
    print(fmt_table(hdr, rows))
    v = verdict(by_engine)
    for key, val in v.items():
        print(f"{key}: {val if val is None else f'{val:.3g}'}")
    slo = {"ttft_ms": ns.slo_ttft_ms, "tpot_ms": ns.slo_tpot_ms, "good_fraction": GOOD}
    write_json(
        ns.out, {"system": system_info(), "args": vars(ns), "slo": slo, "runs": by_engine, "verdict": v}
    )
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
