#!/usr/bin/env python
"""Where a ``kvserve bench lora`` run's extra time goes: its steps split by kind and size.

    python benchmarks/lora_step_split.py [--dtype float32] [--scenarios base,lora4] [--num-prompts N]

Runs the w64 burst of ``benchmarks/lora.py`` (same adapters, same engine settings) once per
scenario in one process, timing every ``LLMEngine.step`` (wall seconds, ``time.perf_counter``)
with the step's scheduler output, and prints per scenario: steps and seconds in steps that
carry a prompt chunk ("prefill", mixed with decodes under chunked prefill) and in pure-decode
steps, by batched-token bucket; the mean groups and distinct adapters per decode step (time
outside ``step`` is not counted), and the seconds the one-call decode steps spent in the LoRA
kernel (their own clock: ``native_decode.lora_kernel_seconds``). A scenario written ``NAME@N`` runs with the LoRA op's
``ops.NATIVE_MAX_ROWS = N`` (e.g. ``lora4@1024``: the native kernel only up to 1024 rows, the
torch forms for larger prefill steps, as before the eleventh session); ``NAME@unfused`` runs
LoRA decode steps on the per-layer native path (``native_decode.FUSE_LORA = False``, as before
the twelfth session) instead of the one-call step; ``NAME@slots`` schedules, loads and slots the
adapters as ``NAME`` does but runs every step as a base-model step (the model runner builds no
LoRA mapping): the slot rule's cost alone, i.e. the scenario's time if the LoRA op were free. Read the differences between scenarios of one run only
(the host's speed drifts). ``--json-out`` writes the per-step records.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BUCKETS = (16, 32, 48, 64, 1024, 4096)


def _bucket(n: int) -> str:
    lo = 0
    for hi in BUCKETS:
        if n <= hi:
            return f"{lo + 1}-{hi}"
        lo = hi
    return f">{BUCKETS[-1]}"


def run_scenario(llm, reqs, loras) -> list[dict]:
    """Every step of the burst: ``{"s": wall seconds, "tokens", "groups", "prefill", "loras"}``."""
    from kvserve import SamplingParams

    eng = llm.llm_engine
    sched = eng.scheduler
    last: dict = {}
    orig_schedule = sched.schedule

    def schedule():
        meta, out = orig_schedule()
        last["out"] = out
        return meta, out

    sched.schedule = schedule
    for i, (r, lora) in enumerate(zip(reqs, loras)):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        eng.add_request(f"split-{i}", {"prompt_token_ids": r.prompt_token_ids}, params, lora_request=lora)
    steps = []
    try:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            out = last.pop("out", None)
            if out is None or out.is_empty():
                continue
            steps.append(
                {
                    "s": dt,
                    "tokens": out.num_batched_tokens,
                    "groups": len(out.scheduled_seq_groups),
                    "prefill": out.num_prefill_groups > 0,
                    "loras": len(out.lora_requests),
                }
            )
    finally:
        sched.schedule = orig_schedule
    return steps


def summarize(steps: list[dict]) -> dict:
    by: dict[str, list[float]] = {}
    for s in steps:
        key = ("prefill " if s["prefill"] else "decode ") + _bucket(s["tokens"])
        by.setdefault(key, []).append(s["s"])
    dec = [s for s in steps if not s["prefill"]]
    return {
        "steps": len(steps),
        "seconds": sum(s["s"] for s in steps),
        "by": {k: (len(v), sum(v)) for k, v in sorted(by.items())},
        "decode_groups": sum(s["groups"] for s in dec) / len(dec) if dec else 0.0,
        "decode_loras": sum(s["loras"] for s in dec) / len(dec) if dec else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--scenarios", default="base,lora4")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    from transformers import AutoConfig

    from kvserve import LLM
    from kvserve.benchmarks.lora import SCENARIOS, write_random_adapter
    from kvserve.lora.peft import ModelShapes
    from kvserve.lora_request import LoRARequest
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.workload.workload import default_workload_path, load_workload

    reqs = load_workload(default_workload_path(), ns.num_prompts)
    if ns.max_output:
        for r in reqs:
            r.output_len = min(r.output_len, ns.max_output)
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(None)))
    scenarios = [s for s in ns.scenarios.split(",") if s]
    adir = Path(tempfile.mkdtemp(prefix="kvserve-lora-split-"))
    n_max = max(SCENARIOS[s.partition("@")[0]][0] for s in scenarios)
    paths = [write_random_adapter(adir / f"adapter{i}", shapes, ns.rank, seed=i) for i in range(n_max)]
    records = {}
    from kvserve.lora import ops
    from kvserve.model_executor.models import native_decode
    from kvserve.worker import model_runner

    class _NoMapping:  # ``@slots``: every step a base-model step, the scheduling unchanged
        @staticmethod
        def build(*args, **kwargs):
            return None

    real_mapping = model_runner.LoRAMapping

    default_max_rows = ops.NATIVE_MAX_ROWS
    for label in scenarios:
        scen, _, variant = label.partition("@")
        native_decode.FUSE_LORA = variant != "unfused"
        ops.NATIVE_MAX_ROWS = int(variant) if variant.isdigit() else default_max_rows
        model_runner.LoRAMapping = _NoMapping if variant == "slots" else real_mapping
        n_adapters, max_loras, max_seqs = SCENARIOS[scen]
        kw: dict = {"dtype": ns.dtype}
        if max_seqs is not None:
            kw["max_num_seqs"] = max_seqs
        if n_adapters:
            kw.update(enable_lora=True, max_loras=max_loras, max_lora_rank=ns.rank, max_cpu_loras=n_adapters)
        llm = LLM(**kw)
        adapters = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(n_adapters)]
        for a in adapters:
            llm.llm_engine.add_lora(a)
        loras = [adapters[i % n_adapters] if n_adapters else None for i in range(len(reqs))]
        run_scenario(llm, reqs[:1], loras[:1])  # warm-up
        model = llm.llm_engine.executor.model
        k0 = native_decode.lora_kernel_seconds(model)
        steps = run_scenario(llm, reqs, loras)
        kernel_s = native_decode.lora_kernel_seconds(model) - k0
        records[label] = steps
        sm = summarize(steps)
        print(
            f"{ns.dtype} {label}: {sm['steps']} steps, {sm['seconds']:.2f} s; decode steps: "
            f"{sm['decode_groups']:.1f} groups, {sm['decode_loras']:.2f} adapters on average; LoRA kernel "
            f"inside one-call decode steps: {kernel_s:.2f} s"
        )
        for k, (n, s) in sm["by"].items():
            print(f"    {k:>16}: {n:5d} steps {s:8.2f} s  {1000 * s / n:8.1f} ms/step")
        sys.stdout.flush()
        del llm
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
