"""``kvserve bench throughput | serve | cold-start | plot | spec-decode | lora | quantized | moe | roof | shapes | ...``."""

from __future__ import annotations

import sys

COMMANDS = {
    "throughput": ("kvserve.benchmarks.throughput", "offline throughput vs transformers generate"),
    "serve": ("kvserve.benchmarks.serve", "online load generator for an OpenAI-compatible server"),
    "cold-start": ("kvserve.benchmarks.cold_start", "process start -> first token, twice"),
    "plot": ("kvserve.benchmarks.plots", "redraw plots from a benchmark JSON"),
    "spec-decode": ("kvserve.benchmarks.spec_decode", "speculation off vs n-gram vs draft model"),
    "data-parallel": (
        "kvserve.benchmarks.data_parallel",
        "one engine vs DP replicas per router on a shared-prefix trace",
    ),
    "lora": ("kvserve.benchmarks.lora", "multi-LoRA serving vs the same run without adapters"),
    "lora-occupancy": (
        "kvserve.benchmarks.lora_occupancy",
        "adapter-slot occupancy of the LoRA workload on the simulator (steps vs the slot bound)",
    ),
    "fidelity": ("kvserve.benchmarks.fidelity", "one trace through the real engine and the simulator"),
    "fidelity-report": (
        "kvserve.benchmarks.fidelity_report",
        "markdown table of fidelity results; --noise: two real runs of one cell",
    ),
    "heavy-neighbours": (
        "kvserve.benchmarks.heavy_neighbours",
        "a neighbour's TTFT and the server's RSS beside heavy but legal requests",
    ),
    "quantized": (
        "kvserve.benchmarks.quantized",
        "batch-1 decode of gguf/int8 vs float32/bfloat16 (and llama.cpp), or w64 per format",
    ),
    "embed": (
        "kvserve.benchmarks.embed",
        "embedding sentences/s vs sentence-transformers; --online: 64 clients against a server",
    ),
    "moe": ("kvserve.benchmarks.moe", "the grouped MoE layer vs a per-expert loop, decode and prefill rows"),
    "fairness": (
        "kvserve.benchmarks.fairness",
        "multi-tenant workloads per policy and backfill, simulator and real engine: TTFT, Jain's index",
    ),
    "preemption": (
        "kvserve.benchmarks.preemption",
        "tiny-cache workloads per preemption mode and policy, simulator and real engine",
    ),
    "shapes": (
        "kvserve.benchmarks.shapes",
        "real model shapes, random weights: w64 and batch-1 decode vs vLLM CPU and llama.cpp",
    ),
    "roof": (
        "kvserve.benchmarks.roof",
        "this host's GEMM and memory peaks, and the step-time floor of the default workloads",
    ),
}


#: Packages of the ``bench`` extra (pyproject.toml) that some bench commands import.
BENCH_EXTRA_MODULES = frozenset({"matplotlib", "httpx", "accelerate"})


def usage() -> str:
    lines = ["usage: kvserve bench {" + ",".join(COMMANDS) + "} [options]", ""]
    lines += [f"  {name:<11} {helptext}" for name, (_, helptext) in COMMANDS.items()]
    lines += ["", "`kvserve bench COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown bench command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    import importlib

    try:
        return importlib.import_module(COMMANDS[name][0]).main(rest)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in BENCH_EXTRA_MODULES:
            raise
        print(
            f"error: `kvserve bench {name}` needs the optional package {missing!r}: install the "
            "bench extra with `scripts/setup.sh bench` (or `pip install -e '.[bench]'`)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
