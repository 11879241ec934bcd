"""``kvserve bench fairness``: multi-tenant workloads through the simulator and the real engine,
for every scheduling policy and backfill setting (``kvserve.benchmarks.scheduling``).

Workloads (``kvserve.workload.scheduling``; lengths from the Azure 2023 code trace, scaled):
``flood`` (A sends 40 requests at t=0, B 4 at t=1 s; B's TTFT p90 is also measured with B
alone), ``backlogged`` (48 requests at t=0, tenants by the hash rule: Jain's index of served
tokens over 10 s windows) and ``head-of-line`` (a long prompt waiting for blocks, then 8 short
requests: their TTFT, and the long prompt's, A's largest). ``--quick``: A sends 16, B 2, 24 backlogged requests, outputs <= 24.

One table: a row per workload, runner (sim | real), policy, backfill and preemption mode, with
each tenant's TTFT and TPOT p50/p90 (ms; A's largest TTFT too), Jain's index, output tokens/s and preemptions; then,
per workload, whether the simulator and the real engine rank the configurations alike by its key
metric (flood: B's TTFT p90; backlogged: Jain's index; head-of-line: B's TTFT p90).
``--workloads`` picks some by name (``b-alone`` comes with ``flood``). ``--json OUT`` writes
the rows and the rankings.
"""

from __future__ import annotations

from kvserve.benchmarks import scheduling as sb
from kvserve.workload import scheduling as ws

HEADERS = (
    "workload", "runner", "policy", "backfill", "preempt",
    "A ttft p50 ms", "A ttft p90 ms", "A ttft max ms", "B ttft p50 ms", "B ttft p90 ms", "B p90 alone ms",
    "A tpot p50 ms", "A tpot p90 ms", "B tpot p50 ms", "B tpot p90 ms", "jain", "tok/s", "preempts",
)  # fmt: skip

#: each workload's key metric: (name, value of a row, higher is better)
KEY_METRICS = {
    "flood": ("B TTFT p90", lambda r: _tenant(r, "B", "ttft", "p90"), False),
    "backlogged": ("Jain's index", lambda r: r["jain"], True),
    "head-of-line": ("B TTFT p90", lambda r: _tenant(r, "B", "ttft", "p90"), False),
}


def _tenant(row: dict, tenant: str, metric: str, q: str):
    return ((row["tenants"].get(tenant) or {}).get(metric) or {}).get(q)


def workloads(quick: bool) -> list[ws.SchedWorkload]:
    """``flood``, ``b-alone``, ``backlogged``, ``head-of-line`` (shorter with ``quick``)."""
    num_a, num_b, num_bl = (16, 2, 24) if quick else (40, 4, 48)
    rows = sb.trace_rows(quick, max(num_a + num_b, num_bl))
    corpus = sb.corpus()
    flood, alone = ws.flood_workloads(rows, corpus, num_a, num_b)
    return [flood, alone, ws.backlogged_workload(rows, corpus, num_bl), ws.head_of_line_workload(corpus)]


def merge_alone(rows: list[dict]) -> list[dict]:
    """The ``b-alone`` rows folded into their ``flood`` rows as ``b_ttft_p90_alone``."""
    alone = {
        (r["runner"], r["policy"], r["backfill"], r["mode"]): _tenant(r, "B", "ttft", "p90")
        for r in rows
        if r["workload"] == "b-alone"
    }
    out = []
    for r in rows:
        if r["workload"] == "b-alone":
            continue
        if r["workload"] == "flood":
            r = {**r, "b_ttft_p90_alone": alone.get((r["runner"], r["policy"], r["backfill"], r["mode"]))}
        out.append(r)
    return out


def render(rows: list[dict]) -> tuple[str, list[str], dict]:
    """The table, the ranking lines and the rankings of merged rows."""
    body = []
    for r in rows:
        t = [sb.ms(_tenant(r, "A", "ttft", q)) for q in ("p50", "p90", "max")]
        t += [sb.ms(_tenant(r, "B", "ttft", q)) for q in ("p50", "p90")]
        tp = [sb.ms(_tenant(r, x, "tpot", q)) for x in ("A", "B") for q in ("p50", "p90")]
        body.append(
            [r["workload"], r["runner"], r["policy"], r["backfill"], r["mode"], *t]
            + [sb.ms(r.get("b_ttft_p90_alone")), *tp]
            + [None if r["jain"] is None else round(r["jain"], 3), r["output_tok_s"], r["num_preemptions"]]
        )
    lines, rankings = [], {}
    for w, (name, key, higher) in KEY_METRICS.items():
        agree = sb.rank_agreement([r for r in rows if r["workload"] == w], key, higher)
        rankings.update(agree)
        lines += sb.agreement_lines(agree, name)
    return sb.table(HEADERS, body), lines, rankings


def main(argv: list[str] | None = None) -> int:
    ap = sb.build_parser("kvserve bench fairness", __doc__ or "", "default")
    ns = ap.parse_args(argv)
    try:
        runners, configs, base, cost_model = sb.resolve(ns)
        wls = sb.select_workloads(ns.workloads, workloads(ns.quick), {"b-alone": "flood"})
    except ValueError as e:
        return sb.error(e)
    print(f"{len(wls)} workloads x {len(runners)} runners x {len(configs)} configs")
    rows = merge_alone(sb.run_matrix(wls, runners, configs, base, cost_model))
    text, lines, rankings = render(rows)
    return sb.finish(ns, "fairness", text, lines, {"rows": rows, "rankings": rankings})


if __name__ == "__main__":
    raise SystemExit(main())
