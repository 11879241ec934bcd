"""Micro benchmark of the executor alone (no scheduler, no detokenizer).

Prefills ``--num-seqs`` random prompts of ``--context`` tokens (``--prefill-tokens`` per step),
then runs ``--steps`` decode steps of the whole batch (greedy sampling included) and reports
step time and tokens/s for both phases.

    python benchmarks/bench_runner.py                     # default model, 64 x 400, float32
    python benchmarks/bench_runner.py --profile prof.txt  # + torch.profiler table of 3 decode steps
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.worker.worker import Worker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument(
        "--context-spread", type=int, default=0, help="prompt lengths uniform in context +- spread"
    )
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table here")
    args = ap.parse_args()

    if args.threads:
        os.environ["KVSERVE_NUM_THREADS"] = str(args.threads)  # else the worker calibrates
    t0 = time.perf_counter()
    w = Worker(
        ModelConfig(model=args.model, dtype=args.dtype, device=args.device),
        CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_gib, swap_space_gib=0.0),
    )
    g, c = w.determine_num_blocks()
    w.init_cache(g, c)
    print(
        f"load+init {time.perf_counter() - t0:.2f} s; {g} blocks of {args.block_size}; "
        f"threads={torch.get_num_threads()}; device={w.device}; dtype={w.dtype}"
    )
    sync = torch.cuda.synchronize if w.device == "cuda" else (lambda: None)

    rng = random.Random(0)
    vocab = w.hf_config.vocab_size
    bs = args.block_size
    free = list(range(g))
    rng.shuffle(free)
    params = SamplingParams(temperature=0.0, max_tokens=10_000)
    seqs = []
    for i in range(args.num_seqs):
        n = args.context + rng.randint(-args.context_spread, args.context_spread)
        seqs.append((i, SequenceData([rng.randrange(3, vocab) for _ in range(n)]), []))

    def md_for(i, data, table, chunk):
        need = data.get_num_computed_tokens() + chunk
        while len(table) * bs < need:
            table.append(free.pop())
        return SequenceGroupMetadata(
            str(i),
            data.get_num_computed_tokens() < data.get_prompt_len(),
            {i: data},
            params,
            {i: list(table)},
            chunk,
        )

    def run(mds):
        outs = w.execute_model(ExecuteModelRequest(mds))
        for md, o in zip(mds, outs):
            for d in md.seq_data.values():
                d.update_num_computed_tokens(md.token_chunk_size)
                if md.do_sample:
                    d.append_token_id(o.samples[0].output_token)

    # prefill, several whole prompts per step
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    ntok = 0
    batch, btok = [], 0
    for s in seqs:
        if batch and btok + s[1].get_len() > args.prefill_tokens:
            run(batch)
            batch, btok = [], 0
        batch.append(md_for(*s, s[1].get_len()))
        btok += s[1].get_len()
        ntok += s[1].get_len()
    run(batch)
    sync()
    dt = time.perf_counter() - t0
    print(
        f"prefill: {ntok} tokens in {dt:.2f} s (CPU time {time.process_time() - c0:.2f} s) = {ntok / dt:.0f} tokens/s"
    )

    def decode_step():
        run([md_for(*s, 1) for s in seqs])

    decode_step()  # warm-up
    times, cpu = [], []
    for _ in range(args.steps):
        sync()
        t, c0 = time.perf_counter(), time.process_time()
        decode_step()
        sync()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c0)
    times.sort()
    cpu.sort()
    med = times[len(times) // 2]
    ctx = sum(s[1].get_len() for s in seqs) / len(seqs)
    print(
        f"decode: batch {len(seqs)}, mean context {ctx:.0f}: median step {med * 1e3:.1f} ms "
        f"(min {times[0] * 1e3:.1f}; CPU time {cpu[len(cpu) // 2] * 1e3:.1f} ms) = {len(seqs) / med:.0f} tokens/s"
    )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if w.device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                decode_step()
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        print(f"profile written to {args.profile}")


if __name__ == "__main__":
    main()
