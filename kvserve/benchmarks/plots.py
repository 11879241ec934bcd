"""PNG plots for the benchmarks (matplotlib, Agg backend: no display needed).

* ``plot_latency_cdfs``: empirical CDFs of TTFT, TPOT and end-to-end latency (one line per run).
* ``plot_latency_vs_rate``: p50/p99 TTFT, TPOT, E2E and goodput against request rate (a sweep).
* ``plot_timeline``: running / waiting / swapped requests and KV-cache use over time (offline
  run: ``llm_engine.stats.timeline``; server run: scraped ``/metrics``).
* ``plot_spec_decode``: output tok/s of each speculative-decoding method relative to
  speculation off, per scenario (one panel per saved ``bench spec-decode`` result).
* ``plot_cold_start``: process start -> first token of each ``bench cold-start`` try, split into
  its phases.

``python -m kvserve.benchmarks.plots RESULT.json --out-dir D`` redraws them from a saved result.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> str:
    from kvserve.workload.io import atomic_write

    p = Path(path)
    fig.tight_layout()
    try:
        # the temporary file keeps the suffix: savefig infers the format from it
        atomic_write(p, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        _plt().close(fig)
    return str(p)


def plot_latency_cdfs(runs: dict[str, dict[str, Sequence[float]]], path, title: str = "") -> str:
    """``runs``: label -> {"ttft_ms": [...], "tpot_ms": [...], "e2e_ms": [...]} (per-request samples)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end latency")):
        for label, samples in runs.items():
            xs = sorted(x for x in samples.get(key, []) if x is not None)
            if xs:
                ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step([xs[0]] + xs, ys, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(name)
        if len(runs) > 1 or any(runs.values()):
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _rate_key(r) -> float:
    return float("inf") if r in ("inf", float("inf")) else float(r)


def plot_latency_vs_rate(sweep, path, title: str = "") -> str:
    """``sweep``: run summaries (as ``stats.summarize_results`` plus ``request_rate``), or
    ``{server label: [summaries]}`` to compare servers (p50 and p99 per server)."""
    plt = _plt()
    series = sweep if isinstance(sweep, dict) else {"": sweep}
    rates = sorted(
        {
            _rate_key(s["request_rate"])
            for ss in series.values()
            for s in ss
            if s.get("request_rate") is not None
        }
    )
    pos = {r: i for i, r in enumerate(rates)}
    xs_all = list(range(len(rates)))
    qs = (
        (("p50", "o-"), ("p90", "s--"), ("p99", "^:")) if len(series) == 1 else (("p50", "o-"), ("p99", "^:"))
    )
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for name_s, ss in series.items():
        pts = sorted(
            (s for s in ss if s.get("request_rate") is not None), key=lambda s: _rate_key(s["request_rate"])
        )
        xs = [pos[_rate_key(s["request_rate"])] for s in pts]
        pre = f"{name_s} " if name_s else ""
        for ax, key, name in zip(axes[:3], ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "E2E")):
            for q, style in qs:
                ax.plot(xs, [(s.get(key) or {}).get(q) for s in pts], style, label=f"{pre}{q}")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"{name} vs request rate")
        axes[3].plot(xs, [s.get("output_throughput") for s in pts], "o-", label=f"{pre}output tok/s")
        axes[3].plot(
            xs, [s.get("goodput_output_tok_s") for s in pts], "s--", label=f"{pre}goodput (SLO) tok/s"
        )
    ax = axes[3]
    labels = ["inf" if r == float("inf") else f"{r:g}" for r in rates]
    xs = xs_all
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput vs request rate")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_timeline(tl: dict, path, title: str = "") -> str:
    """``tl``: columns ``time_s``, ``running``, ``waiting``, ``swapped``, ``gpu_cache_usage`` (0..1)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    t = tl.get("time_s", [])
    for key, color in (("running", "tab:green"), ("waiting", "tab:orange"), ("swapped", "tab:red")):
        if tl.get(key):
            ax.step(t, tl[key], where="post", label=key, color=color)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    if tl.get("gpu_cache_usage"):
        ax2.plot(
            t, [100 * u for u in tl["gpu_cache_usage"]], color="tab:blue", alpha=0.6, label="KV cache used %"
        )
    ax2.set_ylabel("KV cache used (%)")
    ax2.set_ylim(0, 105)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.set_title(title or "queues and KV-cache use")
    return _save(fig, path)


def plot_spec_decode(results: dict[str, dict], path) -> str:
    """Grouped bars: for each panel (a label, e.g. the dtype, -> a ``bench spec-decode`` JSON's
    ``results``: scenario -> method -> figures), each method's ``output_tok_s`` divided by the
    same scenario's ``off`` run, one bar group per scenario; a line at 1.0."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.6), squeeze=False)
    for ax, (label, by_scen) in zip(axes[0], results.items()):
        scens = list(by_scen)
        methods = [m for m in dict.fromkeys(m for s in scens for m in by_scen[s]) if m != "off"]
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            ys = []
            for s in scens:
                base = by_scen[s].get("off", {}).get("output_tok_s")
                r = by_scen[s].get(m, {}).get("output_tok_s")
                ys.append(r / base if base and r else 0.0)
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(scens))]
            bars = ax.bar(xs, ys, width, label=m)
            ax.bar_label(bars, fmt="%.2fx", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(scens)), scens)
        ax.set_ylabel("output tok/s vs speculation off")
        ax.set_title(label)
        ax.legend(fontsize=8)
    return _save(fig, path)


#: (JSON key, legend label) of the cold-start phases, in the order they happen.
COLD_START_PHASES = (
    ("interpreter_start_to_import_s", "interpreter start"),
    ("build_llm_s", "import + LLM()"),
    ("first_token_after_llm_s", "generate to first token"),
)


