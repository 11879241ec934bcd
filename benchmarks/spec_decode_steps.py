#!/usr/bin/env python
"""Per-step CPU time of speculation off vs fixed-k n-gram vs dynamic n-gram, run alternately
in one process (ratios inside one run are meaningful on a loaded machine; absolutes are not).

    KVSERVE_NUM_THREADS=1 python benchmarks/spec_decode_steps.py --dtype float32 --rounds 3

Workload: ``kvserve bench spec-decode``'s input-grounded prompts (``build_workload``), greedy,
``--output-len`` tokens; batch 1 = its first request, batch 8 = its first 8 at once. Each engine
step is timed in thread CPU time (time spent descheduled is not counted; with one thread that is
the whole forward). Decode phase = the steps after every request has its first token. Reports
per batch and method the best round's decode-phase CPU time per output token, its ratio to off,
the steps, and the mean draft length per speculating sequence-step; checks every method's tokens
equal off's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _spec(method: str, k: int, lo: int, hi: int) -> dict | None:
    if method == "off":
        return None
    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    cfg["dynamic"] = method.startswith("dynamic")
    return cfg


def _run(engine, reqs, tag: str) -> dict:
    from kvserve import SamplingParams

    stats = engine.stats
    d0, o0 = stats.spec_num_draft_tokens, stats.spec_num_draft_opportunities
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    started: set[str] = set()
    finals = {}
    decode_ns = steps = 0
    counts: dict[str, int] = {}
    tokens_before = None
    while engine.has_unfinished_requests():
        all_started = len(started) == len(reqs)
        if all_started and tokens_before is None:
            tokens_before = sum(counts.values())
        t0 = time.thread_time_ns()
        outs = engine.step()
        dt = time.thread_time_ns() - t0
        for out in outs:
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
                counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
        if all_started:
            decode_ns += dt
            steps += 1
    n_tokens = sum(len(t) for t in finals.values())
    decode_tokens = n_tokens - (tokens_before or 0)
    opp = stats.spec_num_draft_opportunities - o0
    return {
        "ms_per_token": decode_ns / 1e6 / max(1, decode_tokens),
        "decode_steps": steps,
        "decode_tokens": decode_tokens,
        "mean_draft_len": (stats.spec_num_draft_tokens - d0) / opp if opp else 0.0,
        "tokens": [finals[f"{tag}-{i}"] for i in range(len(reqs))],
    }


def add_workload_args(p: argparse.ArgumentParser, dtype: str, rounds: int, output_len: int) -> None:
    """The flags the per-step speculative benchmarks share: model, dtype, rounds, lengths, the
    n-gram proposer's settings and the KV cache size (GiB)."""
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--kv-cache-memory-gib", type=float, default=0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, dtype="float32", rounds=3, output_len=64)
    p.add_argument("--methods", default="off,fixed,dynamic", help="also: dynamic-nofallback")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args()

    from kvserve.benchmarks.spec_decode import build_workload
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    methods = ns.methods.split(",")
    batches = [int(b) for b in ns.batches.split(",")]
    tok = load_tokenizer(resolve_model_dir(ns.model))
    reqs = build_workload(tok, max(batches), ns.prompt_len, ns.output_len)
    engines = {}
    for m in methods:
        spec = _spec(m, ns.num_speculative_tokens, ns.prompt_lookup_min, ns.prompt_lookup_max)
        if spec is not None:
            spec["disable_below_acceptance_rate"] = 0.1
        engines[m] = LLMEngine.from_engine_args(
            EngineArgs(
                model=ns.model,
                dtype=ns.dtype,
                kv_cache_memory_gib=ns.kv_cache_memory_gib,
                enable_prefix_caching=False,
                speculative_config=spec,
            )
        )
        if m == "dynamic-nofallback":  # dynamic lengths without the 1-gram fallback
            proposer = engines[m].executor.proposer
            proposer.fallback_min = proposer.prompt_lookup_min
        _run(engines[m], reqs[:1], "warm")
    best: dict[int, dict[str, dict]] = {b: {} for b in batches}
    n = 0
    for _ in range(ns.rounds):
        for b in batches:
            for m in methods:  # alternately: every method once per round and batch
                n += 1
                r = _run(engines[m], reqs[:b], f"r{n}")
                cur = best[b].get(m)
                if cur is None or r["ms_per_token"] < cur["ms_per_token"]:
                    best[b][m] = r
    print(f"dtype {ns.dtype}, best of {ns.rounds} rounds, decode-phase CPU ms per output token")
    print(f"{'batch':>5} {'method':>8} {'ms/tok':>8} {'x off':>6} {'steps':>6} {'draft len':>9} same")
    for b in batches:
        off = best[b].get("off")
        for m, r in best[b].items():
            ratio = off["ms_per_token"] / r["ms_per_token"] if off else float("nan")
            same = off is None or r["tokens"] == off["tokens"]
            r["speedup"], r["same_tokens_as_off"] = ratio, same
            print(
                f"{b:>5} {m:>8} {r['ms_per_token']:8.2f} {ratio:6.2f} {r['decode_steps']:>6} "
                f"{r['mean_draft_len']:9.2f} {same}"
            )
    if ns.json_out:
        for by in best.values():
            for r in by.values():
                r.pop("tokens", None)
        Path(ns.json_out).write_text(json.dumps({"args": vars(ns), "results": best}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
