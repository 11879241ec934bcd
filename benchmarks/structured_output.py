"""Structured outputs at w64: every request constrained by a JSON schema vs unconstrained, one run.

The w64 workload (token ids in, greedy) goes through one ``LLM``, all requests at once. First
every request is constrained by a JSON schema (an array of strings, ``max_tokens`` = its w64
output length); the model closes its JSON when it likes, so each request's output length is
recorded. The unconstrained run then makes exactly those lengths (``max_tokens`` = the
constrained output's length, ``ignore_eos``): both runs make the same number of output tokens,
request by request, so the batch shrinks the same way and only the constraint's cost differs.
Runs alternate (unconstrained, constrained, ...) ``--repeats`` times, so a load change on a
shared machine hits both; the ratio is per adjacent pair and its median is reported.

``--mask-impl both`` also runs every constrained pass a second time with the token mask applied
in torch (bit expansion + ``masked_fill_``, then the greedy kernel: what ran before the
``kvserve.ops.bitmask`` kernels), alternating, so before/after come from one process and one load.

Reported: output tok/s of each run and the ratios (the target: constrained >= 0.9x unconstrained); the tokenizer
view (built once), the compile time of each new schema (``--num-schemas`` distinct schemas
compiled cold) and its first mask (llguidance builds part of a grammar lazily); per constrained
token: the llguidance fill (on the worker thread, overlapped with the forward), the part of it
the step waited for, the sampler's masking (collecting the step's masks, which includes that
wait, and applying them, fused into greedy where it can) and the engine's part (starting each
fill, advancing the matchers); and the share of the run's time that these take (an upper bound
on the constraint's cost that holds up on a loaded machine, where tok/s ratios scatter).
JSON with ``--json-out``.

Run: ``.venv/bin/python benchmarks/structured_output.py [--dtype bfloat16] [--mask-impl both]
[--num-prompts 16] [--repeats 2] [--json-out F]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}


def _schema_variant(i: int) -> dict:
    """A distinct schema of the same shape as ``SCHEMA`` and ~5 properties (a cold compile)."""
    props = {f"field_{i}_{k}": {"type": t} for k, t in enumerate(["string", "integer", "boolean", "number"])}
    props[f"notes_{i}"] = {"type": "array", "items": {"type": "string"}, "maxItems": 8}
    return {"type": "object", "properties": props, "required": sorted(props)}


class _Timer:
    """Wall time of some functions, summed (a call nested in another timed one counts once)."""

    def __init__(self, targets):
        self.seconds = 0.0
        self._depth = 0
        self._patched = []
        for owner, name in targets:
            self._wrap(owner, name)

    def _wrap(self, owner, name):
        import inspect

        raw = inspect.getattr_static(owner, name)
        fn = getattr(owner, name)

        def timed(*a, **k):
            if self._depth:  # nested (a wrapper calling a kernel): counted by the outer call
                return fn(*a, **k)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth -= 1

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        self._patched.append((owner, name, raw))


def _run(llm, requests, params) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return secs, [len(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1, help="alternating pairs (default 1)")
    p.add_argument("--mask-impl", choices=["native", "torch", "both"], default="native")
    p.add_argument("--num-schemas", type=int, default=8, help="distinct schemas compiled cold (default 8)")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    from kvserve import LLM, SamplingParams, StructuredOutputsParams
    from kvserve.ops import bitmask as bitmask_kernel
    from kvserve.workload.workload import default_workload_path, load_workload

    requests = load_workload(default_workload_path(), ns.num_prompts)
    llm = LLM(dtype=ns.dtype)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    manager = llm.llm_engine.structured_output
    t0 = time.perf_counter()
    manager.compile(so)  # the first compile also builds the tokenizer view
    first_compile_s = time.perf_counter() - t0
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    compile_s, first_mask_s = [], []
    mask_row = allocate_token_bitmask(1, manager.compiler.vocab_size)
    for i in range(ns.num_schemas):
        t0 = time.perf_counter()
        template = manager.compiler.compile(
            StructuredOutputsParams(json=_schema_variant(i), disable_any_whitespace=True)
        )
        t1 = time.perf_counter()
        fill_next_token_bitmask(template.deep_copy(), mask_row, 0)  # some grammar work is lazy
        compile_s.append(t1 - t0)
        first_mask_s.append(time.perf_counter() - t1)
    constrained = [
        SamplingParams(max_tokens=r.output_len, temperature=0, structured_outputs=so) for r in requests
    ]
    _run(llm, requests[:2], constrained[:2])  # warm-up
    from kvserve.model_executor import sampler
    from kvserve.model_executor.layers import bitmask
    from kvserve.structured_output import manager as manager_mod

    # the sampler's part: waiting for + collecting the step's masks, applying them
    timer = _Timer(
        [
            (sampler.Sampler, "_collect_constraints"),
            (bitmask_kernel, "greedy_sample_masked"),
            (bitmask_kernel, "apply_token_bitmask_"),
            (bitmask, "apply_token_bitmask_torch_"),
            (sampler, "apply_token_bitmask_"),
        ]
    )
    # the engine's part: starting each step's fill, advancing the matchers by the new tokens
    engine_timer = _Timer(
        [
            (manager_mod.StructuredOutputManager, "prepare_step"),
            (manager_mod.StructuredOutputManager, "accept_token"),
        ]
    )
    real_supported = bitmask_kernel.supported
    impls = ["native", "torch"] if ns.mask_impl == "both" else [ns.mask_impl]

    runs: list[dict] = []
    lengths: list[int] | None = None

    def constrained_run(rep: int, impl: str) -> None:
        nonlocal lengths
        bitmask_kernel.supported = real_supported if impl == "native" else (lambda *a: False)
        try:
            before = manager.stats.as_dict()
            timer.seconds = engine_timer.seconds = 0.0
            secs, lens = _run(llm, requests, constrained)
        finally:
            bitmask_kernel.supported = real_supported
        after = manager.stats.as_dict()
        rows = after["rows"] - before["rows"]
        runs.append(
            {
                "run": f"constrained/{impl}",
                "repeat": rep,
                "output_tokens": sum(lens),
                "seconds": secs,
                "output_tok_s": sum(lens) / secs,
                "mask_rows": rows,
                "fill_ms_per_token": 1e3 * (after["fill_s"] - before["fill_s"]) / max(rows, 1),
                "wait_ms_per_token": 1e3 * (after["wait_s"] - before["wait_s"]) / max(rows, 1),
                "sampler_mask_ms_per_token": 1e3 * timer.seconds / max(rows, 1),
                "engine_ms_per_token": 1e3 * engine_timer.seconds / max(rows, 1),
                # constraint work (fill + sampler + engine parts) over the run's time: a bound on the
                # constraint's cost that a machine's load scales on both sides
                "mask_share": (after["fill_s"] - before["fill_s"] + timer.seconds + engine_timer.seconds)
                / secs,
            }
        )
        if lengths is None:
            lengths = lens
        elif lens != lengths:
            print(f"note: constrained output lengths changed in repeat {rep} ({impl})", file=sys.stderr)

    def plain_run(rep: int) -> None:
        assert lengths is not None
        plain = [SamplingParams(max_tokens=max(n, 1), temperature=0, ignore_eos=True) for n in lengths]
        secs, lens = _run(llm, requests, plain)
        runs.append(
            {
                "run": "unconstrained",
                "repeat": rep,
                "output_tokens": sum(lens),
                "seconds": secs,
                "output_tok_s": sum(lens) / secs,
            }
        )

    # ABC, then CBA, ...: a load that drifts during a repeat favours no run on average.
    for rep in range(ns.repeats):
        if rep % 2 == 0:
            for impl in impls:
                constrained_run(rep, impl)
            plain_run(rep)
        else:
            plain_run(rep)
            for impl in reversed(impls):
                constrained_run(rep, impl)

    ratios: dict[str, list[float]] = {}
    for rep in range(ns.repeats):
        u = next(r for r in runs if r["run"] == "unconstrained" and r["repeat"] == rep)
        for r in runs:
            if r["repeat"] == rep and r["run"] != "unconstrained":
                ratios.setdefault(r["run"], []).append(r["output_tok_s"] / u["output_tok_s"])
    res = {
        "dtype": ns.dtype,
        "num_requests": len(requests),
        "schema": SCHEMA,
        "runs": runs,
        "ratios": ratios,
        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "target_ratio": 0.9,
        "first_compile_with_tokenizer_view_s": first_compile_s,
        "compile_s_per_new_schema": compile_s,
        "compile_s_per_new_schema_mean": statistics.mean(compile_s) if compile_s else None,
        "first_mask_s_per_new_schema": first_mask_s,
    }
    print(
        f"{'run':22} {'rep':>3} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'fill':>6} {'wait':>6} {'mask':>6} {'engine':>6} {'share':>6}"
    )
    for r in runs:
        extra = (
            f" {r['fill_ms_per_token']:6.3f} {r['wait_ms_per_token']:6.3f} {r['sampler_mask_ms_per_token']:6.3f}"
            f" {r['engine_ms_per_token']:6.3f}"
            f" {100 * r['mask_share']:5.1f}%"
            if "mask_rows" in r
            else ""
        )
        print(
            f"{r['run']:22} {r['repeat']:3d} {r['output_tokens']:7d} {r['seconds']:8.1f} "
            f"{r['output_tok_s']:7.1f}{extra}"
        )
    print(
        "(fill / wait / mask / engine: ms per constrained token, wait part of mask; share: their sum over the run time)"
    )
    for k, v in ratios.items():
        print(
            f"{k} / unconstrained: {', '.join(f'{x:.3f}' for x in v)} (median {statistics.median(v):.3f}; target >= 0.9)"
        )
    if compile_s:
        print(
            f"first compile incl. tokenizer view: {first_compile_s:.2f} s; new schema: compile mean "
            f"{statistics.mean(compile_s) * 1e3:.1f} ms (max {max(compile_s) * 1e3:.1f}), its first mask "
            f"mean {statistics.mean(first_mask_s) * 1e3:.1f} ms (max {max(first_mask_s) * 1e3:.1f})"
        )
    if ns.json_out:
        Path(ns.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json_out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
