"""``kvserve bench spec-decode``: speculation off vs n-gram vs draft model.

Workload (input-grounded, built here from real text shipped with Python: the language
reference of ``pydoc_data.topics`` and the source of stdlib modules): chat prompts that ask the
model to repeat, summarise or edit a passage ("repeat this passage", "summarise it, quoting its
key sentences", "rename this function in the code"), the passage cut to ``--prompt-len`` tokens
of the model's tokenizer, each request making ``--output-len`` tokens (``ignore_eos``). Written
as a workload JSONL like ``../shared/workloads/`` (``--write-workload``), with a ``.meta.json``.

Scenarios (``--scenarios``):

- ``single``: one request at a time (TPOT and output tok/s of a single user);
- ``concurrent``: ``--concurrency`` (8) requests at once;
- ``w64``: the shared w64 workload offline, all at once (not input-grounded: the auto-off
  rules must keep speculation from costing throughput there).

Methods (``--methods``): ``off``; ``ngram`` (prompt lookup, dynamic draft lengths: the
default policy); ``ngram-fixed`` (``"dynamic": false``: up to k drafts every step); ``draft``
/ ``draft-fixed`` (a draft model, dynamic / fixed; ``--draft-model``, by
default the target itself: no smaller model with this tokenizer exists offline here, so this
measures the draft path's cost per proposed token, not a realistic speed-up). Each method gets
its own engine; a warm-up request runs before timing. Reports per scenario and method: output
tok/s, mean TPOT (ms), the speed-up over ``off``, acceptance rate and mean accepted length
(tokens per verification) and, for the draft model, its milliseconds per proposed token (its
forwards, catch-up included), as a table and as JSON (``--json-out``).

``--speculative-config JSON`` (the engine's field names, without ``method``) is applied over
every speculating method's settings, e.g. ``'{"disable_by_batch_size": 16}'`` or
``'{"prompt_lookup_min": 1}'``; ``--w64-workload`` names the w64 file (default: the shared one).

``--num-speculative-tokens`` (k, default 8) is the most drafts per sequence and step; with
dynamic lengths it is only a cap (the policy fills fewer slots where they do not pay), and on
this workload a strong n-gram match keeps being accepted past 4 tokens (k = 8 gave
2.20x against k = 4's 2.02x one request at a time in float32, level at 8 concurrent).

``--rounds N`` (default 1) builds every method's engine up front and runs the scenarios N
times, the methods in turn within each round, reporting each method's best round (and every
round's tok/s): on a shared host whose speed drifts by +-10% between minutes, ratios of runs
made one right after the other are the only ones that mean anything. With 1, each method's
engine is built, run and dropped in turn (least memory).

Greedy (temperature 0), so every method must give the same tokens: the run checks it and
reports mismatches (a speculation bug, or a near-tie of float summation order).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.workload.io import write_json
from kvserve.workload.workload import BenchRequest, default_workload_path, load_workload

TASKS = (
    ("repeat", "Repeat the following passage exactly, word for word:\n\n{text}"),
    ("summarise", "Summarise the following passage, quoting its key sentences verbatim:\n\n{text}"),
    (
        "edit",
        "Rewrite the following Python code with the function `{old}` renamed to `{new}`; keep everything else the same:\n\n{text}",
    ),
)
#: stdlib modules whose source the "edit" prompts quote (any Python has them).
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "colorsys", "bisect", "heapq", "calendar")


def _passages() -> list[str]:
    """Blocks of the language reference (long enough to cut from), in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics) if len(topics[k]) > 1500]


def _code_blocks() -> list[tuple[str, str]]:
    """``(function name, source from its def on)`` of top-level functions of stdlib modules."""
    import importlib

    out = []
    for name in CODE_MODULES:
        mod = importlib.import_module(name)
        try:
            src = inspect.getsource(mod)
        except (OSError, TypeError):  # a Python without its sources
            continue
        for fn_name, fn in sorted(vars(mod).items()):
            if inspect.isfunction(fn) and fn.__module__ == name and not fn_name.startswith("_"):
                start = src.find(f"def {fn_name}(")
                if start >= 0:
                    out.append((fn_name, src[start:]))
    return out


