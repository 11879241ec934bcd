"""``kvserve bench cold-start``: process start -> first generated token, measured twice.

Each try spawns a fresh ``python -c`` that imports kvserve, builds ``LLM(...)`` and generates one
token; the parent takes the wall-clock time before spawning and the child reports its
``first_token_time`` (wall clock). The first try may include one-time work (GGUF conversion into the
cache, cold page cache); the **second** is the figure the target (< 10 s) refers to.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from kvserve.benchmarks.common import system_info
from kvserve.workload.io import write_json

CHILD = r"""
import json, sys, time
t_import = time.time()
from kvserve import LLM, SamplingParams
kwargs = json.loads(sys.argv[1])
llm = LLM(**kwargs)
t_built = time.time()
out = llm.generate([{"prompt_token_ids": [1, 9690, 198, 2683, 359, 253]}],
                   SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)[0]
first = out.metrics.first_token_time if out.metrics and out.metrics.first_token_time else time.time()
print("COLDSTART " + json.dumps({"t_import": t_import, "t_built": t_built, "t_first_token": first,
                                 "tokens": list(out.outputs[0].token_ids)}), flush=True)
"""


def measure_once(engine_kwargs: dict, python: str = sys.executable, timeout_s: float = 600) -> dict:
    """One fresh process; times in seconds since just before spawning it.

    Raises:
        RuntimeError: the child failed or printed no result.
    """
    t0 = time.time()
    p = subprocess.run(
        [python, "-c", CHILD, json.dumps(engine_kwargs)], capture_output=True, text=True, timeout=timeout_s
    )
    t_exit = time.time()
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("COLDSTART ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"cold-start child failed (rc={p.returncode}): {p.stderr[-2000:]}")
    d = json.loads(line[len("COLDSTART ") :])
    return {
        "interpreter_start_to_import_s": d["t_import"] - t0,
        "build_llm_s": d["t_built"] - d["t_import"],
        "first_token_after_llm_s": d["t_first_token"] - d["t_built"],
        "start_to_first_token_s": d["t_first_token"] - t0,
        "process_total_s": t_exit - t0,
        "tokens": d["tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    from kvserve.entrypoints.cli import add_engine_args, checked_engine_args

    p = argparse.ArgumentParser(
        prog="kvserve bench cold-start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tries", type=int, default=2)
    p.add_argument("--target-s", type=float, default=10.0, help="pass/fail line for the last try")
    p.add_argument("--json-out", default=None)
    add_engine_args(p)
    ns = p.parse_args(argv)
    import dataclasses

    args = checked_engine_args(ns)
    if args is None:
        return 2
    kwargs = dataclasses.asdict(args)
    tries = []
    for i in range(ns.tries):
        r = measure_once(kwargs)
        tries.append(r)
        print(
            f"try {i + 1}: process start -> first token {r['start_to_first_token_s']:.2f} s "
            f"(interpreter {r['interpreter_start_to_import_s']:.2f} s, import + LLM() {r['build_llm_s']:.2f} s, "
            f"generate to first token {r['first_token_after_llm_s']:.2f} s, "
            f"process exit {r['process_total_s']:.2f} s)"
        )
    last = tries[-1]["start_to_first_token_s"]
    ok = last < ns.target_s
    print(
        f"cold start (try {len(tries)}): {last:.2f} s -> {'PASS' if ok else 'FAIL'} (target < {ns.target_s:g} s)"
    )
    if ns.json_out:
        write_json(
            ns.json_out,
            {
                "benchmark": "cold_start",
                "engine_args": kwargs,
                "tries": tries,
                "target_s": ns.target_s,
                "pass": ok,
                "system": system_info(),
            },
        )
        print(f"wrote {ns.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
