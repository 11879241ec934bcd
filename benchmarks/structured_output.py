"""Structured outputs at w64: every request constrained by a JSON schema vs unconstrained, one run.

The w64 workload (token ids in, ``max_tokens`` = its output length) goes through one ``LLM``
twice, all requests at once: unconstrained (``ignore_eos``, so each makes its full output), then
each request constrained by a JSON schema whose objects can run as long as ``max_tokens`` (an
array of strings), so the constrained run makes comparable output. Prints output tok/s of both,
their ratio (issue 14's target: >= 0.9), the schema's compile time, and writes JSON.

Run: ``.venv/bin/python benchmarks/structured_output.py [--dtype bfloat16] [--json-out F]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}


def _run(llm, requests, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return secs, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    from kvserve import LLM, SamplingParams, StructuredOutputsParams
    from kvserve.benchmarks.workload import default_workload_path, load_workload

    requests = load_workload(default_workload_path(), ns.num_prompts)
    llm = LLM(dtype=ns.dtype)
    plain = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests]
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    t0 = time.perf_counter()
    constrained = [
        SamplingParams(max_tokens=r.output_len, temperature=0, structured_outputs=so) for r in requests
    ]
    _run(llm, requests[:1], constrained[:1])  # compiles the schema (cached) and the tokenizer view
    compile_s = time.perf_counter() - t0
    _run(llm, requests[:2], plain[:2])  # warm-up
    u_s, u_tok = _run(llm, requests, plain)
    c_s, c_tok = _run(llm, requests, constrained)
    u_rate, c_rate = u_tok / u_s, c_tok / c_s
    res = {
        "dtype": ns.dtype,
        "num_requests": len(requests),
        "unconstrained": {"output_tokens": u_tok, "seconds": u_s, "output_tok_s": u_rate},
        "constrained": {"output_tokens": c_tok, "seconds": c_s, "output_tok_s": c_rate},
        "ratio": c_rate / u_rate,
        "first_compile_s": compile_s,
        "target_ratio": 0.9,
    }
    print(f"{'run':14} {'output tokens':>14} {'seconds':>9} {'output tok/s':>13}")
    print(f"{'unconstrained':14} {u_tok:14d} {u_s:9.1f} {u_rate:13.1f}")
    print(f"{'JSON schema':14} {c_tok:14d} {c_s:9.1f} {c_rate:13.1f}")
    print(
        f"constrained / unconstrained = {res['ratio']:.3f} (target >= 0.9); first request incl. "
        f"schema compile and tokenizer view: {compile_s:.2f} s"
    )
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json_out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
