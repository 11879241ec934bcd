"""KV-cache dtypes on a real model: greedy agreement and per-token loss against model-dtype KV.

    .venv/bin/python benchmarks/kv_cache_accuracy.py [--num-prompts 64] [--tokens 16] [--out acc.json]
        [--kv-dtypes auto,int8,int8-float,fp8_e4m3,fp8_e5m2] [--tie-nats 0.05]

The default model (or ``--model``) in ``--dtype`` (default float32), once per entry of
``--kv-dtypes``; the first run, ``auto`` (the model dtype's KV), is the reference:

- greedy: the chat prompts of ``--workload`` (default the shared ``w64.jsonl``, prompts the
  model has not been tuned on), ``--tokens`` greedy tokens each; a prompt agrees when its
  first ``--tokens`` tokens equal the reference's. Reported: the prompts that agree, the mean
  length of the agreeing prefix, and for each prompt that does not, the reference's gap between
  its top two log-probabilities at the first differing token (nats; a near-tie when small).
  ``--tie-nats X`` adds a second count under one rule for every dtype: a prompt also agrees
  when that gap is below ``X`` (the two runs took the two near-equal best tokens).
- loss: the mean negative log-likelihood per token of the same prompts (``prompt_logprobs``),
  prefilled in chunks of ``--chunk`` tokens so that every chunk after the first attends its
  context through the quantized cache; reported with its relative change from the reference.

Entries besides the ``--kv-cache-dtype`` values: ``int8-float`` is ``int8`` with its codes
widened to float32 in the decode kernel (``attention.set_q8_dot(False)``, the path of CPUs
without AVX-512 VNNI) instead of VNNI integer dot products. With ``--torch-path`` every run
takes the torch attention paths (``KVSERVE_NATIVE=0``) and the entries may also be ``bf16``
(K/V rounded to bfloat16) or ``int8-gN`` (K/V rounded to int8 codes with a float16 scale per
``N`` values, ``N`` dividing head_dim; ``int8-g64`` at head_dim 64 is ``int8``'s rounding):
emulated storage formats, K/V rounded as written and kept in the model-dtype cache, which is
exactly what reading such a cache back gives (``code * scale`` is exact in float32).

Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams

KV_DTYPES = ("auto", "int8", "int8-float", "fp8_e4m3", "fp8_e5m2")


def default_workload() -> Path:
    shared = Path(os.environ.get("KVSERVE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
    return shared / "workloads" / "w64.jsonl"


def emulated_rounding(name: str):
    """``bf16`` / ``int8-gN`` -> a function rounding K/V ``[..., D]`` as that format stores them
    (int8: ``scale = max|x| / 127`` per group of ``N``, clamped and rounded to float16 as
    ``kv_quant.quantize`` does); ``None`` for a real ``--kv-cache-dtype`` entry."""
    if name == "bf16":
        return lambda x: x.to(torch.bfloat16).to(x.dtype)
    if not name.startswith("int8-g"):
        return None
    n = int(name[len("int8-g") :])

    def rnd(x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        if D % n:
            raise ValueError(f"{name}: {n} does not divide head_dim {D}")
        g = x.float().reshape(-1, D // n, n)
        s = (g.abs().amax(-1, keepdim=True) / 127).clamp(2.0**-14, 65504.0).half().float()
        return ((g / s).clamp(-127, 127).round() * s).reshape(x.shape).to(x.dtype)

    return rnd


class _Emulation:
    """Patches ``PagedAttention.forward`` (torch paths only) to round K/V before they are
    written and attended; ``rounding = None`` leaves them as they are."""

    def __init__(self) -> None:
        from kvserve.model_executor.layers import attention

        self.rounding = None
        orig = attention.PagedAttention.forward

        def forward(mod, q, k, v, kv_cache, meta, kv_written=False):
            if self.rounding is not None:
                if kv_written:
                    raise RuntimeError("emulated KV formats need --torch-path (K/V written by a kernel)")
                k, v = self.rounding(k), self.rounding(v)
            return orig(mod, q, k, v, kv_cache, meta, kv_written)

        attention.PagedAttention.forward = forward


def run(
    model: str | None,
    dtype: str,
    kv: str,
    prompts: list[list[int]],
    tokens: int,
    chunk: int,
    emu: _Emulation | None,
) -> dict:
    """Greedy tokens, the top-two log-probabilities per greedy token and prompt NLL per prompt
    for one entry of ``--kv-dtypes``."""
    from kvserve.ops import attention

    rounding = emulated_rounding(kv)
    if rounding is not None and emu is None:
        raise SystemExit(f"--kv-dtypes {kv}: an emulated format, needs --torch-path")
    cache_kv = "auto" if rounding is not None else ("int8" if kv == "int8-float" else kv)
    if emu is not None:
        emu.rounding = rounding
    llm = LLM(
        model=model,
        dtype=dtype,
        kv_cache_dtype=cache_kv,
        enable_chunked_prefill=True,
        max_num_batched_tokens=chunk,
        max_num_seqs=max(1, chunk),
    )
    dot = kv != "int8-float"
    if emu is None:
        attention.set_q8_dot(dot)
    try:
        greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        scored = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        if emu is None:
            attention.set_q8_dot(True)
        llm.shutdown()
    nll, n = 0.0, 0
    for o, p in zip(scored, prompts):
        for d, t in zip(o.prompt_logprobs[1:], p[1:]):
            nll -= d[t].logprob
            n += 1
    top2 = [
        [sorted((lp.logprob for lp in d.values()), reverse=True)[:2] for d in o.outputs[0].logprobs]
        for o in outs
    ]
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "top2": top2,
        "nll": nll / n,
        "scored_tokens": n,
    }


def compare(r: dict, ref: dict, tokens: int, tie_nats: float) -> dict:
    """One row of the table: ``r``'s greedy tokens and loss against the reference's."""
    prefixes, diverged = [], []
    for i, (a, b) in enumerate(zip(r["tokens"], ref["tokens"])):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
        if k < tokens:
            t = ref["top2"][i][k]
            diverged.append({"prompt": i, "position": k, "ref_gap": t[0] - t[1] if len(t) == 2 else None})
    n = len(prefixes)
    ties = sum(d["ref_gap"] is not None and d["ref_gap"] < tie_nats for d in diverged)
    return {
        "prompts": n,
        "agree": n - len(diverged),
        "agree_with_ties": n - len(diverged) + ties,
        "prompts_agreeing": (n - len(diverged)) / n,
        "mean_agreeing_prefix": sum(prefixes) / n,
        "nll_per_token": r["nll"],
        "nll_change": r["nll"] / ref["nll"] - 1.0,
        "diverged": diverged,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="float32", help="model dtype (the reference KV's)")
    ap.add_argument("--workload", type=Path, default=None, help="a JSONL of prompt_token_ids (default w64)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--tie-nats", type=float, default=0.0, help="near-tie rule (default 0: off)")
    ap.add_argument("--torch-path", action="store_true", help="KVSERVE_NATIVE=0; allows emulated formats")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.torch_path:
        os.environ["KVSERVE_NATIVE"] = "0"
    emu = _Emulation() if args.torch_path else None
    path = args.workload or default_workload()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt_token_ids"] for r in rows[: args.num_prompts]]
    kvs = args.kv_dtypes.split(",")
    if kvs[0] != "auto":
        kvs.insert(0, "auto")
    results = {kv: run(args.model, args.dtype, kv, prompts, args.tokens, args.chunk, emu) for kv in kvs}
    table = [
        {"kv_cache_dtype": kv, **compare(results[kv], results["auto"], args.tokens, args.tie_nats)}
        for kv in kvs
    ]
    path_name = "torch paths" if args.torch_path else "native kernels"
    print(
        f"{len(prompts)} prompts of {path.name}, {args.tokens} greedy tokens, chunks of {args.chunk}, "
        f"{args.dtype} model, {path_name}, {torch.get_num_threads()} threads"
    )
    tie_hdr = f"ties<{args.tie_nats:g}"
    print(
        f"{'kv dtype':<11} {'agree':>7} {tie_hdr:>10} {'prefix':>7} {'nll/token':>10} {'change':>8}  ref gaps"
    )
    for t in table:
        gaps = " ".join(
            f"{d['ref_gap']:.3f}" for d in sorted(t["diverged"], key=lambda d: d["ref_gap"] or 0.0)
        )
        print(
            f"{t['kv_cache_dtype']:<11} {t['agree']:>3}/{t['prompts']:<3} {t['agree_with_ties']:>6}/{t['prompts']:<3} "
            f"{t['mean_agreeing_prefix']:>7.2f} {t['nll_per_token']:>10.5f} {t['nll_change']:>+8.3%}  {gaps}"
        )
    if args.out:
        meta = {"workload": str(path), "tokens": args.tokens, "dtype": args.dtype, "tie_nats": args.tie_nats}
        args.out.write_text(json.dumps({**meta, "torch_path": args.torch_path, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
