"""``kvserve bench serve``: an online load generator for any OpenAI-compatible server.

Streams ``POST /v1/completions`` requests (``prompt`` as token ids, falling back to text when the
server refuses ids; ``max_tokens = output_len``, ``ignore_eos: true``, greedy, ``stream: true``,
``stream_options.include_usage``) at scheduled arrival times and measures per request:

* **TTFT**: send -> first streamed token chunk; **ITL**: gaps between later chunks;
* **TPOT**: (e2e - TTFT) / (output tokens - 1); **E2E**: send -> last chunk;

and per run: request / output / total token throughput over the run (first send -> last
completion), mean/p50/p90/p99 of each latency, and **goodput** (requests and their output tokens per
second that met every ``--slo-*`` bound).

Arrivals: ``--request-rate R`` with ``--burstiness B`` (gamma gaps, B=1 is Poisson, ``inf`` = all
at once), or ``--trace FILE`` (its arrival times times ``--time-scale``; its input/output lengths,
clipped to the context: see ``kvserve.workload.workload``), optionally for each rate of
``--sweep-rates`` / each scale of ``--sweep-time-scales``. While a run lasts, ``GET /metrics`` is
scraped for the queue and KV-cache gauges (``kvserve:*`` or ``vllm:*``) to draw a timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import TYPE_CHECKING

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.workload.io import write_json
from kvserve.workload.stats import SLO, RequestResult, summarize_results
from kvserve.workload.workload import (
    BenchRequest,
    generate_arrivals,
    load_corpus,
    load_trace,
    select_trace,
    trace_to_requests,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GAUGES = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "swapped": ("num_requests_swapped",),
    "gpu_cache_usage": ("gpu_cache_usage_perc", "kv_cache_usage_perc"),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sums of the queue / KV-cache gauges in a Prometheus text exposition, keyed as in ``GAUGES``
    (any ``prefix:`` such as ``kvserve:`` or ``vllm:``; label sets summed; usage as 0..1). A
    server that exports the same gauge under several prefixes (kvserve: both ``kvserve:`` and
    ``vllm:``) is counted once: the first prefix seen wins."""
    by_prefix: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        prefix, _, base = name.rpartition(":")
        for key, names in GAUGES.items():
            if base in names:
                try:
                    v = float(value)
                except ValueError:
                    continue
                out = by_prefix.setdefault(prefix, {})
                if key == "gpu_cache_usage":
                    out[key] = max(out.get(key, 0.0), v / 100.0 if v > 1.0 else v)
                else:
                    out[key] = out.get(key, 0.0) + v
    return next(iter(by_prefix.values()), {})


