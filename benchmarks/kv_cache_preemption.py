"""KV-cache dtypes under a tight KV budget: preemptions and time to finish, same bytes each.

    .venv/bin/python benchmarks/kv_cache_preemption.py [--workload long|mooncake] [--rounds 2]
        [--kv-dtypes auto,int8] [--dtype bfloat16] [--out preempt.json]

The real engine (the default model or ``--model``, ``--dtype``) runs one offline batch per KV
dtype on the same KV memory: ``--blocks`` blocks of the model-dtype cache (default: the
workload's own block count), converted to bytes by ``bytes_per_block`` and handed to every KV
dtype as ``kv_cache_memory_gib``, so a quantized cache gets the blocks those bytes buy. A
model-dtype cache of that size cannot hold the batch at once and preempts; the question is how
much less a quantized cache of the same bytes does, and whether it finishes sooner.

Workloads (every request arrives at once, ``ignore_eos``, greedy):

- ``long``: ``kvserve bench preemption``'s ``long`` workload (6 prompts of 256 tokens, 160
  output tokens each, 40 blocks of 16 tokens);
- ``mooncake``: the first ``--num-requests`` rows of the shared Mooncake trace, their lengths
  scaled by ``workload.scheduling.scale_lengths`` (``--max-prompt-len``, ``--max-output-len``),
  on ``--blocks`` blocks (default 64).

Per run: the pool's blocks, preemptions (recompute / swap), recomputed prompt tokens, wall
seconds around ``generate``, output tokens/s. The KV dtypes alternate over ``--rounds`` rounds.
Prints a table and writes the rows as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.cache_engine import bytes_per_block
from kvserve.workload import scheduling as ws
from kvserve.workload.workload import load_corpus, load_trace

BLOCK_SIZE = 16
#: SmolLM2-135M's KV shape (layers, KV heads, head_dim) when ``--shape`` is not given.
DEFAULT_SHAPE = (30, 3, 64)


def _shared() -> Path:
    return Path(os.environ.get("KVSERVE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))


def workload(name: str, num_requests: int, max_prompt: int, max_output: int) -> tuple[list, int]:
    """``(requests, blocks)``: ``requests`` as ``(prompt_token_ids, output_len)``; ``blocks`` the
    workload's default model-dtype block budget.

    Raises:
        ValueError: an unknown workload name.
    """
    corpus = load_corpus()
    if name == "long":
        (w,) = [w for w in ws.preemption_workloads(corpus) if w.name == "long"]
        return [(r.prompt_token_ids, r.output_len) for r in w.requests], w.num_gpu_blocks
    if name == "mooncake":
        rows = load_trace(_shared() / "traces" / "mooncake_fast25" / "synthetic_trace.jsonl")[:num_requests]
        lens = ws.scale_lengths([(r.input_len, r.output_len) for r in rows], max_prompt, max_output)
        return [(ws.corpus_window(corpus, i * 7919, p), o) for i, (p, o) in enumerate(lens)], 64
    raise ValueError(f"--workload must be long or mooncake, got {name!r}")


def run_once(model: str | None, dtype: str, kv: str, gib: float, requests: list, max_len: int) -> dict:
    """One batch of ``requests`` on a ``gib`` GiB cache of ``kv``; the row of the table."""
    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gib=gib, max_model_len=max_len)
    try:
        eng = llm.llm_engine
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        st = eng.get_kv_cache_stats()
        blocks = eng.cache_config.num_gpu_blocks
    finally:
        llm.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "kv_cache_dtype": kv,
        "blocks": blocks,
        "preemptions": st["num_preemptions"],
        "recompute": st["num_recompute_preemptions"],
        "swap": st["num_swap_preemptions"],
        "recomputed_tokens": st["num_recomputed_tokens"],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (the `auto` KV dtype)")
    ap.add_argument("--workload", default="long", choices=("long", "mooncake"))
    ap.add_argument("--num-requests", type=int, default=16, help="mooncake: trace rows")
    ap.add_argument("--max-prompt-len", type=int, default=512, help="mooncake: scaled prompt cap")
    ap.add_argument("--max-output-len", type=int, default=128, help="mooncake: output cap")
    ap.add_argument("--blocks", type=int, default=None, help="KV budget in model-dtype blocks")
    ap.add_argument("--shape", default=None, help="layers,kv_heads,head_dim (default SmolLM2-135M's)")
    ap.add_argument("--kv-dtypes", default="auto,int8")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    requests, blocks = workload(args.workload, args.num_requests, args.max_prompt_len, args.max_output_len)
    blocks = args.blocks or blocks
    layers, kv_heads, head_dim = map(int, args.shape.split(",")) if args.shape else DEFAULT_SHAPE
    mdt = getattr(torch, args.dtype)
    gib = blocks * bytes_per_block(layers, BLOCK_SIZE, kv_heads, head_dim, mdt, "auto") / 2**30
    max_len = max(p + o for p, o in ((len(p), o) for p, o in requests))
    rows = []
    for rnd in range(args.rounds):
        for kv in args.kv_dtypes.split(","):
            r = run_once(args.model, args.dtype, kv, gib, requests, max(max_len, 1024))
            r["round"] = rnd + 1
            rows.append(r)
    tokens = sum(len(p) for p, _ in requests), sum(o for _, o in requests)
    print(
        f"{args.workload}: {len(requests)} requests, {tokens[0]} prompt + {tokens[1]} output tokens; "
        f"KV budget {blocks} {args.dtype} blocks = {gib * 2**10:.2f} MiB; threads {torch.get_num_threads()}"
    )
    hdr = ("round", "kv dtype", "blocks", "preempt", "recomp", "swap", "recomp tok", "wall s", "tok/s")
    print(" ".join(f"{h:>10}" for h in hdr))
    for r in rows:
        cells = (r["round"], r["kv_cache_dtype"], r["blocks"], r["preemptions"], r["recompute"], r["swap"])
        cells += (r["recomputed_tokens"], f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}")
        print(" ".join(f"{c:>10}" for c in cells))
    if args.out:
        meta = {"workload": args.workload, "blocks": blocks, "kv_cache_memory_gib": gib, "dtype": args.dtype}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
