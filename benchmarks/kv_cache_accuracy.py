"""KV-cache dtypes on a real model: greedy agreement and per-token loss against model-dtype KV.

    .venv/bin/python benchmarks/kv_cache_accuracy.py [--num-prompts 64] [--tokens 16] [--out acc.json]

The default model (or ``--model``), float32 weights, once per ``--kv-cache-dtype`` (``auto``
= float32 KV, the reference, then int8, fp8_e4m3, fp8_e5m2):

- greedy: the chat prompts of ``--workload`` (default the shared ``w64.jsonl``, prompts the
  model has not been tuned on), ``--tokens`` greedy tokens each; a prompt agrees when its
  first ``--tokens`` tokens equal the reference's. Reported: the share of prompts that agree and
  the mean length of the agreeing prefix.
- loss: the mean negative log-likelihood per token of the same prompts (``prompt_logprobs``),
  prefilled in chunks of ``--chunk`` tokens so that every chunk after the first attends its
  context through the quantized cache; reported with its relative change from the reference.

Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvserve import LLM, SamplingParams

KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def default_workload() -> Path:
    shared = Path(os.environ.get("KVSERVE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
    return shared / "workloads" / "w64.jsonl"


def run(model: str | None, kv: str, prompts: list[list[int]], tokens: int, chunk: int) -> dict:
    """Greedy tokens and prompt NLL per prompt for one KV dtype."""
    llm = LLM(
        model=model,
        dtype="float32",
        kv_cache_dtype=kv,
        enable_chunked_prefill=True,
        max_num_batched_tokens=chunk,
        max_num_seqs=max(1, chunk),
    )
    try:
        greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        scored = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    nll, n = 0.0, 0
    for o, p in zip(scored, prompts):
        for d, t in zip(o.prompt_logprobs[1:], p[1:]):
            nll -= d[t].logprob
            n += 1
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "nll": nll / n, "scored_tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--workload", type=Path, default=None, help="a JSONL of prompt_token_ids (default w64)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = args.workload or default_workload()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt_token_ids"] for r in rows[: args.num_prompts]]
    kvs = args.kv_dtypes.split(",")
    if kvs[0] != "auto":
        kvs.insert(0, "auto")
    results = {kv: run(args.model, kv, prompts, args.tokens, args.chunk) for kv in kvs}
    ref = results["auto"]
    table = []
    for kv in kvs:
        r = results[kv]
        prefixes = []
        for a, b in zip(r["tokens"], ref["tokens"]):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            prefixes.append(k)
        agree = sum(k >= args.tokens for k in prefixes) / len(prefixes)
        table.append(
            {
                "kv_cache_dtype": kv,
                "prompts_agreeing": agree,
                "mean_agreeing_prefix": sum(prefixes) / len(prefixes),
                "nll_per_token": r["nll"],
                "nll_change": r["nll"] / ref["nll"] - 1.0,
            }
        )
    print(f"{len(prompts)} prompts of {path.name}, {args.tokens} greedy tokens, chunks of {args.chunk}")
    print(f"{'kv dtype':<10} {'agree':>7} {'prefix':>7} {'nll/token':>10} {'change':>8}")
    for t in table:
        print(
            f"{t['kv_cache_dtype']:<10} {t['prompts_agreeing']:>7.1%} {t['mean_agreeing_prefix']:>7.2f} "
            f"{t['nll_per_token']:>10.5f} {t['nll_change']:>+8.3%}"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"workload": str(path), "tokens": args.tokens, "rows": table}, indent=1)
        )


if __name__ == "__main__":
    main()
