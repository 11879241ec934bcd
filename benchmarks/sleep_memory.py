"""Sleep mode's freed memory: the default model's resident set awake and asleep at each level,
the time ``wake_up`` takes, and whether greedy outputs after it equal those before.

Usage: ``.venv/bin/python benchmarks/sleep_memory.py [--kv-cache-memory-gib 1.0]``
"""

from __future__ import annotations

import argparse
import time

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.common import current_rss_mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    args = ap.parse_args()
    llm = LLM(enable_sleep_mode=True, kv_cache_memory_gib=args.kv_cache_memory_gib)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is"] * 8

    def tokens() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    before = tokens()
    for level in (1, 2):
        awake = current_rss_mib() or 0.0
        llm.sleep(level)
        asleep = current_rss_mib() or 0.0
        t = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t
        print(
            f"level {level}: RSS awake {awake:.0f} MiB, asleep {asleep:.0f} MiB "
            f"(freed {awake - asleep:.0f} MiB); wake_up {wake_s:.2f} s; "
            f"greedy tokens as before: {tokens() == before}"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