class LoadGenerator:
    def __init__(
        self,
        base_url: str,
        model: str | None,
        prompt_mode: str = "auto",
        timeout_s: float = 3600,
        max_concurrency: int | None = None,
        tokenizer_dir: str | None = None,
        metrics_interval_s: float = 0.5,
        use_tqdm: bool = True,
        extra_body: dict | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.prompt_mode = prompt_mode  # auto | ids | text
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.tokenizer_dir = tokenizer_dir
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.metrics_interval_s = metrics_interval_s
        self.metrics_available: bool | None = None
        self.use_tqdm = use_tqdm
        self.extra_body = extra_body or {}

    # ------------------------------------------------------------ helpers
    def _text_of(self, req: BenchRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from kvserve.model_executor.model_loader import resolve_model_dir

            self._tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(self.tokenizer_dir)))
        tokenizer = self._tokenizer
        assert tokenizer is not None
        req.prompt = str(tokenizer.decode(req.prompt_token_ids))
        return req.prompt

    def _body(self, req: BenchRequest, mode: str, max_tokens: int | None = None) -> dict:
        body = {
            "model": self.model,
            "prompt": req.prompt_token_ids if mode == "ids" else self._text_of(req),
            "max_tokens": max_tokens or req.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(self.extra_body)
        return body

    async def server_info(self, client) -> dict:
        """``{"model", "max_model_len"}`` from ``GET /v1/models`` (None where absent)."""
        try:
            r = await client.get(f"{self.base_url}/v1/models", timeout=30)
            r.raise_for_status()
            data = r.json().get("data") or []
        except Exception as e:
            print(f"warning: GET /v1/models failed: {e}", file=sys.stderr)
            return {"model": None, "max_model_len": None}
        first = data[0] if data else {}
        return {"model": first.get("id"), "max_model_len": first.get("max_model_len")}

    async def wait_ready(self, client, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = await client.get(f"{self.base_url}/v1/models", timeout=5)
                if r.status_code == 200:
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {self.base_url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ one request
    async def _post(
        self, client, req: BenchRequest, res: RequestResult, mode: str, max_tokens: int | None = None
    ) -> int | None:
        """Streams one request into ``res``; returns the HTTP status on an HTTP error, else None."""
        url = f"{self.base_url}/v1/completions"
        t0 = time.perf_counter()
        res.send_time = time.time()
        last = None
        chunks = 0
        usage_tokens = None
        try:
            async with client.stream("POST", url, json=self._body(req, mode, max_tokens)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return resp.status_code
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        res.error = f"stream error: {obj['error']}"
                        return None
                    now = time.perf_counter()
                    if obj.get("usage") and obj["usage"].get("completion_tokens") is not None:
                        usage_tokens = int(obj["usage"]["completion_tokens"])
                    choices = obj.get("choices") or []
                    if not choices:
                        continue
                    c = choices[0]
                    text = c.get("text") or ""
                    if not text and c.get("finish_reason") is not None:
                        continue  # a closing chunk that carries no token
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
            res.e2e = (last if last is not None else time.perf_counter()) - t0
            res.output_tokens = usage_tokens if usage_tokens is not None else chunks
            res.success = res.ttft is not None
            if not res.success:
                res.error = "no tokens streamed"
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        return None

    async def _one(self, client, req: BenchRequest, sem, bar) -> RequestResult:
        res = RequestResult(
            request_id=req.id,
            prompt_len=req.prompt_len,
            expected_output_len=req.output_len,
            scheduled_arrival=req.arrival_s,
        )
        async with sem:
            mode = self.prompt_mode if self.prompt_mode != "auto" else "ids"
            status = await self._post(client, req, res, mode)
            if status in (400, 422) and self.prompt_mode == "auto":
                # The server refused token ids: switch every later request to text.
                self.prompt_mode = "text"
                res.error = ""
                await self._post(client, req, res, "text")
            elif self.prompt_mode == "auto" and res.success:
                self.prompt_mode = "ids"
        if bar is not None:
            bar.update(1)
        return res

    async def _scrape(self, client, t0: float, timeline: dict, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                r = await client.get(f"{self.base_url}/metrics", timeout=5)
                if r.status_code == 200:
                    g = parse_prometheus(r.text)
                    if g:
                        self.metrics_available = True
                        timeline["time_s"].append(time.perf_counter() - t0)
                        for k in GAUGES:
                            timeline[k].append(g.get(k, 0.0))
                elif self.metrics_available is None:
                    self.metrics_available = False
                    return
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.metrics_interval_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ one run
    async def run(self, client, reqs: list[BenchRequest], label: str) -> dict:
        """Sends ``reqs`` at their ``arrival_s`` (relative to now); returns results and timeline."""
        from tqdm.auto import tqdm

        sem = asyncio.Semaphore(self.max_concurrency or len(reqs) or 1)
        bar = tqdm(total=len(reqs), desc=label, unit="req", disable=not self.use_tqdm, dynamic_ncols=True)
        timeline: dict[str, list[float]] = {"time_s": [], **{k: [] for k in GAUGES}}
        stop = asyncio.Event()
        t0 = time.perf_counter()
        scraper = (
            asyncio.create_task(self._scrape(client, t0, timeline, stop))
            if self.metrics_interval_s > 0
            else None
        )
        tasks = []
        for req in sorted(reqs, key=lambda r: r.arrival_s):
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._one(client, req, sem, bar)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        if scraper is not None:
            await scraper
        bar.close()
        return {"results": list(results), "duration_s": duration, "timeline": timeline}

    async def warmup(self, client, req: BenchRequest, n: int) -> None:
        for _ in range(n):
            res = RequestResult(request_id=-1, prompt_len=req.prompt_len, expected_output_len=2)
            mode = "ids" if self.prompt_mode in ("auto", "ids") else "text"
            status = await self._post(client, req, res, mode, max_tokens=2)
            if status in (400, 422) and self.prompt_mode == "auto":
                self.prompt_mode = "text"
                await self._post(client, req, res, "text", max_tokens=2)
            if not res.success:
                raise RuntimeError(f"warm-up request failed: {res.error}")


def _parse_floats(s: str | None) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()] if s else []


def build_parser() -> argparse.ArgumentParser:
    from kvserve.benchmarks.throughput import add_workload_args

    p = argparse.ArgumentParser(
        prog="kvserve bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    add_workload_args(p)
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s; inf (default) sends all at once"
    )
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    a.add_argument("--sweep-rates", default=None, help="comma-separated request rates, one run each")
    a.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    t = p.add_argument_group("trace replay")
    t.add_argument(
        "--trace",
        default=None,
        help="trace file (Azure 2023 CSV, Vidur CSV, Mooncake JSONL, "
        "or a length-only CSV paired with generated arrivals)",
    )
    t.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply the trace's arrival times by this (0.5 = twice the rate)",
    )
    t.add_argument("--sweep-time-scales", default=None, help="comma-separated time scales, one run each")
    t.add_argument("--trace-start-s", type=float, default=0.0, help="skip the trace before this time (s)")
    t.add_argument("--trace-duration-s", type=float, default=None, help="replay only this long a window (s)")
    t.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context to clip traces to (default: the server's, from /v1/models, else 2048)",
    )
    t.add_argument("--max-input-len", type=int, default=None, help="also clip trace prompts to this")
    t.add_argument("--max-output-len", type=int, default=None, help="also clip trace outputs to this")
    s = p.add_argument_group("SLO (goodput)")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    o = p.add_argument_group("output")
    o.add_argument("--json-out", default=None)
    o.add_argument(
        "--plot-dir", default=None, help="write latency CDF, latency-vs-rate and timeline PNGs here"
    )
    o.add_argument("--label", default=None, help="name of this server in plots and JSON (default: the URL)")
    o.add_argument("--no-tqdm", action="store_true")
    m = p.add_argument_group("misc")
    m.add_argument(
        "--prompt-format",
        choices=["auto", "ids", "text"],
        default="auto",
        help="send prompts as token ids or text (auto: ids, text if the server refuses ids)",
    )
    m.add_argument("--tokenizer", default=None, help="model dir to decode synthetic prompts for text mode")
    m.add_argument("--warmup-requests", type=int, default=1, help="tiny requests sent before measuring")
    m.add_argument("--wait-for-server-s", type=float, default=0.0, help="poll /v1/models this long first")
    m.add_argument("--metrics-interval-s", type=float, default=0.5, help="/metrics scrape period; 0 = off")
    m.add_argument("--request-timeout-s", type=float, default=3600.0)
    m.add_argument("--cooldown-s", type=float, default=1.0, help="pause between runs of a sweep")
    return p


def plan_runs(ns, reqs: list[BenchRequest], has_times: bool) -> list[dict]:
    """One dict per run: ``label``, ``request_rate``/``time_scale``, and requests with arrival times."""
    runs = []
    if has_times:
        scales = _parse_floats(ns.sweep_time_scales) or [ns.time_scale]
        base = [r.arrival_s for r in reqs]
        for sc in scales:
            rs = [
                BenchRequest(r.prompt_token_ids, r.output_len, r.prompt, b * sc, r.id)
                for r, b in zip(reqs, base)
            ]
            span = max(b * sc for b in base) if base else 0.0
            runs.append(
                {
                    "label": f"trace x{sc:g}",
                    "time_scale": sc,
                    "reqs": rs,
                    "request_rate": (len(rs) - 1) / span if span > 0 else math.inf,
                }
            )
    else:
        rates = _parse_floats(ns.sweep_rates) or [ns.request_rate]
        for rate in rates:
            times = generate_arrivals(len(reqs), rate, ns.burstiness, seed=ns.workload_seed)
            rs = [
                BenchRequest(r.prompt_token_ids, r.output_len, r.prompt, t, r.id) for r, t in zip(reqs, times)
            ]
            runs.append(
                {"label": f"rate={rate:g}", "request_rate": rate, "burstiness": ns.burstiness, "reqs": rs}
            )
    return runs


async def amain(ns) -> int:
    import httpx

    from kvserve.benchmarks.throughput import requests_from_args

    slo = SLO(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_e2e_ms)
    gen = LoadGenerator(
        ns.base_url,
        ns.model,
        ns.prompt_format,
        ns.request_timeout_s,
        ns.max_concurrency,
        ns.tokenizer,
        ns.metrics_interval_s,
        not ns.no_tqdm,
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(ns.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if ns.wait_for_server_s > 0:
            await gen.wait_ready(client, ns.wait_for_server_s)
        info = await gen.server_info(client)
        gen.model = ns.model or info["model"]
        if gen.model is None:
            print("error: no --model given and GET /v1/models named none", file=sys.stderr)
            return 2
        clip = None
        has_times = False
        if ns.trace:
            max_len = ns.max_model_len or info["max_model_len"] or 2048
            records = select_trace(
                load_trace(ns.trace), ns.trace_start_s, ns.trace_duration_s, ns.num_prompts
            )
            has_times = bool(records) and records[0].arrival_s is not None
            corpus = load_corpus([ns.workload] if ns.workload else None)
            reqs, report = trace_to_requests(
                records, corpus, max_len, ns.max_input_len, ns.max_output_len, seed=ns.workload_seed
            )
            clip = report.as_dict()
            source = f"trace {ns.trace} ({len(reqs)} requests)"
            print(
                f"{source}: clipped to max_model_len={max_len}: {report.input_clipped} prompts and "
                f"{report.output_clipped} outputs shortened; prompt tokens {report.input_tokens_before} -> "
                f"{report.input_tokens_after}, output tokens {report.output_tokens_before} -> "
                f"{report.output_tokens_after}"
            )
        else:
            reqs, source = requests_from_args(ns)
        if not reqs:
            print("error: no requests to send", file=sys.stderr)
            return 2
        print(
            f"server {gen.base_url} model {gen.model!r}; {source}: {len(reqs)} requests, "
            f"{sum(r.prompt_len for r in reqs)} prompt + {sum(r.output_len for r in reqs)} output tokens"
        )
        if ns.warmup_requests:
            await gen.warmup(client, reqs[0], ns.warmup_requests)
        runs_out = []
        plans = plan_runs(ns, reqs, has_times)
        for k, plan in enumerate(plans):
            if k and ns.cooldown_s:
                await asyncio.sleep(ns.cooldown_s)
            out = await gen.run(client, plan["reqs"], plan["label"])
            results: list[RequestResult] = out["results"]
            summary = summarize_results(results, out["duration_s"], slo)
            ok = [r for r in results if r.success]
            runs_out.append(
                {
                    "label": plan["label"],
                    "request_rate": plan.get("request_rate"),
                    "burstiness": plan.get("burstiness"),
                    "time_scale": plan.get("time_scale"),
                    "summary": summary,
                    "samples": {
                        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
                        "tpot_ms": [r.tpot * 1000 for r in ok if r.tpot is not None],
                        "e2e_ms": [r.e2e * 1000 for r in ok if r.e2e is not None],
                    },
                    "requests": [
                        {
                            "id": r.request_id,
                            "prompt_len": r.prompt_len,
                            "expected_output_len": r.expected_output_len,
                            "output_tokens": r.output_tokens,
                            "success": r.success,
                            "scheduled_arrival_s": r.scheduled_arrival,
                            "ttft_s": r.ttft,
                            "tpot_s": r.tpot,
                            "e2e_s": r.e2e,
                            "error": r.error or None,
                        }
                        for r in results
                    ],
                    "timeline": out["timeline"],
                }
            )
            print_summary(plan["label"], summary)
    if len(runs_out) > 1:
        print_sweep(runs_out)
    label = ns.label or ns.base_url
    result = {
        "benchmark": "serve",
        "label": label,
        "base_url": ns.base_url,
        "model": gen.model,
        "workload": source,
        "prompt_format": gen.prompt_mode,
        "max_concurrency": ns.max_concurrency,
        "clip": clip,
        "metrics_scraped": bool(gen.metrics_available),
        "system": system_info(),
        "runs": runs_out,
    }
    if ns.plot_dir:
        from kvserve.benchmarks import plots

        for path in plots.plots_from_result(result, ns.plot_dir):
            print(f"plot: {path}")
    if ns.json_out:
        write_json(ns.json_out, result)
        print(f"wrote {ns.json_out}")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs_out) else 1


def print_summary(label: str, s: dict) -> None:
    print(
        f"\n== {label}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.2f} s; "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s"
    )
    rows = []
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = s[key]
        rows.append([name, d["mean"], d["p50"], d["p90"], d["p99"], d["max"]])
    print(fmt_table(["ms", "mean", "p50", "p90", "p99", "max"], rows))
    slo = s["slo"]
    if any(v is not None for v in slo.values()):
        print(
            f"goodput (SLO ttft<={slo['ttft_ms']} tpot<={slo['tpot_ms']} e2e<={slo['e2e_ms']} ms): "
            f"{s['good_requests']}/{s['num_requests']} good, {s['goodput_req_s']:.2f} req/s, "
            f"{s['goodput_output_tok_s']:.1f} tok/s"
        )
    if s.get("first_errors"):
        print(f"errors: {s['first_errors']}")


def print_sweep(runs: list[dict]) -> None:
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append(
            [
                r["label"],
                s["request_throughput"],
                s["output_throughput"],
                s["ttft_ms"]["p50"],
                s["ttft_ms"]["p99"],
                s["tpot_ms"]["p50"],
                s["tpot_ms"]["p99"],
                s["e2e_ms"]["p50"],
                s["goodput_req_s"],
            ]
        )
    print("\n== sweep")
    print(
        fmt_table(
            [
                "run",
                "req/s",
                "out tok/s",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "E2E p50",
                "goodput req/s",
            ],
            rows,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return asyncio.run(amain(ns))
    except (ValueError, OSError, TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
