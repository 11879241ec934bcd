"""The head-of-line scenario on the simulator: a long prompt that must wait for KV blocks, then
short requests behind it, run with and without scheduler backfill.

``resident`` requests fill most of the cache first and decode for a while; the ``long`` prompt
arrives next and needs more blocks than are free, so it waits for them to end; ``num_short``
short requests arrive just after it. Without backfill (vLLM V0) the shorts wait behind it; with
backfill they run in the blocks that are free meanwhile. ``compare`` reports the shorts' TTFT
p90 and the long prompt's TTFT both ways, on the simulator's virtual clock with its default
cost model (``kvserve.sim.cost_model.default_cost_model``).

Reproduce the numbers in docs/benchmarks.md::

    python -m kvserve.benchmarks.head_of_line
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from kvserve.config import EngineArgs
from kvserve.sim.cli import simulate
from kvserve.workload.stats import summarize
from kvserve.workload.workload import BenchRequest

#: Token ids of the synthetic prompts (distinct per request: no prefix-cache hits).
_VOCAB = 30000


@dataclass
class HeadOfLine:
    """Sizes of the scenario (tokens, blocks of ``block_size`` tokens, seconds).

    Defaults: 4 residents of 1,600 + 200 tokens hold 400 of 512 blocks (452 at their end); the
    2,000-token long prompt needs 125, so it waits until they end; 8 shorts of 100 + 32 tokens
    need 9 blocks each.
    """

    num_gpu_blocks: int = 512
    block_size: int = 16
    num_resident: int = 4
    resident_prompt: int = 1600
    resident_output: int = 200
    long_prompt: int = 2000
    long_output: int = 32
    num_short: int = 8
    short_prompt: int = 100
    short_output: int = 32
    gap_s: float = 0.001  # between consecutive arrivals after the residents

    def requests(self) -> list[BenchRequest]:
        """Residents at 0 s, the long prompt after one step's worth of time, then the shorts;
        ids: residents ``0..``, the long prompt ``num_resident``, the shorts after it."""
        out: list[BenchRequest] = []

        def add(n_prompt: int, n_out: int, t: float) -> None:
            i = len(out)
            ids = [(i * 7919 + j * 31 + 1) % _VOCAB for j in range(n_prompt)]
            out.append(BenchRequest(ids, n_out, arrival_s=t, id=i))

        for _ in range(self.num_resident):
            add(self.resident_prompt, self.resident_output, 0.0)
        t = 1.0  # the residents are decoding by then
        add(self.long_prompt, self.long_output, t)
        for k in range(self.num_short):
            add(self.short_prompt, self.short_output, t + (k + 1) * self.gap_s)
        return out

    @property
    def long_id(self) -> str:
        return str(self.num_resident)

    @property
    def short_ids(self) -> list[str]:
        return [str(self.num_resident + 1 + k) for k in range(self.num_short)]


def run(scenario: HeadOfLine, backfill: bool, chunked: bool) -> dict:
    """One simulation: ``{"long_ttft_s", "short_ttft_p90_s", "num_preemptions"}``.

    Raises:
        RuntimeError: a request of the scenario did not finish (the sizes do not fit).
    """
    args = EngineArgs(
        num_gpu_blocks=scenario.num_gpu_blocks,
        block_size=scenario.block_size,
        enable_chunked_prefill=chunked,
        scheduling_backfill=backfill,
        max_model_len=4096,
    )
    summary = simulate(args, scenario.requests(), per_request=True)
    per = summary["requests"]
    missing = [r for r in [scenario.long_id, *scenario.short_ids] if r not in per]
    if missing:
        raise RuntimeError(f"requests {missing} did not finish: {summary['ignored_reasons']}")
    return {
        "long_ttft_s": per[scenario.long_id]["ttft_s"],
        "short_ttft_p90_s": summarize(per[r]["ttft_s"] for r in scenario.short_ids)["p90"],
        "num_preemptions": summary["num_preemptions"],
    }


def compare(scenario: HeadOfLine | None = None, chunked: bool = True) -> dict:
    """Both runs and the ratios: ``short_ttft_p90_speedup`` (without / with backfill, higher is
    better) and ``long_ttft_ratio`` (with / without, 1.0 = not delayed)."""
    scenario = scenario or HeadOfLine()
    off = run(scenario, backfill=False, chunked=chunked)
    on = run(scenario, backfill=True, chunked=chunked)
    return {
        "chunked_prefill": chunked,
        "off": off,
        "on": on,
        "short_ttft_p90_speedup": off["short_ttft_p90_s"] / on["short_ttft_p90_s"],
        "long_ttft_ratio": on["long_ttft_s"] / off["long_ttft_s"],
    }


def main(argv: list[str] | None = None) -> int:
    """Print ``compare`` as JSON, with chunked prefill off and on."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    print(json.dumps([compare(chunked=c) for c in (False, True)], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