def build_workload(tokenizer, num_requests: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
    """``num_requests`` chat prompts (tasks in turn) whose passage is cut to ``prompt_len``
    tokens (fewer only if the passage is shorter; a token is never more than 16 characters
    of this text); ``output_len`` tokens each.

    Raises:
        ValueError: ``prompt_len`` or ``output_len`` < 1, or no text to build from.
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    passages, code = _passages(), _code_blocks()
    if not passages or not code:
        raise ValueError("no passages found in pydoc_data.topics or the stdlib sources")
    reqs = []
    for i in range(num_requests):
        task, template = TASKS[i % len(TASKS)]
        if task == "edit":
            fn, src = code[(i // len(TASKS)) % len(code)]
            ids = tokenizer.encode(src[: 16 * prompt_len], add_special_tokens=False)[:prompt_len]
            content = template.format(old=fn, new=fn + "_v2", text=tokenizer.decode(ids))
        else:
            text = passages[(i // len(TASKS) * 7 + i) % len(passages)]
            ids = tokenizer.encode(text[: 16 * prompt_len], add_special_tokens=False)[:prompt_len]
            content = template.format(text=tokenizer.decode(ids))
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(prompt_ids, list):  # newer transformers return a BatchEncoding
            prompt_ids = list(prompt_ids["input_ids"])
        reqs.append(
            BenchRequest(prompt_token_ids=list(prompt_ids), output_len=output_len, prompt=content, id=i)
        )
    return reqs


def write_workload(path: Path, reqs: list[BenchRequest], args: dict[str, Any]) -> None:
    """Write ``reqs`` as a workload JSONL (the fields of ``../shared/workloads/``) and a
    ``.meta.json`` with the arguments, totals and the file's sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "id": r.id,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "arrival_s": 0.0,
                "prompt_token_ids": r.prompt_token_ids,
                "prompt": r.prompt,
            }
        )
        for r in reqs
    ]
    data = "\n".join(lines) + "\n"
    path.write_text(data)
    meta = {
        "args": args,
        "corpus": "pydoc_data.topics (CPython language reference) and stdlib sources "
        + ", ".join(CODE_MODULES),
        "tasks": [t for t, _ in TASKS],
        "n": len(reqs),
        "prompt_tokens_total": sum(r.prompt_len for r in reqs),
        "output_tokens_total": sum(r.output_len for r in reqs),
        "sha256": hashlib.sha256(data.encode()).hexdigest(),
    }
    Path(str(path) + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _overrides(value: str | None) -> dict[str, Any]:
    """``--speculative-config``: a JSON object of ``SpeculativeConfig`` fields but ``method``.

    Raises:
        ValueError: not a JSON object, or it names ``method`` (``--methods`` chooses it).
    """
    from kvserve.config import json_object

    extra = json_object(value, "--speculative-config") or {}
    if "method" in extra:
        raise ValueError("--speculative-config: give the method with --methods, not 'method'")
    return extra


def _spec_config(method: str, ns: argparse.Namespace) -> dict | None:
    """The engine's ``speculative_config`` for ``method`` (None for ``off``), with
    ``--speculative-config``'s fields over the benchmark's own; checked here, before any model
    loads.

    Raises:
        ValueError: an unknown method, or a bad field (naming ``speculative_config.<field>``).
    """
    from kvserve.config import SpeculativeConfig

    if method == "off":
        return None
    if method in ("ngram", "ngram-fixed"):
        cfg = {
            "method": "ngram",
            "num_speculative_tokens": ns.num_speculative_tokens,
            "prompt_lookup_min": ns.prompt_lookup_min,
            "prompt_lookup_max": ns.prompt_lookup_max,
            "dynamic": method == "ngram",
        }
    elif method in ("draft", "draft-fixed"):
        from kvserve.model_executor.model_loader import resolve_model_dir

        model = ns.draft_model or str(resolve_model_dir(ns.model))
        cfg = {
            "method": "draft_model",
            "model": model,
            "num_speculative_tokens": ns.num_speculative_tokens,
            "dynamic": method == "draft",
        }
    else:
        raise ValueError(
            f"--methods: unknown method {method!r} (off, ngram, ngram-fixed, draft, draft-fixed)"
        )
    extra = _overrides(ns.speculative_config)
    if cfg["method"] != "ngram":  # prompt lookup's fields mean nothing to a draft model
        extra = {k: v for k, v in extra.items() if not k.startswith("prompt_lookup_")}
    cfg.update(extra)
    SpeculativeConfig.from_value(cfg)
    return cfg


def _run(llm, reqs: list[BenchRequest], batch: int) -> dict[str, Any]:
    """Generate ``reqs`` ``batch`` at a time; output tok/s, TPOT and the speculation counters
    of this run (differences of the engine's totals)."""
    from kvserve import SamplingParams

    stats = llm.llm_engine.stats
    proposer = getattr(llm.llm_engine.executor, "proposer", None)
    p0 = (getattr(proposer, "propose_seconds", 0.0), getattr(proposer, "num_proposed_tokens", 0))
    d0 = (getattr(stats, "spec_num_drafts", 0), getattr(stats, "spec_num_draft_tokens", 0))
    o0 = getattr(stats, "spec_num_draft_opportunities", 0)
    a0 = getattr(stats, "spec_num_accepted_tokens", 0)
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        part = reqs[i : i + batch]
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in part]
        outs += llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in part], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [o.metrics.tpot(len(o.outputs[0].token_ids)) for o in outs]
    tpots = [t for t in tpots if t is not None]
    drafts = getattr(stats, "spec_num_drafts", 0) - d0[0]
    draft_tokens = getattr(stats, "spec_num_draft_tokens", 0) - d0[1]
    accepted = getattr(stats, "spec_num_accepted_tokens", 0) - a0
    opportunities = getattr(stats, "spec_num_draft_opportunities", 0) - o0
    propose_s = getattr(proposer, "propose_seconds", 0.0) - p0[0]
    proposed = getattr(proposer, "num_proposed_tokens", 0) - p0[1]
    return {
        "seconds": secs,
        "output_tokens": n_out,
        "output_tok_s": n_out / secs if secs else 0.0,
        "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
        "num_verifications": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_len": 1 + accepted / drafts if drafts else None,
        # drafted tokens per decode sequence-step with lookahead slots (the dynamic choice)
        "mean_draft_len": draft_tokens / opportunities if opportunities else None,
        # a draft model's cost: its forwards (catch-up included) per token it proposed
        "draft_ms_per_proposed_token": 1000 * propose_s / proposed if proposed else None,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvserve bench spec-decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="target model dir (default: the default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--draft-model", default=None, help="draft model dir (default: the target itself)")
    p.add_argument("--methods", default="off,ngram,draft")
    p.add_argument("--scenarios", default="single,concurrent,w64")
    p.add_argument("--num-requests", type=int, default=8, help="input-grounded requests per scenario")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256, help="passage tokens per prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--w64-prompts", type=int, default=None, help="first N w64 requests (default all)")
    p.add_argument("--w64-max-output", type=int, default=None, help="cap w64 output lengths")
    p.add_argument(
        "--num-speculative-tokens", type=int, default=8, help="k: the most drafts per sequence and step"
    )
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument(
        "--speculative-config",
        default=None,
        help="JSON: engine speculative_config fields (not method) over every speculating method's",
    )
    p.add_argument("--w64-workload", default=None, help="the w64 workload JSONL (default: the shared one)")
    p.add_argument("--write-workload", default=None, help="also write the input-grounded workload JSONL here")
    p.add_argument(
        "--rounds", type=int, default=1, help="runs of every scenario, methods in turn; best reported"
    )
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    for flag in (
        "rounds",
        "num_requests",
        "concurrency",
        "prompt_len",
        "output_len",
        "num_speculative_tokens",
    ):
        if getattr(ns, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}", file=sys.stderr)
            return 2
    for flag in ("w64_prompts", "w64_max_output"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}", file=sys.stderr)
            return 2

    from kvserve import LLM
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    methods = [m for m in ns.methods.split(",") if m]
    scenarios = [s for s in ns.scenarios.split(",") if s]
    if not methods or not scenarios:
        print("error: --methods and --scenarios must each name at least one", file=sys.stderr)
        return 2
    bad = [s for s in scenarios if s not in ("single", "concurrent", "w64")]
    if bad:
        print(f"error: --scenarios: unknown {bad} (single, concurrent, w64)", file=sys.stderr)
        return 2
    specs: dict[str, dict | None] = {}
    for method in methods:
        try:
            specs[method] = _spec_config(method, ns)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if ns.w64_workload and "w64" in scenarios and not Path(ns.w64_workload).is_file():
        print(f"error: --w64-workload {ns.w64_workload}: no such file", file=sys.stderr)
        return 2
    try:
        tok = load_tokenizer(resolve_model_dir(ns.model))
    except (ValueError, OSError) as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
    grounded = build_workload(tok, ns.num_requests, ns.prompt_len, ns.output_len)
    if ns.write_workload:
        write_workload(Path(ns.write_workload), grounded, vars(ns))
    work: dict[str, tuple[list[BenchRequest], int]] = {}
    if "single" in scenarios:
        work["single"] = (grounded, 1)
    if "concurrent" in scenarios:
        work["concurrent"] = (grounded, ns.concurrency)
    if "w64" in scenarios:
        path = Path(ns.w64_workload) if ns.w64_workload else default_workload_path()
        if path.is_file():
            w64 = load_workload(path, ns.w64_prompts)
            if ns.w64_max_output is not None:
                for r in w64:
                    r.output_len = min(r.output_len, ns.w64_max_output)
            work["w64"] = (w64, len(w64))
        else:
            print(f"note: {path} not found; skipping the w64 scenario (--w64-workload names the file)")

    def engine(method: str):
        llm = LLM(model=ns.model, dtype=ns.dtype, speculative_config=specs[method])
        _run(llm, grounded[:1], 1)  # warm-up
        return llm

    try:
        return _measure(ns, methods, work, specs, engine)
    except ValueError as e:  # the engine's (a draft model, a prompt past the context): named
        print(f"error: {e}", file=sys.stderr)
        return 2


