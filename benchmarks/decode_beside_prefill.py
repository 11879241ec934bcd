"""Decodes beside a long prompt: how much a long prompt's prefill slows the sequences already
decoding, with and without ``--max-decode-slowdown``, on the real engine.

    .venv/bin/python benchmarks/decode_beside_prefill.py [--model M] [--dtype float32]
        [--decoders 8] [--prompt-len 4000] [--slowdowns none,1.5] [--json-out F]

``--decoders`` requests (32-token prompts, greedy, ``ignore_eos``) start decoding; after each
has ``--warm-tokens`` tokens, one ``--prompt-len``-token prompt arrives. Chunked prefill is on
(the CPU default budget unless ``--max-num-batched-tokens``). A decoder's gaps between tokens
grow by themselves as its own context grows, so each setting is compared with a run of the
same decoders alone: the gaps that ended while the prompt prefilled (arrival to its first
token), against the alone run's gaps at the same requests and token positions. Per setting:

- the decoders' mean gap while the prompt prefilled, and alone at the same positions; their
  ratio is the slowdown (the target: <= 1.5x); the largest gap while it prefilled;
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


def run(ns: argparse.Namespace, slowdown: float | None, long_prompt: bool, until: int = 0) -> dict:
    """One engine with ``max_decode_slowdown=slowdown``. With ``long_prompt`` the prompt arrives
    after the warm-up and the run ends at its first token; without, the decoders run alone until
    each has ``until`` tokens. Returns ``gaps``: (request, token index) -> seconds, ``during``:
    the keys of the gaps that ended while the prompt prefilled, and its TTFT."""
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
    gaps: dict[tuple[str, int], float] = {}
    during: list[tuple[str, int]] = []
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
                    gaps[(rid, n)] = now - last[rid]
                    if prefilling:
                        during.append((rid, n))
                last[rid] = now
                counts[rid] = n
        if long_prompt and arrived is None and min(counts.values()) >= ns.warm_tokens:
            ids = [(31 * k) % (vocab - 200) + 100 for k in range(ns.prompt_len)]
            engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0))
            arrived = time.perf_counter()
        if first is not None or (not long_prompt and min(counts.values()) >= until):
            break
        if min(counts.values()) >= horizon:
            raise RuntimeError("the decoders finished before the long prompt's first token")
    for rid in counts:
        engine.abort_request(rid)
    return {"gaps": gaps, "during": during, "ttft_s": None if first is None else first - arrived}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--warm-tokens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--slowdowns", default="none,1.5", help="comma-separated; none = no cap")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args(argv)
    settings = [None if x.strip().lower() == "none" else float(x) for x in ns.slowdowns.split(",")]
    runs = {s: run(ns, s, long_prompt=True) for s in settings}
    until = max(idx for r in runs.values() for _, idx in r["during"]) + 1
    alone = run(ns, None, long_prompt=False, until=until)["gaps"]
    rows = []
    for s, r in runs.items():
        keys = [k for k in r["during"] if k in alone]
        mine = statistics.mean(r["gaps"][k] for k in keys)
        base = statistics.mean(alone[k] for k in keys)
        rows.append(
            {
                "max_decode_slowdown": s,
                "gap_during_mean_s": mine,
                "gap_alone_mean_s": base,
                "slowdown": mine / base,
                "gap_during_max_s": max(r["gaps"][k] for k in keys),
                "long_ttft_s": r["ttft_s"],
                "num_gaps": len(keys),
            }
        )
    print(
        f"{'max_decode_slowdown':>20} {'gap during ms':>14} {'alone ms':>9} {'slowdown':>9} "
        f"{'max gap ms':>11} {'long TTFT s':>12}"
    )
    for r in rows:
        print(
            f"{str(r['max_decode_slowdown']):>20} {1000 * r['gap_during_mean_s']:14.1f} "
            f"{1000 * r['gap_alone_mean_s']:9.1f} {r['slowdown']:8.2f}x "
            f"{1000 * r['gap_during_max_s']:11.1f} {r['long_ttft_s']:12.2f}"
        )
    if ns.json_out:
        write_json(ns.json_out, {"args": vars(ns), "system": system_info(), "rows": rows})
        print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
