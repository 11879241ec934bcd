"""PNG plots for the benchmarks (matplotlib, Agg backend: no display needed).

* ``plot_latency_cdfs``: empirical CDFs of TTFT, TPOT and end-to-end latency (one line per run).
* ``plot_latency_vs_rate``: p50/p99 TTFT, TPOT, E2E and goodput against request rate (a sweep).
* ``plot_timeline``: running / waiting / swapped requests and KV-cache use over time (offline
  run: ``llm_engine.stats.timeline``; server run: scraped ``/metrics``).

``python -m kvserve.benchmarks.plots RESULT.json --out-dir D`` redraws them from a saved result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> str:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    _plt().close(fig)
    return str(p)


def plot_latency_cdfs(runs: Dict[str, Dict[str, Sequence[float]]], path, title: str = "") -> str:
    """``runs``: label -> {"ttft_ms": [...], "tpot_ms": [...], "e2e_ms": [...]} (per-request samples)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end latency")):
        for label, samples in runs.items():
            xs = sorted(x for x in samples.get(key, []) if x is not None)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
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


def plot_latency_vs_rate(sweep: List[dict], path, title: str = "") -> str:
    """``sweep``: run summaries (as ``stats.summarize_results`` plus ``request_rate``)."""
    plt = _plt()
    pts = sorted((s for s in sweep if s.get("request_rate") is not None),
                 key=lambda s: float("inf") if s["request_rate"] in ("inf", float("inf")) else float(s["request_rate"]))
    labels = [str(s["request_rate"]) for s in pts]
    xs = list(range(len(pts)))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, key, name in zip(axes[:3], ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "E2E")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [(s.get(key) or {}).get(q) for s in pts], style, label=q)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs request rate")
    ax = axes[3]
    ax.plot(xs, [s.get("output_throughput") for s in pts], "o-", label="output tok/s")
    ax.plot(xs, [s.get("goodput_output_tok_s") for s in pts], "s--", label="goodput (SLO) tok/s")
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
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    if tl.get("gpu_cache_usage"):
        ax2.plot(t, [100 * u for u in tl["gpu_cache_usage"]], color="tab:blue", alpha=0.6, label="KV cache used %")
    ax2.set_ylabel("KV cache used (%)")
    ax2.set_ylim(0, 105)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.set_title(title or "queues and KV-cache use")
    return _save(fig, path)


def plots_from_result(result: dict, out_dir) -> List[str]:
    """All plots a saved ``bench throughput`` / ``bench serve`` JSON supports."""
    out = []
    if result.get("benchmark") == "throughput" and result.get("kvserve", {}).get("timeline"):
        out.append(plot_timeline(result["kvserve"]["timeline"], Path(out_dir) / "throughput_timeline.png"))
    runs = result.get("runs") or []
    if runs:
        cdfs = {r["label"]: r["samples"] for r in runs if r.get("samples")}
        if cdfs:
            out.append(plot_latency_cdfs(cdfs, Path(out_dir) / "latency_cdf.png"))
        if len(runs) > 1:
            out.append(plot_latency_vs_rate([r["summary"] | {"request_rate": r.get("request_rate")} for r in runs],
                                            Path(out_dir) / "latency_vs_rate.png"))
        for r in runs:
            if r.get("timeline", {}).get("time_s"):
                out.append(plot_timeline(r["timeline"], Path(out_dir) / f"timeline_{_slug(r['label'])}.png",
                                         title=f"server: {r['label']}"))
    return out


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(s))


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="kvserve bench plot", description="redraw plots from a benchmark JSON")
    p.add_argument("result")
    p.add_argument("--out-dir", default=".")
    ns = p.parse_args(argv)
    with open(ns.result) as f:
        for path in plots_from_result(json.load(f), ns.out_dir):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
