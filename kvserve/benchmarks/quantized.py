"""``kvserve bench quantized``: batch-1 decode of the quantized paths against float32 / bfloat16,
and against llama.cpp's ``llama-server`` on the same GGUF file (``--peer llama.cpp``); ``--w64``:
the fixed w64 workload offline per format.

Batch 1: all kvserve engines live in one process and run alternately with the peer, one request
at a time (the machine is shared: alternating spreads other load over all of them), ``--rounds``
times each, on one chat prompt (the model's chat template, its default system prompt included:
54 tokens for the default model) tokenized once by kvserve: both engines get the same token ids.
Per run: decode rate = 1 / TPOT (TPOT = (finished - first token) / (output tokens - 1); for
llama-server its ``timings.predicted_ms / (predicted_n - 1)``), overall output tok/s (wall
clock, prefill included), TTFT (llama-server: ``timings.prompt_ms``). The table gives medians,
ratios against llama.cpp and kvserve bfloat16, the weight bytes one decode step reads (linear
layers + LM head) and the bandwidth that implies, load time and memory (kvserve: resident-memory
growth of each load in this process; llama-server: its own RSS and peak RSS from /proc).

``--w64``: ``../shared/workloads/w64.jsonl`` (64 requests at once, continuous batching) through
kvserve bfloat16, ``--quantization gguf`` and ``--quantization int8``, each in its own child
process (so peak RSS and load time are per format), and with ``--peer llama.cpp`` through
llama-server with ``-np`` slots (all requests sent at once, continuous batching on its side too):
output tok/s and ratios against bfloat16.

The llama-server binary comes from ``bash benchmarks/llama_cpp/setup.sh``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvserve.benchmarks.common import fmt_ratio, fmt_table, system_info
from kvserve.workload.io import write_json

#: The batch-1 request, rendered by the model's own chat template (``PROMPT`` is the fallback
#: for a tokenizer without one).
CHAT_MESSAGES = [
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle, "
        "and what she decides to do about it.",
    }
]
PROMPT = "<|im_start|>user\n" + CHAT_MESSAGES[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
#: kvserve engine configurations, by the name the table shows.
PATHS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "gguf float32": dict(dtype="float32", quantization="gguf"),
    "gguf bfloat16": dict(dtype="bfloat16", quantization="gguf"),
    "int8 float32": dict(dtype="float32", quantization="int8"),
    "int8 bfloat16": dict(dtype="bfloat16", quantization="int8"),
    "int4 float32": dict(dtype="float32", quantization="int4"),
}
#: Formats of the ``--w64`` run (bfloat16 is the baseline of its ratios): the bfloat16-activation
#: quantized paths compare like with like (bfloat16 KV cache and attention), the float32 ones are
#: reported too.
W64_PATHS = ("bfloat16", "gguf bfloat16", "int8 bfloat16", "gguf float32", "int8 float32")
PEERS = ("llama.cpp",)
PEER_ROW = "llama.cpp"


def add_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch-1 / w64 flags (shared by ``kvserve bench quantized`` and
    ``benchmarks/quantized.py``, which adds ``--kernels``)."""
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf file for every row, kvserve's and the peer's (default: the default model's GGUF)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="runs per engine (medians are reported)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (ignore_eos)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {list(PATHS)}")
    ap.add_argument("--peer", default=None, choices=PEERS, help="also run this engine on the same GGUF file")
    ap.add_argument("--peer-binary", default=None, help="llama-server executable (default: setup.sh's)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama-server -t/-tb (default: the usable cores, kvserve's own upper bound; "
        "KVSERVE_NUM_THREADS fixes kvserve's count)",
    )
    ap.add_argument("--w64", action="store_true", help="the w64 workload offline instead of batch 1")
    ap.add_argument("--w64-paths", default=",".join(W64_PATHS), help="kvserve formats of the --w64 run")
    ap.add_argument("--num-prompts", type=int, default=None, help="--w64: only the first N requests")
    ap.add_argument(
        "--workload", default=None, help="--w64: workload JSONL (default ../shared/workloads/w64.jsonl)"
    )
    ap.add_argument("--peer-parallel", type=int, default=64, help="--w64: llama-server -np slots")
    ap.add_argument("--json-out", default=None, help="write the results here as JSON")
    ap.add_argument("--w64-one", default=None, help=argparse.SUPPRESS)  # run_w64's child
    return ap


def build_parser() -> argparse.ArgumentParser:
    return add_args(
        argparse.ArgumentParser(
            prog="kvserve bench quantized",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def check_args(args: argparse.Namespace) -> list[str]:
    """The kvserve paths named by ``--paths`` (or ``--w64-paths``), validated.

    Raises:
        ValueError: an unknown path name, or a count below 1 (the message names the flag).
    """
    flag = "--w64-paths" if args.w64 else "--paths"
    names = [p.strip() for p in (args.w64_paths if args.w64 else args.paths).split(",") if p.strip()]
    bad = [n for n in names if n not in PATHS]
    if bad:
        raise ValueError(f"{flag}: unknown {bad}; choose from {list(PATHS)}")
    if not names and not args.peer:
        raise ValueError(f"{flag} is empty and there is no --peer: nothing to run")
    for flag_name, v in (
        ("--rounds", args.rounds),
        ("--max-tokens", args.max_tokens),
        ("--threads", peer_threads(args)),
        ("--peer-parallel", args.peer_parallel),
    ):
        if v < 1:
            raise ValueError(f"{flag_name} must be >= 1, got {v}")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (TPOT needs two tokens), got {args.max_tokens}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.model is not None and not (args.model.endswith(".gguf") and Path(args.model).is_file()):
        raise ValueError(f"--model must be an existing .gguf file (both engines read it), got {args.model!r}")
    return names


def gguf_file(args: argparse.Namespace) -> Path:
    """The GGUF every row runs: ``--model``, else the default model's file."""
    if args.model is not None:
        return Path(args.model)
    from kvserve.model_executor.model_loader import default_gguf_path

    return default_gguf_path()


def engine_kwargs(args: argparse.Namespace, name: str) -> dict:
    """``LLM(...)`` keywords of kvserve row ``name`` (``model=`` only with ``--model``)."""
    return {**PATHS[name], **({"model": args.model} if args.model else {})}


def peer_threads(args: argparse.Namespace) -> int:
    """``--threads``, or the cores this process may run on (kvserve's maximum)."""
    if args.threads is not None:
        return args.threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step_weight_bytes(model, layers: bool = True) -> int:
    """Bytes of weights one decode step reads: every linear weight and the LM head (only the LM
    head with ``layers=False``)."""
    from kvserve.ops.quant import QuantWeight

    def nbytes(w) -> int:
        if isinstance(w, QuantWeight):
            return w.nbytes
        out, inp = w.shape
        return out * inp * w.dtype.itemsize

    total = nbytes(model.lm_head)
    for layer in model.layers if layers else ():
        a, m = layer.self_attn, layer.mlp
        total += sum(nbytes(w) for w in (a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight))
    return total


def summarize_rows(runs: dict[str, list[dict]], info: dict[str, dict]) -> list[dict]:
    """Medians per engine plus ratios: ``x_llama_cpp_*`` against the llama.cpp row (when it ran)
    and ``x_bf16_*`` against kvserve bfloat16 (when it ran), for decode and overall tok/s.

    Args:
        runs: engine name -> per-run dicts with ``decode_tok_s``, ``overall_tok_s``, ``ttft_s``.
        info: engine name -> load figures (``load_s``, memory, ``step_weight_mb``; may be None).
    """
    rows = []
    for name, rs in runs.items():
        med = {}
        for k in ("decode_tok_s", "overall_tok_s", "ttft_s"):
            xs = [r[k] for r in rs if r.get(k) is not None]
            med[k] = statistics.median(xs) if xs else None
        mb = info.get(name, {}).get("step_weight_mb")
        gbps = mb * med["decode_tok_s"] / 1e3 if mb and med["decode_tok_s"] else None
        rows.append({"path": name, **info.get(name, {}), **med, "weights_gb_s": gbps, "runs": rs})
    by = {r["path"]: r for r in rows}
    for ref, prefix in ((PEER_ROW, "x_llama_cpp"), ("bfloat16", "x_bf16")):
        base = by.get(ref)
        for r in rows:
            for k in ("decode_tok_s", "overall_tok_s"):
                b = base[k] if base else None
                r[f"{prefix}_{k.removesuffix('_tok_s')}"] = r[k] / b if b and r[k] is not None else None
    return rows


#: The issue's batch-1 bounds: (row, ratio key of summarize_rows, bound, goal or None).
BATCH1_TARGETS = (
    ("gguf float32", "x_llama_cpp_decode", 1.0, 1.3),
    ("gguf float32", "x_llama_cpp_overall", 1.0, 1.3),
    ("gguf bfloat16", "x_llama_cpp_decode", 1.0, 1.3),
    ("gguf bfloat16", "x_llama_cpp_overall", 1.0, 1.3),
    ("gguf float32", "x_bf16_decode", 1.8, None),
    ("gguf bfloat16", "x_bf16_decode", 1.8, None),
    ("int8 float32", "x_bf16_decode", 1.7, None),
)
#: The issue's w64 bounds: output tok/s over kvserve bfloat16's.
W64_TARGETS = (
    ("gguf bfloat16", "x_bf16", 1.0, None),
    ("int8 bfloat16", "x_bf16", 1.0, None),
    ("gguf float32", "x_bf16", 1.0, None),
    ("int8 float32", "x_bf16", 1.0, None),
)


def check_targets(rows: list[dict], targets=BATCH1_TARGETS) -> list[dict]:
    """Each bound whose row and ratio were measured: ``{"path", "ratio", "value", "bound",
    "goal", "pass"}`` (rows or ratios that did not run are left out)."""
    by = {r["path"]: r for r in rows}
    out = []
    for path, key, bound, goal in targets:
        v = by.get(path, {}).get(key)
        if v is not None:
            out.append(
                {"path": path, "ratio": key, "value": v, "bound": bound, "goal": goal, "pass": v >= bound}
            )
    return out


def format_targets(checks: list[dict]) -> str:
    """One line per checked bound: PASS / FAIL, value, bound (and goal)."""
    return "\n".join(
        f"{'PASS' if c['pass'] else 'FAIL'}  {c['path']:<14} {c['ratio']:<20} {c['value']:.2f}x "
        f">= {c['bound']:.1f}x" + (f" (goal {c['goal']:.1f}x)" if c["goal"] else "")
        for c in checks
    )


def format_table(rows: list[dict]) -> str:
    """The batch-1 table (medians, ratios, load and memory) as text."""
    headers = [
        "path",
        "weights/step MB",
        "decode tok/s",
        "x llama.cpp",
        "x bf16",
        "overall tok/s",
        "x llama.cpp",
        "x bf16",
        "TTFT ms",
        "GB/s",
        "load s",
        "RSS MiB",
        "peak RSS MiB",
    ]
    body = []
    for r in rows:
        mem = r.get("rss_mib", r.get("rss_growth_mib"))
        body.append(
            [
                r["path"],
                r.get("step_weight_mb"),
                r["decode_tok_s"],
                fmt_ratio(r.get("x_llama_cpp_decode")),
                fmt_ratio(r.get("x_bf16_decode")),
                r["overall_tok_s"],
                fmt_ratio(r.get("x_llama_cpp_overall")),
                fmt_ratio(r.get("x_bf16_overall")),
                None if r["ttft_s"] is None else r["ttft_s"] * 1e3,
                r.get("weights_gb_s"),
                r.get("load_s"),
                mem,
                r.get("peak_rss_mib"),
            ]
        )
    note = (
        "RSS MiB: kvserve = growth of this process's RSS at that engine's load (all engines share "
        "one process, so no per-format peak); llama.cpp = llama-server's own RSS after warm-up, "
        "peak RSS = its VmHWM."
    )
    return fmt_table(headers, body) + "\n" + note


def gguf_step_weight_mb(path) -> float | None:
    """Weight bytes one decode step reads from a llama-architecture GGUF (every attention / MLP
    matrix and the LM head, which is ``token_embd`` when the file has no ``output.weight``), MB."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    total, head, embd = 0, None, None
    for t in GGUFReader(str(path)).tensors:
        if t.name == "output.weight":
            head = int(t.n_bytes)
        elif t.name == "token_embd.weight":
            embd = int(t.n_bytes)
        elif t.name.startswith("blk.") and t.name.split(".")[2] in names:
            total += int(t.n_bytes)
    return (total + (head if head is not None else embd or 0)) / 1e6


def chat_prompt(tok) -> str:
    """``CHAT_MESSAGES`` through ``tok``'s chat template (with the generation prompt), or
    ``PROMPT`` when the tokenizer has no template."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    return PROMPT


def prompt_token_ids(llm=None, gguf: Path | None = None) -> tuple[str, list[int]]:
    """``(text, token ids)`` of the chat prompt, by ``llm``'s tokenizer (or, when no kvserve
    engine runs, ``gguf``'s, else the default model's); both engines get these ids, so they see
    exactly the same prompt (the template's special tokens included, no extra BOS)."""
    from transformers import AutoTokenizer

    if llm is not None:
        tok = llm.get_tokenizer()
    elif gguf is not None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        from kvserve.model_executor.model_loader import resolve_model_dir

        tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    text = chat_prompt(tok)
    return text, list(tok.encode(text, add_special_tokens=False))


def greedy_agreement(tokens: dict[str, list[int]]) -> dict[str, int] | None:
    """How many leading greedy tokens each kvserve engine shares with llama.cpp's output (same
    file, same prompt: the gguf rows should agree for a long stretch, until a near-tie between
    two logits tips differently); ``None`` without a llama.cpp output."""
    ref = tokens.get(PEER_ROW)
    if not ref:
        return None
    out = {}
    for name, toks in tokens.items():
        if name != PEER_ROW:
            n = 0
            while n < min(len(ref), len(toks)) and ref[n] == toks[n]:
                n += 1
            out[name] = n
    return out


def run_batch1(args: argparse.Namespace, names: list[str]) -> dict:
    """The alternating batch-1 run; returns the JSON document (also printed as a table)."""
    from kvserve import LLM, SamplingParams

    engines: dict = {}
    info: dict[str, dict] = {}
    for name in names:
        rss0, t0 = _rss_mib(), time.perf_counter()
        llm = LLM(num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=1, **engine_kwargs(args, name))
        model = llm.llm_engine.executor.model
        info[name] = {
            "load_s": time.perf_counter() - t0,
            "rss_growth_mib": _rss_mib() - rss0,
            "step_weight_mb": step_weight_bytes(model) / 1e6,
        }
        engines[name] = llm
        print(f"loaded {name}: {info[name]}", file=sys.stderr, flush=True)
    prompt_text, prompt_ids = prompt_token_ids(
        next(iter(engines.values()), None), args.model and gguf_file(args)
    )
    server = None
    peer_cmd = None
    if args.peer:
        from kvserve.benchmarks.llama_cpp import LlamaServer

        gguf = gguf_file(args)
        server = LlamaServer(gguf, threads=peer_threads(args), parallel=1, binary=args.peer_binary).start()
        peer_cmd = server.command()
        # the same file as kvserve's gguf rows: their step bytes if one ran, else read the file
        mb = next((info[n]["step_weight_mb"] for n in names if PATHS[n].get("quantization") == "gguf"), None)
        info[PEER_ROW] = {
            "load_s": server.load_s,
            "step_weight_mb": mb or gguf_step_weight_mb(gguf),
            "gguf": str(gguf),
        }
        print(
            f"started llama-server in {server.load_s:.1f} s: {' '.join(peer_cmd)}",
            file=sys.stderr,
            flush=True,
        )
    order0 = names + ([PEER_ROW] if server else [])
    runs: dict[str, list[dict]] = {n: [] for n in order0}
    recorded_response = None
    last_tokens: dict[str, list[int]] = {}
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        warm = SamplingParams(max_tokens=4, temperature=0.0)
        for llm in engines.values():  # one warm-up request each
            llm.generate([{"prompt_token_ids": prompt_ids}], warm, use_tqdm=False)
        if server:
            server.complete(prompt_ids, 4)
            info[PEER_ROW].update(server.memory_mib())
        for r in range(args.rounds):
            for name in order0 if r % 2 == 0 else order0[::-1]:
                if name == PEER_ROW:
                    assert server is not None
                    timing, recorded_response = server.complete(prompt_ids, args.max_tokens)
                    runs[name].append(timing.as_run())
                    last_tokens[name] = list(recorded_response.get("tokens") or [])
                    continue
                t0 = time.perf_counter()
                out = engines[name].generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
                wall = time.perf_counter() - t0
                m, n = out.metrics, len(out.outputs[0].token_ids)
                last_tokens[name] = list(out.outputs[0].token_ids)
                tpot = (m.finished_time - m.first_token_time) / (n - 1)
                runs[name].append(
                    {"decode_tok_s": 1 / tpot, "overall_tok_s": n / wall, "ttft_s": m.ttft, "tokens": n}
                )
        if server:
            mem = server.memory_mib()
            info[PEER_ROW]["peak_rss_mib"] = mem.get("peak_rss_mib")
    finally:
        if server:
            server.stop()
    rows = summarize_rows(runs, info)
    checks = check_targets(rows)
    agree = greedy_agreement(last_tokens)
    print()
    print(format_table(rows))
    if checks:
        print(format_targets(checks))
    if agree:
        print(
            "leading greedy tokens equal to llama.cpp's: " + ", ".join(f"{k} {v}" for k, v in agree.items())
        )
    return {
        "benchmark": "quantized_batch1",
        "system": system_info(),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "prompt": prompt_text,
        "prompt_tokens": len(prompt_ids),
        "peer_command": peer_cmd,
        "peer_threads": peer_threads(args) if args.peer else None,
        "peer_last_response": recorded_response,
        "greedy_agreement": agree,
        "results": rows,
        "targets": checks,
    }


def run_peer_w64(args: argparse.Namespace, reqs) -> dict:
    """The w64 requests through llama-server with ``--peer-parallel`` slots, all sent at once."""
    from kvserve.benchmarks.llama_cpp import LlamaServer

    longest = max(r.prompt_len + r.output_len for r in reqs)
    ctx = 256 * (longest // 256 + 1)  # per slot, rounded up
    server = LlamaServer(
        gguf_file(args),
        threads=peer_threads(args),
        parallel=args.peer_parallel,
        ctx_per_slot=ctx,
        binary=args.peer_binary,
    ).start()
    try:
        server.complete(reqs[0].prompt_token_ids[:16], 2)  # warm-up, untimed
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(reqs), args.peer_parallel)) as pool:
            outs = list(pool.map(lambda r: server.complete(r.prompt_token_ids, r.output_len)[0], reqs))
        wall = time.perf_counter() - t0
        mem = server.memory_mib()
        out_tokens = sum(min(o.output_tokens, r.output_len) for o, r in zip(outs, reqs))
        return {
            "path": PEER_ROW,
            "load_s": server.load_s,
            "elapsed_s": wall,
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall,
            "requests_short_of_output_len": sum(o.output_tokens < r.output_len for o, r in zip(outs, reqs)),
            "rss_mib": mem.get("rss_mib"),
            "peak_rss_mib": mem.get("peak_rss_mib"),
            "command": server.command(),
        }
    finally:
        server.stop()


def w64_ratios(rows: list[dict]) -> list[dict]:
    """Adds ``x_bf16`` (output tok/s over the kvserve bfloat16 row's) to each w64 row."""
    base = next((r["output_tokens_per_s"] for r in rows if r["path"] == "bfloat16"), None)
    for r in rows:
        r["x_bf16"] = r["output_tokens_per_s"] / base if base else None
    return rows


def format_w64_table(rows: list[dict]) -> str:
    """The w64 table as text."""
    headers = ["path", "output tok/s", "x bf16", "elapsed s", "load s", "peak RSS MiB"]
    body = [
        [
            r["path"],
            r["output_tokens_per_s"],
            fmt_ratio(r.get("x_bf16")),
            r["elapsed_s"],
            r.get("load_s"),
            r.get("peak_rss_mib"),
        ]
        for r in rows
    ]
    return fmt_table(headers, body)


def w64_one(name: str, path: Path, num_prompts: int | None, model: str | None = None) -> dict:
    """One kvserve format over the workload in this process (run in a child by :func:`run_w64`,
    so that its peak RSS and load time are that format's alone); ``model``: a .gguf file
    instead of the default model."""
    from kvserve.benchmarks.common import peak_rss_mib
    from kvserve.benchmarks.throughput import run_kvserve
    from kvserve.workload.workload import load_workload

    reqs = load_workload(path, num_prompts)
    res = run_kvserve(reqs, {**PATHS[name], **({"model": model} if model else {})}, use_tqdm=False)
    res.pop("_llm")
    keep = ("output_tokens_per_s", "elapsed_s", "load_s", "output_tokens", "requests_short_of_output_len")
    return {"path": name, **{k: res[k] for k in keep}, "peak_rss_mib": peak_rss_mib()}


def run_w64(args: argparse.Namespace, names: list[str]) -> dict:
    """Each kvserve format over the workload in its own child process, one after the other,
    then the peer."""
    import json
    import subprocess
    import tempfile

    from kvserve.workload.workload import default_workload_path, load_workload

    path = Path(args.workload) if args.workload else default_workload_path()
    reqs = load_workload(path, args.num_prompts)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, "-m", "kvserve.benchmarks.quantized", "--w64-one", name]
            cmd += ["--workload", str(path), "--json-out", str(out)]
            if args.num_prompts:
                cmd += ["--num-prompts", str(args.num_prompts)]
            if args.model:
                cmd += ["--model", args.model]
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not out.is_file():
                raise RuntimeError(f"--w64 {name!r}: the child process failed (exit {proc.returncode})")
            rows.append(json.loads(out.read_text()))
        print(f"{name}: {rows[-1]['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr, flush=True)
    if args.peer:
        rows.append(run_peer_w64(args, reqs))
    rows = w64_ratios(rows)
    checks = check_targets(rows, W64_TARGETS)
    print()
    print(format_w64_table(rows))
    if checks:
        print(format_targets(checks))
    return {
        "benchmark": "quantized_w64",
        "system": system_info(),
        "workload": str(path),
        "num_requests": len(reqs),
        "results": rows,
        "targets": checks,
    }


def run(args: argparse.Namespace) -> int:
    """Runs what ``args`` asks for (batch 1 or ``--w64``); 2 on a bad flag or a missing peer."""
    if args.w64_one:
        from kvserve.workload.workload import default_workload_path

        row = w64_one(
            args.w64_one, Path(args.workload or default_workload_path()), args.num_prompts, args.model
        )
        write_json(args.json_out, row)
        return 0
    try:
        names = check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.peer:
        from kvserve.benchmarks.llama_cpp import default_binary

        binary = Path(args.peer_binary) if args.peer_binary else default_binary()
        if not binary.is_file():  # before minutes of model loading
            print(
                f"error: --peer {args.peer}: llama-server not found at {binary}; run "
                "`bash benchmarks/llama_cpp/setup.sh` or pass --peer-binary",
                file=sys.stderr,
            )
            return 2
    try:
        doc = run_w64(args, names) if args.w64 else run_batch1(args, names)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json_out:
        write_json(args.json_out, doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