def plot_cold_start(tries: list[dict], path, target_s: float | None = None) -> str:
    """Stacked bars, one per ``bench cold-start`` try: seconds from process start to the first
    token, split into ``COLD_START_PHASES``; a dashed line at ``target_s`` when given."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [f"try {i + 1}" for i in range(len(tries))]
    bottom = [0.0] * len(tries)
    for key, label in COLD_START_PHASES:
        ys = [float(t.get(key) or 0.0) for t in tries]
        ax.bar(xs, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    if target_s is not None:
        ax.axhline(target_s, color="grey", lw=0.8, ls="--", label=f"target {target_s:g} s")
    ax.set_ylabel("seconds from process start")
    ax.set_title("cold start: process start -> first token")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plots_from_result(result: dict, out_dir) -> list[str]:
    """All plots a saved ``bench throughput`` / ``bench serve`` / ``bench spec-decode`` /
    ``bench cold-start`` JSON supports (an empty list: none)."""
    out = []
    if result.get("benchmark") == "cold_start" and result.get("tries"):
        out.append(plot_cold_start(result["tries"], Path(out_dir) / "cold_start.png", result.get("target_s")))
    if result.get("benchmark") == "spec_decode":
        out.append(
            plot_spec_decode({_spec_label(result, 0): result["results"]}, Path(out_dir) / "spec_decode.png")
        )
    if result.get("benchmark") == "throughput" and result.get("kvserve", {}).get("timeline"):
        out.append(plot_timeline(result["kvserve"]["timeline"], Path(out_dir) / "throughput_timeline.png"))
    runs = result.get("runs") or []
    if runs:
        cdfs = {r["label"]: r["samples"] for r in runs if r.get("samples")}
        if cdfs:
            out.append(plot_latency_cdfs(cdfs, Path(out_dir) / "latency_cdf.png"))
        if len(runs) > 1:
            out.append(
                plot_latency_vs_rate(
                    [r["summary"] | {"request_rate": r.get("request_rate")} for r in runs],
                    Path(out_dir) / "latency_vs_rate.png",
                )
            )
        for r in runs:
            if r.get("timeline", {}).get("time_s"):
                out.append(
                    plot_timeline(
                        r["timeline"],
                        Path(out_dir) / f"timeline_{_slug(r['label'])}.png",
                        title=f"{result.get('label') or 'server'}: {r['label']}",
                    )
                )
    return out


def plots_comparing(results: list[dict], out_dir) -> list[str]:
    """Servers side by side: latency CDFs of every run of every result (labelled
    ``server: run``) and, where any result has several rates, latency vs rate per server."""
    out = []
    cdfs = {}
    by_server: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        name = res.get("label") or res.get("base_url") or "?"
        for r in res.get("runs") or []:
            if r.get("samples"):
                cdfs[f"{name}: {r['label']}"] = r["samples"]
            by_server.setdefault(name, []).append(dict(r["summary"], request_rate=r.get("request_rate")))
    if cdfs:
        out.append(plot_latency_cdfs(cdfs, Path(out_dir) / "compare_latency_cdf.png"))
    if any(len(v) > 1 for v in by_server.values()):
        out.append(plot_latency_vs_rate(by_server, Path(out_dir) / "compare_latency_vs_rate.png"))
    return out


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(s))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="kvserve bench plot",
        description="redraw plots from benchmark JSON files; with several `bench serve` "
        "results (e.g. kvserve and vLLM) also plot them side by side, and several `bench "
        "spec-decode` results (e.g. float32 and bfloat16) as one figure of panels",
    )
    p.add_argument("results", nargs="+")
    p.add_argument("--out-dir", default=".")
    ns = p.parse_args(argv)
    loaded = []
    for path in ns.results:
        try:
            with open(path) as f:
                res = json.load(f)
        except (OSError, ValueError) as e:
            print(f"error: {path}: cannot read a benchmark JSON: {e}", file=sys.stderr)
            return 2
        if not isinstance(res, dict):
            print(f"error: {path}: not a benchmark result (a JSON object)", file=sys.stderr)
            return 2
        loaded.append(res)
    drawn = 0
    for i, (path, res) in enumerate(zip(ns.results, loaded)):
        sub = Path(ns.out_dir) / (_slug(res.get("label") or f"result{i}") if len(loaded) > 1 else "")
        made = plots_from_result(res, sub)
        for out in made:
            print(out)
        if not made:
            kind = res.get("benchmark") or "unknown"
            print(
                f"note: {path}: nothing to plot in a {kind!r} result (plots exist for throughput with "
                "a timeline, serve, spec-decode and cold-start results)",
                file=sys.stderr,
            )
        drawn += len(made)
    serve = [r for r in loaded if r.get("benchmark") == "serve"]
    if len(serve) > 1:
        for path in plots_comparing(serve, ns.out_dir):
            print(path)
    spec = [r for r in loaded if r.get("benchmark") == "spec_decode"]
    if len(spec) > 1:  # one panel per run (e.g. per dtype), side by side
        panels = {}
        for i, r in enumerate(spec):
            label = _spec_label(r, i)
            panels[label if label not in panels else f"{label} ({i})"] = r["results"]
        print(plot_spec_decode(panels, Path(ns.out_dir) / "spec_decode_compared.png"))
        drawn += 1
    return 0 if drawn else 1


def _spec_label(result: dict, i: int) -> str:
    """A ``bench spec-decode`` result's panel title: its dtype (or its index)."""
    dtype = result.get("args", {}).get("dtype")
    return f"spec decode, {dtype}" if dtype else f"spec decode, run {i}"


if __name__ == "__main__":
    sys.exit(main())
