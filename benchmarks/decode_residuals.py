"""Why real decode steps miss the cost model: their residuals by the step's features.

Sets every pure decode step of a recorded replay (``kvserve bench fidelity --steps-out``)
against a cost model (a ``kvserve profile`` file) and groups the ratio measured / predicted by
what the model's counts leave out: the batch (decodes), the KV positions (summed; the longest
decode's; their spread, longest / mean), the previous step's class (a decode right after a
prompt chunk, whose weights and activations are no longer in cache), a new sequence in the
batch (the step after an admission), the scheduler's queue, the time outside the executor
(scheduling, sampling output, detokenizing) and torch's thread count. Then the same for the
profile's own decode samples, so a feature on which the two differ shows.

Prints, per group: steps, summed measured / predicted seconds and their signed error (what a
replay's clock accumulates), and the median per-step ratio.

Usage: python benchmarks/decode_residuals.py STEPS.json --cost-model PROFILE.json [--json-out R.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvserve.sim.step_record import StepRecord, load_replay
from kvserve.workload.io import write_json
from kvserve.workload.stats import percentile


def _bucket(v: float, edges: tuple) -> str:
    for e in edges:
        if v <= e:
            return f"<={e:g}"
    return f">{edges[-1]:g}"


def decode_rows(records: list[StepRecord], cm) -> list[dict]:
    """One dict per pure decode step of ``records``: its features, measured and predicted s."""
    rows = []
    since = None  # decode steps since the last step with a prompt chunk (None: none yet)
    for i, r in enumerate(records):
        s = r.shape
        if s.shape_class != "decode":
            since = 0 if s.prefill_tokens else since
            continue
        since = None if since is None else since + 1
        prev = records[i - 1].shape.shape_class if i else "none"
        b = s.decode_seqs
        mean_ctx = s.context_tokens / b
        rows.append(
            {
                "t": r.step_s,
                "pred": cm.step_cost(s),
                "decodes": b,
                "context": s.context_tokens,
                "mean_context": mean_ctx,
                "max_context": r.max_context_len,
                "spread": (r.max_context_len / mean_ctx) if r.max_context_len else None,
                "prev": prev,
                "since_chunk": since,
                "waiting": r.num_waiting,
                "outside_exec_s": r.step_s - r.exec_s,
                "threads": r.num_threads,
            }
        )
    return rows


#: feature -> (how to read it from a row, bucket edges or None for its own value)
GROUPS: dict[str, tuple[Callable[[dict], object], tuple | None]] = {
    "decodes": (lambda r: r["decodes"], (1, 4, 8, 16, 32, 48, 64)),
    "context (summed)": (lambda r: r["context"], (1000, 4000, 8000, 12000, 16000, 24000)),
    "mean context": (lambda r: r["mean_context"], (64, 128, 256, 384, 512, 768)),
    "max context": (lambda r: r["max_context"], (128, 256, 384, 512, 640, 768)),
    "spread max/mean": (lambda r: r["spread"], (1.2, 1.5, 2, 3, 5)),
    "previous step": (lambda r: r["prev"], None),
    "steps since chunk": (lambda r: r["since_chunk"], (1, 2, 4, 8, 32)),
    "waiting": (lambda r: r["waiting"], (0, 2, 8, 32)),
    "threads": (lambda r: r["threads"], None),
}


def group_residuals(rows: list[dict]) -> dict:
    """``{feature: {bucket: {"n", "t_s", "pred_s", "err", "ratio_p50"}}}`` (err: signed error
    of the summed prediction, < 0 when the model is too fast)."""
    out: dict = {}
    for name, (get, edges) in GROUPS.items():
        by: dict[str, list[dict]] = {}
        for r in rows:
            v = get(r)
            if v is None:
                continue
            k = _bucket(v, edges) if edges else str(v)
            by.setdefault(k, []).append(r)
        if edges:  # buckets in edge order, the overflow last
            labels = [f"<={e:g}" for e in edges] + [f">{edges[-1]:g}"]
            by = {k: by[k] for k in labels if k in by}
        else:
            by = dict(sorted(by.items()))
        out[name] = {
            k: {
                "n": len(g),
                "t_s": sum(r["t"] for r in g),
                "pred_s": sum(r["pred"] for r in g),
                "err": sum(r["pred"] for r in g) / sum(r["t"] for r in g) - 1,
                "ratio_p50": percentile([r["t"] / r["pred"] for r in g], 50),
            }
            for k, g in by.items()
        }
    return out


def profile_rows(cm_file, cm) -> list[dict]:
    """The profile's own decode samples as ``decode_rows`` rows (no record fields: their
    decodes share one context length, so max = mean)."""
    rows = []
    samples = cm_file.samples()
    for i, (s, t) in enumerate(samples):
        if s.shape_class != "decode":
            continue
        b = s.decode_seqs
        rows.append(
            {
                "t": t,
                "pred": cm.step_cost(s),
                "decodes": b,
                "context": s.context_tokens,
                "mean_context": s.context_tokens / b,
                "max_context": None,
                "spread": None,
                "prev": samples[i - 1][0].shape_class if i else "none",
                "since_chunk": None,
                "waiting": None,
                "outside_exec_s": None,
                "threads": None,
            }
        )
    return rows


def print_groups(title: str, groups: dict, out=None) -> None:
    out = out or sys.stdout
    print(title, file=out)
    print(
        f"  {'feature':18}{'bucket':>10}{'steps':>7}{'real s':>9}{'pred s':>9}{'err':>8}{'ratio p50':>10}",
        file=out,
    )
    for name, g in groups.items():
        for k, v in g.items():
            print(
                f"  {name:18}{k:>10}{v['n']:>7}{v['t_s']:9.2f}{v['pred_s']:9.2f}{v['err']:+8.1%}{v['ratio_p50']:10.3f}",
                file=out,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", help="the --steps-out file of a fidelity run")
    ap.add_argument("--cost-model", required=True, help="profile JSON (kvserve profile)")
    ap.add_argument("--json-out", default=None)
    ns = ap.parse_args(argv)
    try:
        records, _, cm_file = load_replay(ns.steps, ns.cost_model)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    cm = cm_file.cost_model
    rows = decode_rows(records, cm)
    if not rows:
        print("no pure decode steps in the records", file=sys.stderr)
        return 1
    real = group_residuals(rows)
    prof = group_residuals(profile_rows(cm_file, cm))
    outside = sum(r["outside_exec_s"] for r in rows) / sum(r["t"] for r in rows)
    print(f"{len(rows)} decode steps of {len(records)}; time outside the executor {outside:.1%} of theirs")
    print_groups("real decode steps (replay):", real)
    print_groups("the profile's decode samples:", prof)
    if ns.json_out:
        write_json(ns.json_out, {"real": real, "profile": prof, "outside_exec_share": outside})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
