"""Decodes beside a long prompt: how much a long prompt's prefill slows the sequences already
decoding, with and without ``--max-decode-slowdown``, on the real engine.

    .venv/bin/python benchmarks/decode_beside_prefill.py [--model M] [--dtype float32]
        [--decoders 8] [--prompt-len 6000] [--slowdowns none,1.5] [--json-out F]

``--decoders`` requests (32-token prompts, greedy, ``ignore_eos``) start decoding; after each
has ``--warm-tokens`` tokens, one ``--prompt-len``-token prompt arrives. Chunked prefill is on
(the CPU default budget unless ``--max-num-batched-tokens``). Per setting, from the engine's
own step clock:

- TPOT before: the decoders' median gap between tokens before the prompt arrives;
- TPOT during: their mean and largest gap while the prompt prefills (arrival to its first
  token), and the ratio of the mean to TPOT before (the target: <= 1.5x);
- the long prompt's time to first token.

Settings run one after another in one process (one engine each, same weights). Prints a table
and writes JSON (``--json-out``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve.benchmarks.common import system_info
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.workload.io import write_json


def run(ns: argparse.Namespace, slowdown: float | None) -> dict:
    """One engine with ``max_decode_slowdown=slowdown``; the figures of the module docstring."""
    args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        enable_chunked_prefill=True,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_decode_slowdown=slowdown,
        max_model_len=ns.prompt_len + 64,
    )
    engine = LLMEngine.from_engine_args(args)
    vocab = engine.vocab_size
    horizon = ns.prompt_len + 64 - 32  # the decoders outlast the long prompt's prefill
    dec = SamplingParams(max_tokens=horizon, temperature=0, ignore_eos=True)
    for i in range(ns.decoders):
        ids = [(97 * i + 7 * k) % (vocab - 200) + 100 for k in range(32)]
        engine.add_request(f"d{i}", {"prompt_token_ids": ids}, dec)
    last: dict[str, float] = {}
    before: list[float] = []
    during: list[float] = []
    counts = {f"d{i}": 0 for i in range(ns.decoders)}
    arrived = first = None
    while True:
        prefilling = arrived is not None and first is None  # gaps ending in this step
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rid = o.request_id
            if rid == "long":
                if o.outputs and o.outputs[0].token_ids and first is None:
                    first = now
                continue
            n = len(o.outputs[0].token_ids)
            if n > counts[rid]:
                if rid in last:
                    gap = now - last[rid]
                    (during if prefilling else before).append(gap)
                last[rid] = now
                counts[rid] = n
        if arrived is None and min(counts.values()) >= ns.warm_tokens:
            ids = [(31 * k) % (vocab - 200) + 100 for k in range(ns.prompt_len)]
            engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0))
            arrived = time.perf_counter()
        if first is not None:
            break
        if min(counts.values()) >= horizon:
            raise RuntimeError("the decoders finished before the long prompt's first token")
    for rid in counts:
        engine.abort_request(rid)
    tpot = statistics.median(before)
    return {
        "max_decode_slowdown": slowdown,
        "tpot_before_s": tpot,
        "tpot_during_mean_s": statistics.mean(during),
        "tpot_during_max_s": max(during),
        "slowdown_mean": statistics.mean(during) / tpot,
        "long_ttft_s": first - arrived,
        "num_gaps_during": len(during),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--warm-tokens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=6000)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--slowdowns", default="none,1.5", help="comma-separated; none = no cap")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    settings = [None if x.strip().lower() == "none" else float(x) for x in ns.slowdowns.split(",")]
    rows = [run(ns, s) for s in settings]
    print(
        f"{'max_decode_slowdown':>20} {'TPOT before ms':>15} {'during mean ms':>15} "
        f"{'during max ms':>14} {'x before':>9} {'long TTFT s':>12}"
    )
    for r in rows:
        print(
            f"{str(r['max_decode_slowdown']):>20} {1000 * r['tpot_before_s']:15.1f} "
            f"{1000 * r['tpot_during_mean_s']:15.1f} {1000 * r['tpot_during_max_s']:14.1f} "
            f"{r['slowdown_mean']:8.2f}x {r['long_ttft_s']:12.2f}"
        )
    if ns.json_out:
        write_json(ns.json_out, {"args": vars(ns), "system": system_info(), "rows": rows})
        print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