def _measure(ns: argparse.Namespace, methods: list[str], work: dict, specs: dict, engine) -> int:
    """Build each method's engine (``engine(method)``), run every scenario of ``work``, print
    the table and write the JSON; ``main``'s second half.

    Raises:
        ValueError: an engine refused its settings or a request.
    """
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in methods} for s in work}
    if ns.rounds == 1:
        for method in methods:
            llm = engine(method)
            for scen, (reqs, batch) in work.items():
                runs[scen][method].append(_run(llm, reqs, batch))
            del llm
    else:
        llms = {method: engine(method) for method in methods}
        for _ in range(ns.rounds):
            for scen, (reqs, batch) in work.items():
                for method, llm in llms.items():
                    runs[scen][method].append(_run(llm, reqs, batch))
        del llms
    results: dict[str, dict[str, Any]] = {s: {} for s in work}
    for scen, by_method in runs.items():
        for method, rs in by_method.items():
            best = dict(max(rs, key=lambda r: r["output_tok_s"]))
            best["rounds_output_tok_s"] = [r["output_tok_s"] for r in rs]
            # greedy: every round must give off's tokens, not only the best one
            best["_all_token_ids"] = [r["token_ids"] for r in rs]
            results[scen][method] = best

    rows = []
    for scen, best_by_method in results.items():
        base = best_by_method.get("off")
        for method, r in best_by_method.items():
            r["speedup"] = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else None
            r["same_tokens_as_off"] = (
                None if base is None else all(t == base["token_ids"] for t in r["_all_token_ids"])
            )
            rows.append(
                [
                    scen,
                    method,
                    r["output_tokens"],
                    r["output_tok_s"],
                    r["tpot_ms"],
                    None if r["speedup"] is None else f"{r['speedup']:.2f}x",
                    r["acceptance_rate"],
                    r["mean_accepted_len"],
                    r["mean_draft_len"],
                    r["draft_ms_per_proposed_token"],
                    r["same_tokens_as_off"],
                ]
            )
    print(
        fmt_table(
            [
                "scenario",
                "method",
                "out tok",
                "out tok/s",
                "TPOT ms",
                "vs off",
                "accept",
                "mean acc len",
                "draft len",
                "draft ms/tok",
                "same",
            ],
            rows,
        )
    )
    if ns.rounds > 1:
        print(f"output tok/s of each of the {ns.rounds} rounds (the table: the best):")
        for scen, best_by_method in results.items():
            for method, r in best_by_method.items():
                print(f"  {scen} {method}: " + ", ".join(f"{x:.1f}" for x in r["rounds_output_tok_s"]))
    if ns.json_out:
        for best_by_method in results.values():
            for r in best_by_method.values():
                r.pop("token_ids", None)
                r.pop("_all_token_ids", None)
        write_json(
            ns.json_out,
            {"benchmark": "spec_decode", "args": vars(ns), "system": system_info(), "results": results},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
