"""``kvserve bench throughput``: offline throughput of kvserve vs transformers ``generate``.

The same requests (token ids in, ``max_tokens = output_len``, ``ignore_eos``, greedy) go through
``LLM.generate`` (all submitted at once, continuous batching) and then, in the same process,
through transformers' ``generate`` in static batches of each ``--baseline-batch-sizes`` (left
padding; every batch generates its longest ``output_len`` with ``min_new_tokens=max_new_tokens``,
so it does at least the same work; only each request's own ``output_len`` tokens count as useful
output). kvserve runs first so its peak RSS (``getrusage``) is not inflated by the baseline.
``--model-impl transformers`` runs kvserve's transformers fallback instead of the native family
(``--no-baseline --model-impl native`` vs ``transformers`` compares the two on the same engine).
Each engine's output tok/s is also given as a percentage of the floor of the workload on this
host (``kvserve bench roof``: every request in one batch; ``--no-roof`` skips it).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

from kvserve.benchmarks.common import current_rss_mib, fmt_table, peak_rss_mib, system_info
from kvserve.benchmarks.roof import add_roof_args
from kvserve.workload.io import write_json
from kvserve.workload.workload import (
    BenchRequest,
    default_workload_path,
    load_corpus,
    load_workload,
    synthetic_requests,
)


def add_workload_args(p: argparse.ArgumentParser, default_workload: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default=None,
        help="workload JSONL (prompt_token_ids, output_len); default "
        + (f"{default_workload_path()}" if default_workload else "none"),
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="with --workload (or --trace, for bench serve): use the first N requests; "
        "with --input-len: N synthetic requests",
    )
    g.add_argument("--input-len", type=int, default=None, help="synthetic prompts of this many corpus tokens")
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="synthetic output length (or override every request's output_len)",
    )
    g.add_argument("--workload-seed", type=int, default=0, help="seed for synthetic prompts and arrivals")


def requests_from_args(ns) -> tuple:
    """``(requests, description)`` from the workload flags.

    Raises:
        ValueError: inconsistent flags.
    """
    if ns.input_len is not None and ns.workload is None:
        if ns.num_prompts is None or ns.output_len is None:
            raise ValueError("synthetic workload needs --num-prompts, --input-len and --output-len")
        reqs = synthetic_requests(
            ns.num_prompts, ns.input_len, ns.output_len, load_corpus(), seed=ns.workload_seed
        )
        return reqs, f"synthetic {ns.num_prompts} x (in {ns.input_len}, out {ns.output_len})"
    path = ns.workload or str(default_workload_path())
    reqs = load_workload(path, ns.num_prompts)
    if ns.output_len is not None:
        for r in reqs:
            r.output_len = ns.output_len
    return reqs, path


def _work(reqs: list[BenchRequest]) -> dict:
    return {
        "num_requests": len(reqs),
        "prompt_tokens": sum(r.prompt_len for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
    }


def _rates(n_req: int, prompt_tokens: int, out_tokens: int, seconds: float) -> dict:
    s = max(seconds, 1e-9)
    return {
        "elapsed_s": seconds,
        "requests_per_s": n_req / s,
        "output_tokens_per_s": out_tokens / s,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / s,
    }


def run_kvserve(
    reqs: list[BenchRequest], engine_kwargs: dict, use_tqdm: bool = True, warmup: int = 1
) -> dict:
    """Runs ``reqs`` through ``LLM.generate``; returns throughput, memory, timeline and the LLM.

    ``warmup`` tiny requests (the first prompt's first 16 tokens, 2 output tokens) run before the
    clock starts, as vLLM warms its model up inside ``LLM()``; their time is reported as ``warmup_s``."""
    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    load_s = time.perf_counter() - t0
    tw = time.perf_counter()
    for _ in range(warmup):
        llm.generate(
            [{"prompt_token_ids": reqs[0].prompt_token_ids[:16]}],
            SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
            use_tqdm=False,
        )
    warmup_s = time.perf_counter() - tw
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs]
    wall0 = time.time()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    gen_s = time.perf_counter() - t1
    produced = [len(o.outputs[0].token_ids) if o.outputs else 0 for o in outs]
    short = sum(p < r.output_len for p, r in zip(produced, reqs))
    useful = sum(min(p, r.output_len) for p, r in zip(produced, reqs))
    work = _work(reqs)
    res = {
        "engine": "kvserve",
        "load_s": load_s,
        "warmup_s": warmup_s,
        **_rates(len(reqs), work["prompt_tokens"], useful, gen_s),
        "output_tokens": useful,
        "requests_short_of_output_len": short,
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_mib": current_rss_mib(),
    }
    try:
        res["dtype"] = str(llm.llm_engine.model_config.resolved_dtype()).replace("torch.", "")
    except Exception:
        pass
    # the implementation that ran (``--model-impl``): the native family or the transformers fallback
    worker = getattr(llm.llm_engine.executor, "worker", llm.llm_engine.executor)
    res["model_impl"] = "transformers" if getattr(worker, "uses_fallback", False) else "native"
    try:
        res["kv_cache"] = llm.llm_engine.get_kv_cache_stats()
    except Exception:
        pass
    ttfts = [o.metrics.ttft for o in outs if o.metrics and o.metrics.ttft is not None]
    if ttfts:
        from kvserve.workload.stats import summarize

        res["ttft_ms"] = summarize(ttfts, scale=1000)
        res["tpot_ms"] = summarize(
            [o.metrics.tpot(len(o.outputs[0].token_ids)) for o in outs if o.metrics and o.outputs], scale=1000
        )
    if engine_kwargs.get("speculative_config"):  # the requests' own counts, this run only
        drafted = sum(o.spec_num_draft_tokens for o in outs)
        accepted = sum(o.spec_num_accepted_tokens for o in outs)
        res["spec_decode"] = {
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
        }
    res["timeline"] = timeline_from_engine(llm, wall0, num_submitted=len(reqs))
    res["_llm"] = llm
    return res


def timeline_from_engine(llm, t0: float, max_points: int = 5000, num_submitted: int = 0) -> dict:
    """The engine's per-step queue timeline as columns, time relative to ``t0`` (downsampled).

    The engine records a row after each step; a first row at t=0 with every submitted request
    waiting is prepended so the plot shows the first step's duration."""
    tl = [row for row in list(llm.llm_engine.stats.timeline) if row[0] >= t0 - 1e-6]
    step = max(1, math.ceil(len(tl) / max_points))
    tl = tl[::step]
    if num_submitted:
        tl = [(t0, 0, num_submitted, 0, 0.0)] + tl
    return {
        "time_s": [r[0] - t0 for r in tl],
        "running": [r[1] for r in tl],
        "waiting": [r[2] for r in tl],
        "swapped": [r[3] for r in tl],
        "gpu_cache_usage": [r[4] for r in tl],
    }


def run_transformers(
    reqs: list[BenchRequest],
    model_dir: str,
    dtype,
    batch_sizes: list[int],
    use_tqdm: bool = True,
    warmup: int = 1,
    device: str = "cpu",
) -> list[dict]:
    """Static-batch transformers ``generate`` for each batch size (greedy, left padding), with
    the model and inputs on ``device`` (kvserve's, so both engines run on the same hardware)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    # transformers types ``PreTrainedModel.to`` through a decorator whose stub takes the model as
    # the first argument; the call itself is the ordinary ``nn.Module.to``
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)  # type: ignore[arg-type]
    model.eval()
    load_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        pad_id = 0
    work = _work(reqs)
    tw = time.perf_counter()
    for _ in range(warmup):
        with torch.inference_mode():
            model.generate(
                input_ids=torch.tensor([reqs[0].prompt_token_ids[:16]], device=device),
                max_new_tokens=2,
                min_new_tokens=2,
                do_sample=False,
                pad_token_id=pad_id,
            )
    sync()
    warmup_s = time.perf_counter() - tw
    results = []
    for bs in batch_sizes:
        bar = tqdm(
            total=len(reqs),
            desc=f"transformers bs={bs}",
            unit="req",
            disable=not use_tqdm,
            dynamic_ncols=True,
        )
        generated = 0
        t1 = time.perf_counter()
        for i in range(0, len(reqs), bs):
            batch = reqs[i : i + bs]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, r in enumerate(batch):
                ids[j, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
                mask[j, width - r.prompt_len :] = 1
            new = max(r.output_len for r in batch)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=pad_id,
                )
            generated += (out.shape[1] - width) * len(batch)
            bar.update(len(batch))
        sync()
        secs = time.perf_counter() - t1
        bar.close()
        results.append(
            {
                "engine": "transformers",
                "batch_size": bs,
                "load_s": load_s,
                "warmup_s": warmup_s,
                **_rates(len(reqs), work["prompt_tokens"], work["output_tokens"], secs),
                "output_tokens": work["output_tokens"],
                "generated_tokens_incl_padding_work": generated,
            }
        )
    del model
    gc.collect()
    return results


def _pct(r: dict) -> str | None:
    pct = r.get("pct_of_roof")
    return None if pct is None else f"{pct:.0f}%"


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from kvserve.entrypoints.cli import add_engine_args

    p = p or argparse.ArgumentParser(
        prog="kvserve bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p)
    p.add_argument(
        "--baseline-batch-sizes",
        default="1,8,32",
        help="transformers static batch sizes, comma-separated (default 1,8,32)",
    )
    p.add_argument(
        "--baseline-num-prompts",
        type=int,
        default=None,
        help="run the transformers baseline on only the first N requests (its rate is per second, "
        "so it stays comparable; bs=1 over w64 takes ~15 min on 2 cores)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--json-out", default=None, help="write the results here as JSON")
    p.add_argument("--plot-dir", default=None, help="write the kvserve queue/KV-cache timeline PNG here")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="tiny untimed requests per engine before the clock starts (vLLM warms up inside LLM())",
    )
    add_roof_args(p)
    add_engine_args(p)
    return p


def roof_row(
    reqs: list[BenchRequest], model_dir: str, torch_dtype, quantization, remeasure: bool, threads: int
) -> dict:
    """The floor of ``reqs`` offline on this host at ``threads`` threads (``roof.floor_report``),
    output tok/s."""
    from kvserve.benchmarks.roof import floor_report, read_config, weight_dtype
    from kvserve.sim.roofline import offline_steps

    steps = offline_steps([(r.prompt_len, r.output_len) for r in reqs])
    dtype = weight_dtype(torch_dtype, quantization)
    return floor_report(
        "offline",
        read_config(model_dir),
        dtype,
        steps,
        sum(r.output_len for r in reqs),
        "output tok/s",
        remeasure,
        threads,
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    import dataclasses

    from kvserve.entrypoints.cli import checked_engine_args

    args = checked_engine_args(ns)  # the settings first: nothing is read for a bad one
    if args is None:
        return 2
    try:
        reqs, source = requests_from_args(ns)
        batch_sizes = [int(x) for x in ns.baseline_batch_sizes.split(",") if x.strip()]
        if any(b < 1 for b in batch_sizes):
            raise ValueError("--baseline-batch-sizes must be positive integers")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine_kwargs = dataclasses.asdict(args)
    work = _work(reqs)
    print(
        f"workload: {source}: {work['num_requests']} requests, {work['prompt_tokens']} prompt + "
        f"{work['output_tokens']} output tokens"
    )
    use_tqdm = not ns.no_tqdm

    import torch

    threads = torch.get_num_threads()  # the engine may lower torch's count: the roof takes this one
    kv = run_kvserve(reqs, engine_kwargs, use_tqdm=use_tqdm, warmup=ns.warmup_requests)
    llm = kv.pop("_llm")
    from kvserve.model_executor.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir(ns.model))
    torch_dtype = llm.llm_engine.model_config.resolved_dtype()
    device = llm.llm_engine.model_config.resolved_device()
    del llm
    gc.collect()
    print(
        f"kvserve ({kv['model_impl']} model): {kv['output_tokens_per_s']:.1f} output tok/s in {kv['elapsed_s']:.1f} s "
        f"(load {kv['load_s']:.1f} s, warm-up {kv['warmup_s']:.1f} s, peak RSS {kv['peak_rss_mib']:.0f} MiB)"
    )

    baseline: list[dict] = []
    if not ns.no_baseline and batch_sizes:
        breqs = reqs[: ns.baseline_num_prompts] if ns.baseline_num_prompts else reqs
        baseline = run_transformers(
            breqs,
            model_dir,
            torch_dtype,
            batch_sizes,
            use_tqdm=use_tqdm,
            warmup=ns.warmup_requests,
            device=device,
        )
    best = max(baseline, key=lambda r: r["output_tokens_per_s"], default=None)
    roof = None
    if not ns.no_roof:
        from kvserve.benchmarks.roof import percent_of_roof, weight_dtype

        quantization = engine_kwargs.get("quantization")
        try:
            roof = roof_row(reqs, model_dir, torch_dtype, quantization, ns.remeasure, threads)
            kv["pct_of_roof"] = percent_of_roof(kv["output_tokens_per_s"], roof)
            if baseline:  # its own requests (--baseline-num-prompts) and float weights: its own floor
                breqs = reqs[: ns.baseline_num_prompts] if ns.baseline_num_prompts else reqs
                broof = roof
                if len(breqs) < len(reqs) or weight_dtype(torch_dtype) != roof["dtype"]:
                    broof = roof_row(breqs, model_dir, torch_dtype, None, False, threads)
                for b in baseline:
                    b["pct_of_roof"] = percent_of_roof(b["output_tokens_per_s"], broof)
        except ValueError as e:  # a config the floor cannot read: the run's figures stand alone
            print(f"warning: no roof: {e}", file=sys.stderr)
            roof = None

    rows = [
        [
            "kvserve" if kv["model_impl"] == "native" else "kvserve (transformers fallback)",
            kv.get("dtype", ns.dtype),
            "continuous",
            kv["requests_per_s"],
            kv["output_tokens_per_s"],
            kv["total_tokens_per_s"],
            f"{kv['output_tokens_per_s'] / best['output_tokens_per_s']:.2f}x" if best else None,
            f"{kv['peak_rss_mib']:.0f}",
            _pct(kv),
        ]
    ]
    for b in baseline:
        rows.append(
            [
                "transformers",
                str(torch_dtype).replace("torch.", ""),
                f"static bs={b['batch_size']}",
                b["requests_per_s"],
                b["output_tokens_per_s"],
                b["total_tokens_per_s"],
                None,
                None,
                _pct(b),
            ]
        )
    print()
    print(
        fmt_table(
            [
                "engine",
                "dtype",
                "batching",
                "req/s",
                "output tok/s",
                "total tok/s",
                "kvserve / best transformers",
                "peak RSS MiB",
                "% of roof",
            ],
            rows,
        )
    )
    if roof:
        print(
            f"roof: {roof['floor_rate']:.1f} output tok/s ({roof['bound']}-bound, {roof['dtype']} at "
            f"{roof['peak_gflops']:.0f} GFLOP/s and {roof['bandwidth_gb_s']:.1f} GB/s, {roof['threads']} threads)"
        )
    if "spec_decode" in kv:
        sd = kv["spec_decode"]
        rate = "-" if sd["acceptance_rate"] is None else f"{sd['acceptance_rate']:.0%}"
        print(
            f"speculative decoding: {sd['num_draft_tokens']} draft tokens proposed, "
            f"{sd['num_accepted_tokens']} accepted ({rate})"
        )
    if kv["requests_short_of_output_len"]:
        print(
            f"warning: {kv['requests_short_of_output_len']} kvserve requests produced fewer than output_len tokens"
        )

    result = {
        "benchmark": "throughput",
        "workload": source,
        **work,
        "engine_args": engine_kwargs,
        "model_dir": model_dir,
        "system": system_info(),
        "kvserve": kv,
        "transformers": baseline,
        "roof": roof,
        "ratio_vs_best_transformers": kv["output_tokens_per_s"] / best["output_tokens_per_s"]
        if best
        else None,
    }
    if ns.plot_dir:
        from kvserve.benchmarks import plots

        path = plots.plot_timeline(
            kv["timeline"], f"{ns.plot_dir}/throughput_timeline.png", title=f"kvserve offline: {source}"
        )
        print(f"plot: {path}")
    if ns.json_out:
        write_json(ns.json_out, result)
        print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
