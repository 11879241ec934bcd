"""``kvserve bench data-parallel``: one engine vs ``--data-parallel-size N`` with each router on a
shared-prefix workload from the Mooncake trace, in one run.

Workload: the trace's requests whose first hash id is one of the ``--groups`` most common
(requests of one group share a prefix), plus ``--singles`` requests whose first hash id occurs
once (distinct prompts), in trace order. Each hash id stands for ``--block-tokens`` tokens (the
trace's 512, scaled to this machine) cut from the corpus by the id, so equal hash-id prefixes are
equal token prefixes; prompts are capped at ``--max-blocks`` hash blocks, outputs at
``--max-output-len``. Arrivals: Poisson at ``--rate`` requests/s (seeded), the same for every
configuration.

Each configuration replays the same requests against the engine interface the server uses
(``AsyncLLMEngine`` or ``DataParallelAsyncEngine``; no HTTP) and reports the prefix-cache hit
rate (prompt tokens found cached when each request was first
scheduled / prompt tokens; the block managers' own rate, which counts recomputes after a
preemption again, is in the JSON), TTFT p50 /
p99 (arrival to first token), end-to-end latency, output tokens/s and how the requests were
spread. Prefix caching is on in every configuration; every replica has the single engine's KV
cache size. ``--num-requests`` cuts the workload keeping prefix groups whole (in trace order,
while they fit; singles fill the rest), so a small cut still shares prefixes. ``--json-out``
writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import sys
import time
from typing import Any

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.envs import shared_dir
from kvserve.workload.io import write_json
from kvserve.workload.stats import percentile
from kvserve.workload.workload import BenchRequest, corpus_window, generate_arrivals, load_corpus

DEFAULT_TRACE = "traces/mooncake_fast25/synthetic_trace.jsonl"


def shared_prefix_requests(
    records: list[dict],
    corpus: list[int],
    groups: int,
    singles: int,
    block_tokens: int,
    max_blocks: int,
    max_output_len: int,
    num_requests: int | None = None,
) -> list[BenchRequest]:
    """The benchmark's requests from Mooncake rows (``hash_ids``, ``output_length``), see the
    module doc; at most ``num_requests`` of them, cut by ``cut_keeping_groups``. Raises
    ValueError when the trace has no ``hash_ids``."""
    rows = [r for r in records if r.get("hash_ids")]
    if not rows:
        raise ValueError("the trace has no hash_ids (a Mooncake JSONL trace is needed)")
    counts = collections.Counter(r["hash_ids"][0] for r in rows)
    popular = {h for h, _ in counts.most_common(groups)}
    chosen, n_single = [], 0
    for r in rows:
        head = r["hash_ids"][0]
        if head in popular:
            chosen.append(r)
        elif counts[head] == 1 and n_single < singles:
            chosen.append(r)
            n_single += 1
    if num_requests is not None:
        chosen = cut_keeping_groups(chosen, [r["hash_ids"][0] for r in chosen], num_requests)
    span = max(len(corpus) - block_tokens, 1)
    reqs = []
    for i, r in enumerate(chosen):
        ids: list[int] = []
        for h in r["hash_ids"][:max_blocks]:
            ids.extend(corpus_window(corpus, (h * 1_000_003) % span, block_tokens))
        out = max(1, min(int(r.get("output_length") or 1), max_output_len))
        reqs.append(BenchRequest(prompt_token_ids=ids, output_len=out, id=i))
    return reqs


def cut_keeping_groups(rows: list, heads: list, limit: int) -> list:
    """At most ``limit`` of ``rows`` (``heads[i]``: row i's prefix group key), in their order:
    whole groups of two or more rows first, in order of first appearance, while they fit (the
    first group that does not fit is cut to the room left, when that is two rows or more); rows
    of a group of their own fill what is left."""
    members = collections.defaultdict(list)
    for i, h in enumerate(heads):
        members[h].append(i)
    keep: list[int] = []
    for idx in members.values():
        room = limit - len(keep)
        if len(idx) > 1 and room >= 2:
            keep.extend(idx[:room])
    for idx in members.values():
        if len(idx) == 1 and len(keep) < limit:
            keep.extend(idx)
    return [rows[i] for i in sorted(keep)]


async def _replay(async_engine, reqs: list[BenchRequest], label: str) -> dict[str, Any]:
    from kvserve.sampling_params import SamplingParams

    ttft: list[float] = []
    e2e: list[float] = []
    n_out = 0
    cached = 0  # prompt tokens found cached when each request was first scheduled
    t0 = time.perf_counter()

    async def one(r: BenchRequest):
        nonlocal n_out, cached
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        start = time.perf_counter()
        first = None
        params = SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True)
        last = None
        async for out in async_engine.generate(
            {"prompt_token_ids": r.prompt_token_ids}, params, f"{label}-{r.id}"
        ):
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            last = out
        e2e.append(time.perf_counter() - start)
        if first is not None:
            ttft.append(first)
        if last is not None:
            n_out += len(last.outputs[0].token_ids)
            cached += last.num_cached_tokens

    await asyncio.gather(*(one(r) for r in reqs))
    makespan = time.perf_counter() - t0
    return {
        # per request, at its first scheduling: what routing decides (a recompute after a
        # preemption, counted again in the block manager's own counters, is not)
        "prefix_hit_rate": cached / max(sum(r.prompt_len for r in reqs), 1),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "output_tokens": n_out,
        "makespan_s": makespan,
        "output_tok_s": n_out / makespan if makespan > 0 else None,
    }


def _cache_counters(stats: list[dict]) -> dict[str, Any]:
    """The block managers' own counters summed over replicas (their hit rate counts every
    allocation, recomputes after preemption included)."""
    hits = sum(int(s.get("prefix_cache_hits", 0)) for s in stats)
    queries = sum(int(s.get("prefix_cache_queries", 0)) for s in stats)
    return {
        "block_manager_hit_rate": hits / queries if queries else None,
        "num_preemptions": sum(int(s.get("num_preemptions", 0)) for s in stats),
    }


def run_single(engine_args, reqs) -> dict[str, Any]:
    """One engine in this process."""
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args)
    ae = AsyncLLMEngine(engine)

    async def main():
        ae.start(asyncio.get_running_loop())
        try:
            return await _replay(ae, reqs, "one")
        finally:
            ae.shutdown()

    res = asyncio.run(main())
    res.update(_cache_counters([engine.get_kv_cache_stats()]))
    res.update(config="one engine", routed=[len(reqs)])
    return res


def run_data_parallel(engine_args, reqs, router: str) -> dict[str, Any]:
    """``engine_args.data_parallel_size`` replicas on Ray with ``router``."""
    from kvserve.distributed import start_data_parallel_engine

    args = dataclasses.replace(engine_args, router=router)
    dp = start_data_parallel_engine(args, "bench")
    try:

        async def main():
            dp.start()
            res = await _replay(dp, reqs, router)
            stats = [s for _, s in await dp.replica_calls("kv_cache_stats", 30.0)]
            return res, stats

        res, stats = asyncio.run(main())
    finally:
        dp.shutdown()
    res.update(_cache_counters(stats))
    res.update(config=f"DP={args.data_parallel_size} {router}", routed=[r.routed for r in dp.replicas])
    return res


def build_parser() -> argparse.ArgumentParser:
    from kvserve.entrypoints.cli import add_engine_args

    p = argparse.ArgumentParser(prog="kvserve bench data-parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help=f"Mooncake JSONL (default: shared/{DEFAULT_TRACE})")
    p.add_argument("--groups", type=int, default=8, help="most common prefix groups to take")
    p.add_argument("--singles", type=int, default=40, help="requests with a prefix of their own")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace hash id (trace: 512)")
    p.add_argument("--max-blocks", type=int, default=12, help="hash blocks per prompt at most")
    p.add_argument("--max-output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=None, help="cut the workload to this many")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals, requests/s")
    p.add_argument("--routers", default="prefix,round-robin", help="comma-separated routers to run")
    p.add_argument("--no-single", action="store_true", help="skip the one-engine baseline")
    p.add_argument("--json-out", "--out", dest="json_out", default=None, help="write the results JSON here")
    add_engine_args(p)
    p.set_defaults(enable_prefix_caching=True, data_parallel_size=2)
    return p


def main(argv: list[str] | None = None) -> int:
    from kvserve.entrypoints.cli import checked_engine_args

    ns = build_parser().parse_args(argv)
    engine_args = checked_engine_args(ns)
    if engine_args is None:
        return 2
    trace = ns.trace or str(shared_dir() / DEFAULT_TRACE)
    try:
        with open(trace) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        hint = "" if ns.trace else " (the default trace: set $KVSERVE_SHARED_DIR or pass --trace)"
        print(f"error: --trace {trace}: {e}{hint}", file=sys.stderr)
        return 2
    reqs = shared_prefix_requests(
        records,
        load_corpus(),
        ns.groups,
        ns.singles,
        ns.block_tokens,
        ns.max_blocks,
        ns.max_output_len,
        ns.num_requests,
    )
    for r, t in zip(reqs, generate_arrivals(len(reqs), ns.rate, seed=ns.seed)):
        r.arrival_s = t
    engine_args.enable_prefix_caching = True
    print(
        f"{len(reqs)} requests ({ns.groups} shared-prefix groups + distinct prompts), "
        f"{sum(r.prompt_len for r in reqs) / max(len(reqs), 1):.0f} prompt tokens on average, "
        f"{ns.rate:g} req/s",
        file=sys.stderr,
    )
    runs = []
    if not ns.no_single:
        runs.append(run_single(dataclasses.replace(engine_args, data_parallel_size=1), reqs))
    for router in [r for r in ns.routers.split(",") if r]:
        runs.append(run_data_parallel(engine_args, reqs, router))
    rows = [
        [
            r["config"],
            r["prefix_hit_rate"],
            r["ttft_p50_s"],
            r["ttft_p99_s"],
            r["e2e_p50_s"],
            r["output_tok_s"],
            r["num_preemptions"],
            "/".join(map(str, r["routed"])),
        ]
        for r in runs
    ]
    headers = [
        "config",
        "prefix hit",
        "TTFT p50 s",
        "TTFT p99 s",
        "e2e p50 s",
        "out tok/s",
        "preempt",
        "routed",
    ]
    print(fmt_table(headers, rows))
    if ns.json_out:
        write_json(
            ns.json_out,
            {
                "system": system_info(),
                "args": vars(ns),
                "num_requests": len(reqs),
                "runs": runs,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
