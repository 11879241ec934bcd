"""``kvserve bench lora``: multi-LoRA serving vs the same run without adapters.

Workload: the shared w64 (``../shared/workloads/w64.jsonl``; ``--num-prompts`` / ``--max-output``
cut it), all requests at once, greedy, ``ignore_eos``. Scenarios (``--scenarios``):

- ``base``: no adapters (``enable_lora`` off);
- ``lora4``: requests spread round-robin over 4 random adapters of rank ``--rank`` on all
  target modules (q/k/v/o/gate/up/down), ``max_loras=4``;
- ``lora16``: the same over 16 adapters with ``max_loras=4``: adapters cycle through the
  device slots (``max_cpu_loras=16``, all loaded before timing);
- ``base16``: no adapters, ``max_num_seqs=16``: the batch lora16 is bounded by (4 slots x the
  4 requests per adapter that a 64-request w64 has), so ``lora16`` vs ``base16`` is the cost
  of LoRA itself and ``base16`` vs ``base`` the cost of the slot limit. Not run by default.

Per dtype (``--dtypes``) and scenario: output tok/s, its ratio to ``base`` (the issue's targets:
>= 0.8x for ``lora4``, >= 0.7x for ``lora16``), device slot loads and their mean time
(copying a cached adapter into a slot), and the mean adapter load time (reading and
validating one PEFT directory). ``--profile-steps N`` (default 2) profiles N
steps of the batch with ``torch.profiler`` after the timed run and reports the share of the
step spent in the LoRA op (``lora.add_lora`` calls, plus the LoRA kernel time the one-call
decode step clocks itself: ``cpu_decode_step.lora_kernel_seconds``). ``--max-slot-preemptions N`` turns slot turnover
on for the LoRA scenarios (``LoRAConfig.max_slot_preemptions``; default 0, vLLM's rule); the
JSON records each run's ``slot_preemptions``. Adapters are random PEFT directories written
under ``--adapter-dir`` (a temporary one by default). Prints a table; ``--json-out`` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvserve.benchmarks.common import fmt_table, system_info, without_profiler_trace_lines
from kvserve.workload.io import write_json
from kvserve.workload.workload import BenchRequest, default_workload_path, load_workload

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: name -> (adapters, max_loras, max_num_seqs or None for the engine default)
SCENARIOS = {"base": (0, 0, None), "lora4": (4, 4, None), "lora16": (16, 4, None), "base16": (0, 0, 16)}


def write_random_adapter(path: Path, shapes, rank: int, seed: int, targets=ALL_TARGETS) -> str:
    """A PEFT LoRA directory with random weights (``B`` small, so outputs stay sensible)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for t in targets:
            parent = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fin, fout = shapes.in_out[t]
            p = f"base_model.model.model.layers.{layer}.{parent}.{t}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{p}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def _profile_lora_share(llm, reqs: list[BenchRequest], loras, steps: int) -> dict[str, Any]:
    """Add ``reqs`` and profile ``steps`` engine steps (after their prefill); the LoRA op's
    share of the profiled wall time. Aborts the requests afterwards."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvserve import SamplingParams
    from kvserve.model_executor.layers import lora as ops
    from kvserve.model_executor.models import cpu_decode_step, llama

    eng = llm.llm_engine
    ids = [f"prof-{i}" for i in range(len(reqs))]
    for rid, r, lora in zip(ids, reqs, loras):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        eng.add_request(rid, {"prompt_token_ids": r.prompt_token_ids}, params, lora_request=lora)
    started: set[str] = set()
    for _ in range(1000):  # through the prefills: profile decode steps
        started.update(o.request_id for o in eng.step())
        if len(started) == len(ids):
            break
    orig = ops.add_lora

    def timed(*a, **kw):
        with record_function("lora.add_lora"):
            return orig(*a, **kw)

    llama.add_lora = cpu_decode_step.add_lora = timed
    model = getattr(eng.executor, "model", None)
    fused0 = cpu_decode_step.lora_kernel_seconds(model)
    try:
        t0 = time.perf_counter()
        with without_profiler_trace_lines(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                eng.step()
        wall = time.perf_counter() - t0
    finally:
        llama.add_lora = cpu_decode_step.add_lora = orig
    # the one-call decode step calls the kernel from C: its own clock of those calls
    fused_s = cpu_decode_step.lora_kernel_seconds(model) - fused0
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    lora_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "lora.add_lora") + 1e6 * fused_s
    return {
        "profiled_steps": steps,
        "step_ms": 1000 * wall / steps,
        "lora_ms_per_step": lora_us / 1000 / steps,
        "lora_share": (lora_us / 1e6) / wall if wall else None,
    }


def _run(llm, reqs: list[BenchRequest], loras) -> dict[str, Any]:
    from kvserve import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    secs = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": secs,
        "output_tokens": n_out,
        "output_tok_s": n_out / secs if secs else 0.0,
        "failed": sum(o.outcome != "finished" for o in outs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvserve bench lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="base model dir (default: the default model)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--scenarios", default="base,lora4,lora16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=None, help="first N w64 requests (default all)")
    p.add_argument("--max-output", type=int, default=None, help="cap w64 output lengths")
    p.add_argument("--workload", default=None, help="a workload JSONL (default: shared w64)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled per LoRA scenario (0: none)")
    p.add_argument(
        "--max-slot-preemptions",
        type=int,
        default=0,
        help="LoRA scenarios: LoRAConfig.max_slot_preemptions (slot turnover; default 0 = off)",
    )
    p.add_argument("--adapter-dir", default=None)
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)

    from transformers import AutoConfig

    from kvserve import LLM
    from kvserve.lora.peft import ModelShapes
    from kvserve.lora_request import LoRARequest
    from kvserve.model_executor.model_loader import resolve_model_dir

    scenarios = [s for s in ns.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        print(f"error: --scenarios: unknown {bad} ({', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    path = Path(ns.workload) if ns.workload else default_workload_path()
    if not path.is_file():
        print(f"error: workload {path} not found", file=sys.stderr)
        return 2
    reqs = load_workload(path, ns.num_prompts)
    if ns.max_output:
        for r in reqs:
            r.output_len = min(r.output_len, ns.max_output)
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(ns.model)))
    tmp = None
    adir = Path(ns.adapter_dir) if ns.adapter_dir else Path(tmp := tempfile.mkdtemp(prefix="kvserve-lora-"))
    n_max = max(SCENARIOS[s][0] for s in scenarios)
    paths = [write_random_adapter(adir / f"adapter{i}", shapes, ns.rank, seed=i) for i in range(n_max)]

    results: dict[str, dict[str, Any]] = {}
    for dtype in [d for d in ns.dtypes.split(",") if d]:
        results[dtype] = {}
        for scen in scenarios:
            n_adapters, max_loras, max_seqs = SCENARIOS[scen]
            kw: dict[str, Any] = {"model": ns.model, "dtype": dtype, "device": ns.device}
            if max_seqs is not None:
                kw["max_num_seqs"] = max_seqs
            if n_adapters:
                kw.update(
                    enable_lora=True,
                    max_loras=max_loras,
                    max_lora_rank=ns.rank,
                    max_cpu_loras=n_adapters,
                    max_slot_preemptions=ns.max_slot_preemptions,
                )
            llm = LLM(**kw)
            adapters = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(n_adapters)]
            load_s = []
            for a in adapters:  # loaded (read + validated) before timing
                t = time.perf_counter()
                llm.llm_engine.add_lora(a)
                load_s.append(time.perf_counter() - t)
            loras = [adapters[i % n_adapters] for i in range(len(reqs))] if n_adapters else None
            _run(llm, reqs[:1], None if loras is None else loras[:1])  # warm-up
            res = _run(llm, reqs, loras)
            res["adapters"], res["max_loras"] = n_adapters, max_loras
            res["max_num_seqs"] = llm.llm_engine.scheduler.scheduler_config.max_num_seqs
            res["slot_preemptions"] = llm.llm_engine.scheduler.num_slot_preemptions
            res["adapter_load_ms"] = 1000 * sum(load_s) / len(load_s) if load_s else None
            mgr = getattr(llm.llm_engine.executor, "lora_manager", None)
            res["slot_loads"] = mgr.num_slot_loads if mgr is not None else 0
            res["slot_load_ms"] = (
                1000 * mgr.slot_load_s / mgr.num_slot_loads if mgr and mgr.num_slot_loads else None
            )
            if loras is not None and ns.profile_steps > 0:
                sub = reqs[: min(len(reqs), 64)]
                res["profile"] = _profile_lora_share(llm, sub, loras[: len(sub)], ns.profile_steps)
            results[dtype][scen] = res
            del llm

    rows = []
    for dtype, by in results.items():
        base = by.get("base")
        for scen, r in by.items():
            r["vs_base"] = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else None
            prof = r.get("profile") or {}
            rows.append(
                [
                    dtype,
                    scen,
                    r["adapters"],
                    r["max_loras"],
                    r["output_tokens"],
                    r["output_tok_s"],
                    None if r["vs_base"] is None else f"{r['vs_base']:.2f}x",
                    r["adapter_load_ms"],
                    r["slot_loads"],
                    r["slot_load_ms"],
                    prof.get("lora_ms_per_step"),
                    None if prof.get("lora_share") is None else f"{100 * prof['lora_share']:.1f}%",
                    r["failed"],
                ]
            )
    headers = ["dtype", "scenario", "adapters", "max_loras", "out tok", "out tok/s", "vs base"]
    headers += ["load ms", "slot loads", "slot ms", "lora ms/step", "lora share", "failed"]
    print(fmt_table(headers, rows))
    if ns.json_out:
        write_json(
            ns.json_out, {"benchmark": "lora", "args": vars(ns), "system": system_info(), "results": results}
        )
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
