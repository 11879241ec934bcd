"""``kvserve bench roof``: this host's peaks (GEMM FLOP/s per dtype, memory bandwidth) and the
floor they put under the default workloads: the least time any engine could take on them here.

The peaks come from ``kvserve.benchmarks.peaks`` (measured once per CPU, thread count and
versions, then cached; ``--remeasure`` refreshes), the floor from ``kvserve.sim.roofline``
(``max(FLOPs / peak, bytes / bandwidth)``). The workloads:

- ``offline w64``: SmolLM2-135M on the shared ``w64.jsonl`` (64 requests, their own prompt
  and output lengths), all prompts in one step, then one decode step per output position;
- ``batch-1 decode``: one request, a 32-token prompt and 128 new tokens; the floor is that
  of its 127 decode steps (TPOT);
- ``embed``: all-MiniLM-L6-v2 on the 256 texts of ``kvserve bench embed`` (the token count
  of each from the model's tokenizer where it is installed, else words + 3, exact for that
  word list and WordPiece vocabulary).

``--model DIR|config.json`` replaces the decoder (or, for an encoder config, the embedding
model) by that config. ``embed`` and ``throughput`` report their figures as a fraction of the
same floor (``floor_report``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.benchmarks import peaks as host_peaks
from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.benchmarks.peaks import PEAK_DTYPE, Peaks
from kvserve.sim.roofline import ModelShape, StepWork, encode_step, offline_steps, run_cost

#: The default decoder's sizes (SmolLM2-135M-Instruct's config.json), so the roof needs no model.
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
#: The default embedding model's sizes (all-MiniLM-L6-v2's config.json).
MINILM_L6 = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
}
#: ``batch-1 decode``: prompt and output tokens.
BATCH1 = (32, 128)
#: w64's totals, for a stand-in of 64 equal requests where the shared file is missing.
W64_TOTALS = (64, 12757, 10701)


def w64_requests() -> tuple[list[tuple[int, int]], str]:
    """``(prompt_len, output_len)`` of the shared w64 workload and where they came from (64
    equal requests of its mean lengths where the file is missing)."""
    from kvserve.workload.workload import default_workload_path, load_workload

    path = default_workload_path()
    if path.is_file():
        return [(r.prompt_len, r.output_len) for r in load_workload(str(path))], str(path)
    n, p, o = W64_TOTALS
    return [(p // n, o // n)] * n, f"stand-in: {n} x ({p // n} in, {o // n} out), w64's totals"


def embed_lengths(num_texts: int = 256, model_dir: str | None = None) -> tuple[list[int], str]:
    """Token counts of ``kvserve bench embed``'s texts (special tokens included) and how they
    were counted: by ``model_dir``'s tokenizer, else the default model's when its folder is
    unpacked, else words + 3 (the final period, [CLS] and [SEP]: exact for all-MiniLM-L6-v2)."""
    from kvserve import envs
    from kvserve.benchmarks.embed_inputs import make_texts

    texts = make_texts(num_texts)
    folder = Path(model_dir) if model_dir else envs.cache_root() / "all-MiniLM-L6-v2"
    if (folder / "tokenizer.json").is_file() or (folder / "vocab.txt").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        return [len(tok(t).input_ids) for t in texts], f"{folder.name} tokenizer"
    return [len(t.split()) + 3 for t in texts], "words + 3"


def read_config(spec: str) -> dict:
    """A transformers config from a model directory or a ``config.json`` path.

    Raises:
        ValueError: neither exists, or it is not a JSON object.
    """
    p = Path(spec)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--model {spec}: no config.json there")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {spec}: unreadable config ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {spec}: config.json is not a JSON object")
    return cfg


def floor_row(
    name: str, cfg: dict, dtype: str, steps: Sequence[StepWork], tokens: float, peaks: Peaks, unit: str
) -> dict:
    """The floor of ``steps`` for a model ``cfg`` stored as ``dtype``, as a table/JSON row:
    FLOPs, bytes, the binding limit, seconds and ``tokens`` per second at the floor."""
    model = ModelShape.from_hf_config(cfg, dtype)
    cost = run_cost(model, steps)
    fl = cost.floor(peaks.peak_flops(dtype), peaks.peak_bandwidth())
    return {
        "workload": name,
        "dtype": dtype,
        "gflop": cost.flops / 1e9,
        "gb": cost.bytes / 1e9,
        "steps": cost.steps,
        "compute_s": fl.compute_s,
        "memory_s": fl.memory_s,
        "bound": fl.bound,
        "floor_s": fl.seconds,
        "tokens": tokens,
        "unit": unit,
        "floor_rate": tokens / fl.seconds if fl.seconds > 0 else None,
    }


def floor_report(
    name: str,
    cfg: dict,
    dtype: str,
    steps: Sequence[StepWork],
    tokens: float,
    unit: str,
    remeasure: bool = False,
    threads: int | None = None,
) -> dict:
    """``floor_row`` on this host's cached (or newly measured) peaks at ``threads`` threads
    (default: torch's count now; a benchmark passes the count it started with, before an engine
    could lower it), with the peaks it used: what the other benchmarks call."""
    peaks, cached = host_peaks.load_or_measure(remeasure=remeasure, threads=threads)
    row = floor_row(name, cfg, dtype, steps, tokens, peaks, unit)
    row.update(
        peak_gflops=peaks.peak_flops(dtype) / 1e9,
        bandwidth_gb_s=peaks.peak_bandwidth() / 1e9,
        threads=peaks.threads,
        peaks_cached=cached,
    )
    return row


def weight_dtype(torch_dtype, quantization: str | None = None) -> str:
    """The ``roofline.DTYPE_BYTES`` key of an engine's weights: its ``quantization`` where that
    stores int8 / int4 codes (``q8_0`` / ``q4_1`` sizes), else its torch dtype's name."""
    quantized = {"int8": "q8_0", "int4": "q4_1"}
    if quantization in quantized:
        return quantized[quantization]
    return str(torch_dtype).replace("torch.", "")


