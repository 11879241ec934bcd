"""Offline benchmarks of two scheduler features on the default model (prints tables, writes JSON).

1. Prefix caching on vs off: requests share a long system prompt; throughput and mean TTFT.
2. Chunked prefill on vs off: a mix of long and short prompts; p50/p99 TTFT and inter-token
   latency (ITL), measured per token by stepping the engine and timing each request's growth.

Usage: python benchmarks/scheduling_features.py [--num-requests 32] [--json-out F]
Both runs of a pair happen in the same process on the same model weights.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvserve import LLM, SamplingParams
from kvserve.envs import shared_dir

CORPUS = shared_dir() / "workloads" / "w256.jsonl"


def corpus_ids(n_tokens: int, seed: int) -> list:
    """Token ids of real text (prompts from the fixed workload), cycled to ``n_tokens``."""
    ids = []
    with open(CORPUS) as f:
        rows = [json.loads(line)["prompt_token_ids"] for line in f]
    rng = random.Random(seed)
    while len(ids) < n_tokens:
        ids.extend(rng.choice(rows))
    return ids[:n_tokens]


def run(llm: LLM, prompts, params):
    """Drive the engine step by step; returns (wall seconds, ttfts, itls, output tokens)."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, sp, arrival_time=time.time())
    last_len, last_t, ttft, itl, n_out = {}, {}, [], [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.time()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in last_len:
                ttft.append(now - o.metrics.arrival_time)
            elif n > last_len.get(o.request_id, 0):
                itl.append(now - last_t[o.request_id])
            last_len[o.request_id], last_t[o.request_id] = n, now
            if o.finished:
                n_out += sum(len(c.token_ids) for c in o.outputs)
    return time.perf_counter() - t0, ttft, itl, n_out


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def bench_prefix_caching(num_requests: int, system_len: int, user_len: int, out_len: int):
    system = corpus_ids(system_len, seed=1)
    prompts = [system + corpus_ids(user_len, seed=100 + i) for i in range(num_requests)]
    params = [SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)] * num_requests
    rows = {}
    for enabled in (False, True):
        llm = LLM(enable_prefix_caching=enabled, kv_cache_memory_gib=0.5)
        run(llm, prompts[:2], params[:2])  # warm-up (and, with caching, fills the shared prefix)
        llm.llm_engine.reset_prefix_cache()
        wall, ttft, _, n_out = run(llm, prompts, params)
        stats = llm.llm_engine.get_kv_cache_stats()
        rows["on" if enabled else "off"] = dict(
            wall_s=wall,
            output_tok_s=n_out / wall,
            mean_ttft_s=statistics.mean(ttft),
            hit_rate=stats.get("prefix_cache_hit_rate", 0.0),
        )
        del llm
    rows["throughput_ratio_on_off"] = rows["on"]["output_tok_s"] / rows["off"]["output_tok_s"]
    rows["ttft_ratio_off_on"] = rows["off"]["mean_ttft_s"] / rows["on"]["mean_ttft_s"]
    return rows


def bench_chunked_prefill(num_requests: int, long_len: int, short_len: int, out_len: int, budget: int):
    rng = random.Random(0)
    lens = [long_len if rng.random() < 0.25 else short_len for _ in range(num_requests)]
    prompts = [corpus_ids(n, seed=200 + i) for i, n in enumerate(lens)]
    params = [SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)] * num_requests
    rows = {}
    for enabled in (False, True):
        llm = LLM(
            enable_chunked_prefill=enabled,
            max_num_batched_tokens=budget if enabled else None,
            kv_cache_memory_gib=0.5,
        )
        run(llm, prompts[:2], params[:2])
        wall, ttft, itl, n_out = run(llm, prompts, params)
        rows["on" if enabled else "off"] = dict(
            wall_s=wall,
            output_tok_s=n_out / wall,
            ttft_p50_s=pct(ttft, 50),
            ttft_p99_s=pct(ttft, 99),
            itl_p50_s=pct(itl, 50),
            itl_p99_s=pct(itl, 99),
        )
        del llm
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--system-len", type=int, default=768)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--chunk-budget", type=int, default=256)
    ap.add_argument("--json-out", default="benchmarks/results/scheduling_features.json")
    a = ap.parse_args()
    if not CORPUS.is_file():  # before the model loads
        sys.exit(f"error: {CORPUS}: no such workload (set KVSERVE_SHARED_DIR to the shared data folder)")
    pc = bench_prefix_caching(a.num_requests, a.system_len, a.user_len, a.output_len)
    cp = bench_chunked_prefill(a.num_requests, a.long_len, a.short_len, a.output_len, a.chunk_budget)
    print(f"\nPrefix caching ({a.num_requests} requests, shared {a.system_len}-token system prompt)")
    print(f"{'':6}{'out tok/s':>12}{'mean TTFT s':>14}{'hit rate':>10}")
    for k in ("off", "on"):
        r = pc[k]
        print(f"{k:6}{r['output_tok_s']:12.1f}{r['mean_ttft_s']:14.3f}{r['hit_rate']:10.2f}")
    print(
        f"throughput on/off = {pc['throughput_ratio_on_off']:.2f}x, mean TTFT off/on = {pc['ttft_ratio_off_on']:.2f}x"
    )
    print(
        f"\nChunked prefill ({a.num_requests} requests, 25% of {a.long_len} tokens, rest {a.short_len}; "
        f"budget {a.chunk_budget} tokens/step when on)"
    )
    print(f"{'':6}{'out tok/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}")
    for k in ("off", "on"):
        r = cp[k]
        print(
            f"{k:6}{r['output_tok_s']:12.1f}{r['ttft_p50_s']:10.3f}{r['ttft_p99_s']:10.3f}"
            f"{r['itl_p50_s']:10.3f}{r['itl_p99_s']:10.3f}"
        )
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "prefix_caching": pc, "chunked_prefill": cp}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
