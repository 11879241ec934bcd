#!/usr/bin/env python
"""Cost of one decode step of the real engine with and without LoRA adapters, by rows.

    KVSERVE_NUM_THREADS=1 python benchmarks/lora_step_cost.py [--rows 8,32] [--steps 12] [--dtype float32]

Per row count: ``rows`` w64 prompts (cut to 64 tokens) are prefilled, then ``--steps`` decode
steps are timed in four configurations: the engine without LoRA, the LoRA
engine (``max_loras=4``, rank 16 on all seven targets, random adapters) with base rows, with
all rows on one adapter, and with the rows round-robin over 4 adapters. Prints min / median
milliseconds of the step's thread CPU time (steadier than wall time on a shared machine; with
more than one thread the other threads' time is not counted, so use one). ``--compare-segment``
adds the 1- and 4-adapter cells with the LoRA op's stacked form off, then 4 adapters with it on
again (alternating twice, best of each), for a before/after within one run.
``--compare-native`` instead times, alternately ``--alternate`` times (best of each): the engine
without LoRA, the LoRA engine with base rows, 4 adapters on the torch forms of the op (a third
engine built as without the kernel, so a bfloat16 model keeps float32 slots, and
``ops.NATIVE_MAX_ROWS = 0``) and 4 adapters on the native kernel; e.g.

    KVSERVE_NUM_THREADS=1 python benchmarks/lora_step_cost.py --rows 8,16,64 --compare-native [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,32")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--compare-segment",
        action="store_true",
        help="also time the 1- and 4-adapter cells with the op's stacked form off (segment form "
        "only), alternately with it on, in the same run",
    )
    p.add_argument(
        "--compare-native",
        action="store_true",
        help="time no-LoRA / base rows / 4 adapters torch op / 4 adapters native kernel, alternately",
    )
    p.add_argument("--alternate", type=int, default=3, help="rounds of --compare-native")
    ns = p.parse_args(argv)

    from transformers import AutoConfig

    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.lora import write_random_adapter
    from kvserve.lora.peft import ModelShapes
    from kvserve.lora_request import LoRARequest
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.workload.workload import default_workload_path, load_workload

    reqs = load_workload(default_workload_path())
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(None)))
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-lora-step-"))
    paths = [write_random_adapter(tmp / f"a{i}", shapes, 16, seed=i) for i in range(4)]

    def measure(llm, rows: int, adapters) -> tuple[float, float]:
        eng = llm.llm_engine
        ids = []
        for k in range(rows):
            rid = f"step-{rows}-{k}-{time.monotonic_ns()}"
            eng.add_request(
                rid,
                {"prompt_token_ids": reqs[k % len(reqs)].prompt_token_ids[:64]},
                SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                lora_request=adapters[k % len(adapters)] if adapters else None,
            )
            ids.append(rid)
        for _ in range(6):  # the prefill and a few decodes
            eng.step()
        ts = []
        for _ in range(ns.steps):
            t = time.thread_time()
            eng.step()
            ts.append(time.thread_time() - t)
        eng.abort_request(ids)
        while eng.has_unfinished_requests():
            eng.step()
        return 1000 * min(ts), 1000 * statistics.median(ts)

    base = LLM(dtype=ns.dtype)
    lo = LLM(dtype=ns.dtype, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4)
    ads = [LoRARequest(f"a{i}", i + 1, paths[i]) for i in range(4)]
    for a in ads:
        lo.llm_engine.add_lora(a)
    if ns.compare_native:
        from kvserve.lora import ops
        from kvserve.model_executor.layers import native_lora

        # the op as before the kernel: torch forms on the slots they chose (float32 for a
        # bfloat16 model: ``ops.lora_slot_dtype`` without the kernel)
        real = native_lora.available
        native_lora.available = lambda: False
        try:
            lo_torch = LLM(dtype=ns.dtype, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4)
        finally:
            native_lora.available = real
        for a in ads:
            lo_torch.llm_engine.add_lora(a)
        keep = ops.NATIVE_MAX_ROWS
        print(
            "rows | no LoRA | LoRA engine, base rows | 4 adapters, torch op | 4 adapters, native op   (ms: min / median)"
        )
        for rows in [int(r) for r in ns.rows.split(",") if r]:
            got: list[list[tuple[float, float]]] = [[], [], [], []]
            for _ in range(ns.alternate):
                got[0].append(measure(base, rows, None))
                got[1].append(measure(lo, rows, None))
                ops.NATIVE_MAX_ROWS = 0
                got[2].append(measure(lo_torch, rows, ads))
                ops.NATIVE_MAX_ROWS = keep
                got[3].append(measure(lo, rows, ads))
            print(f"{rows} | " + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in map(min, got)), flush=True)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    head = "rows | no LoRA | LoRA engine, base rows | 1 adapter | 4 adapters"
    if ns.compare_segment:
        head += " | segment only: 1 adapter | 4 adapters | default again: 4 adapters"
    print(head + "   (ms: min / median)")
    for rows in [int(r) for r in ns.rows.split(",") if r]:
        cells = [
            measure(base, rows, None),
            measure(lo, rows, None),
            measure(lo, rows, ads[:1]),
            measure(lo, rows, ads),
        ]
        if ns.compare_segment:
            from kvserve.lora import ops

            keep = ops.STACKED_MAX_ROW_SLOTS
            seg1, seg4, stk4 = [], [], []
            for _ in range(2):  # alternately segment-only and the default choice
                ops.STACKED_MAX_ROW_SLOTS = 0
                seg1.append(measure(lo, rows, ads[:1]))
                seg4.append(measure(lo, rows, ads))
                ops.STACKED_MAX_ROW_SLOTS = keep
                stk4.append(measure(lo, rows, ads))
            cells += [min(seg1), min(seg4), min(stk4)]
        print(f"{rows} | " + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in cells), flush=True)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
