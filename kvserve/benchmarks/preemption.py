"""``kvserve bench preemption``: tiny-cache workloads through the simulator and the real
engine, for every preemption mode and scheduling policy (``kvserve.benchmarks.scheduling``).

Workloads (``kvserve.workload.scheduling.preemption_workloads``): ``long`` (long prompts, long
outputs), ``many-short`` and ``n4`` (``n=4`` sampling), each on a KV cache too small to hold
them all, so the scheduler preempts; ``--quick`` halves counts, lengths and cache.

One table: a row per workload, runner (sim | real), policy, backfill and preemption mode, with
preemptions by recompute and by swap, recomputed tokens (prefill tokens beyond each prompt's
first prefill), output tokens/s (all samples), TTFT and TPOT p50/p90 (ms); then, per workload,
whether the simulator and the real engine rank the configurations alike by output tokens/s.
``--workloads`` picks some by name. ``--json OUT`` writes the rows and the rankings.
"""

from __future__ import annotations

from kvserve.benchmarks import scheduling as sb
from kvserve.workload import scheduling as ws

HEADERS = (
    "workload", "runner", "policy", "backfill", "preempt", "recompute", "swap", "recomputed tok",
    "tok/s", "ttft p50 ms", "ttft p90 ms", "tpot p50 ms", "tpot p90 ms", "finished",
)  # fmt: skip


def render(rows: list[dict]) -> tuple[str, list[str], dict]:
    """The table, the ranking lines and the rankings."""
    body = []
    for r in rows:
        (t,) = r["tenants"].values()  # one tenant
        body.append(
            [r["workload"], r["runner"], r["policy"], r["backfill"], r["mode"]]
            + [r["num_recompute_preemptions"], r["num_swap_preemptions"], r["recomputed_tokens"]]
            + [r["output_tok_s"], *(sb.ms(t[m][q]) for m in ("ttft", "tpot") for q in ("p50", "p90"))]
            + [f"{r['num_finished']}/{r['num_requests']}"]
        )
    rankings = sb.rank_agreement(rows, lambda r: r["output_tok_s"], True)
    return sb.table(HEADERS, body), sb.agreement_lines(rankings, "output tok/s"), rankings


def main(argv: list[str] | None = None) -> int:
    ap = sb.build_parser("kvserve bench preemption", __doc__ or "", ",".join(sb.preemption_modes()))
    ns = ap.parse_args(argv)
    try:
        runners, configs, base, cost_model = sb.resolve(ns)
        wls = sb.select_workloads(ns.workloads, ws.preemption_workloads(sb.corpus(), quick=ns.quick))
    except ValueError as e:
        return sb.error(e)
    print(f"{len(wls)} workloads x {len(runners)} runners x {len(configs)} configs")
    rows = sb.run_matrix(wls, runners, configs, base, cost_model)
    text, lines, rankings = render(rows)
    return sb.finish(ns, "preemption", text, lines, {"rows": rows, "rankings": rankings})


if __name__ == "__main__":
    raise SystemExit(main())