def add_roof_args(p: argparse.ArgumentParser) -> None:
    """``--no-roof`` and ``--remeasure``, for a benchmark that reports a fraction of the roof."""
    g = p.add_argument_group("roof (kvserve bench roof)")
    g.add_argument("--no-roof", action="store_true", help="skip the floor and the %% of roof")
    g.add_argument("--remeasure", action="store_true", help="measure this host's peaks again (else cached)")


def percent_of_roof(rate: float, row: dict) -> float | None:
    """``rate`` (in ``row``'s unit per second) as a percentage of the floor's rate."""
    return 100.0 * rate / row["floor_rate"] if row.get("floor_rate") else None


def default_rows(peaks: Peaks, decoder: dict, encoder: dict, dtypes: Sequence[str], embed_len) -> list[dict]:
    """The floor rows of the default workloads (``embed_len``: ``(lengths, how counted)``)."""
    rows = []
    reqs, source = w64_requests()
    for dt in dtypes:
        steps = offline_steps(reqs)
        row = floor_row("offline w64", decoder, dt, steps, sum(o for _, o in reqs), peaks, "output tok/s")
        rows.append({**row, "source": source})
    for dt in dtypes:
        decode = offline_steps([BATCH1])[1:]  # the decode steps: TPOT's floor
        row = floor_row("batch-1 decode", decoder, dt, decode, len(decode), peaks, "decode tok/s")
        rows.append({**row, "source": f"{BATCH1[0]}-token prompt, {BATCH1[1]} new tokens"})
    lengths, how = embed_len
    row = floor_row("embed", encoder, "float32", [encode_step(lengths)], len(lengths), peaks, "sentences/s")
    rows.append({**row, "source": f"{len(lengths)} texts, {sum(lengths)} tokens ({how})"})
    return rows


def peak_table(peaks: Peaks) -> str:
    """Each (dtype, backend)'s best rate over the shapes, and the bandwidth rows."""
    best: dict[tuple[str, str], dict] = {}
    for r in peaks.gemm:
        k = (r["dtype"], r["backend"])
        if k not in best or r["gflops"] > best[k]["gflops"]:
            best[k] = r
    top = {d: max(r["gflops"] for r in peaks.gemm if r["dtype"] == d) for d, _ in best}
    rows = [
        [d, b, "x".join(map(str, r["shape"])), r["gflops"], "peak" if r["gflops"] == top[d] else ""]
        for (d, b), r in best.items()
    ]
    gemm = fmt_table(["dtype", "backend", "best shape MxNxK", "GFLOP/s (int8: GOP/s)", ""], rows)
    top_bw = peaks.peak_bandwidth() / 1e9
    bw = fmt_table(
        ["stream", "GB/s", ""],
        [
            [r["method"], r["gb_per_s"], "peak" if r["read_only"] and r["gb_per_s"] == top_bw else ""]
            for r in peaks.bandwidth
        ],
    )
    return gemm + "\n\n" + bw


def floor_table(rows: list[dict]) -> str:
    return fmt_table(
        ["workload", "dtype", "GFLOP", "GB moved", "steps", "bound", "floor s", "floor rate", "unit"],
        [
            [
                r["workload"],
                r["dtype"],
                r["gflop"],
                r["gb"],
                r["steps"],
                r["bound"],
                r["floor_s"],
                r["floor_rate"],
                r["unit"],
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvserve bench roof", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="a model directory or config.json (default: SmolLM2-135M's sizes)"
    )
    ap.add_argument(
        "--dtypes", default="float32,bfloat16", help="weight types of the decoder rows, comma-separated"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="with no cached peaks (or with --remeasure): rough ones from one small shape (~1 s; not cached)",
    )
    ap.add_argument("--remeasure", action="store_true", help="measure the peaks again (refreshes the cache)")
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in PEAK_DTYPE]
    try:
        if bad or not dtypes:
            raise ValueError(f"--dtypes: {bad or 'none'} not among {', '.join(PEAK_DTYPE)}")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        decoder, encoder = SMOLLM2_135M, MINILM_L6
        model_dir = None
        if args.model:
            cfg = read_config(args.model)
            is_encoder = not ModelShape.from_hf_config(cfg).causal
            if is_encoder:
                encoder, model_dir = cfg, (args.model if Path(args.model).is_dir() else None)
            else:
                decoder = cfg
        if args.output:
            from kvserve.workload.io import check_output_path

            check_output_path("--output", args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    peaks, cached = host_peaks.load_or_measure(
        remeasure=args.remeasure, quick=args.quick, log=lambda m: print(m, file=sys.stderr)
    )
    rows = default_rows(peaks, decoder, encoder, dtypes, embed_lengths(model_dir=model_dir))

    flags = ", ".join(peaks.flags) or "-"
    print(f"CPU: {peaks.cpu}, {peaks.threads} threads, torch {peaks.torch}")
    print(f"flags: {flags}")
    origin = "cached" if cached else ("measured (quick)" if peaks.quick else "measured")
    print(f"peaks ({origin}):\n")
    print(peak_table(peaks))
    print("\nfloor = max(FLOPs / peak FLOP/s, bytes / bandwidth):\n")
    print(floor_table(rows))
    if args.output:
        from kvserve.workload.io import write_json

        result = {
            "benchmark": "roof",
            "peaks": peaks.as_dict(),
            "peaks_cached": cached,
            "decoder_config": decoder,
            "encoder_config": encoder,
            "floors": rows,
            "system": system_info(),
        }
        write_json(args.output, result)
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
