#!/usr/bin/env python
"""What the dynamic draft-length policy decided against what its steps cost, in one process.

    python benchmarks/spec_decode_cost_trace.py --dtype bfloat16 --batch 8 --rounds 2

Three engines on ``kvserve bench spec-decode``'s input-grounded prompts (greedy, the first
``--batch`` requests at once, ``--output-len`` tokens):

- ``sweep``: every decode step is forced to a draft total cycling over ``0 .. batch * k`` (a
  proposer that always proposes ``k`` tokens), so each row count of a decode-only step gets
  measured at this batch's contexts: the real cost curve, ``rows -> seconds`` (wall-clock
  and the engine thread's CPU time, min and median per row count);
- ``off`` (speculation off) and ``dynamic`` (n-gram, the default policy, tracing), run
  alternately ``--rounds`` times; whole ``step()`` times (wall and thread CPU) per output
  token of the decode phase (after every request has its first token), best round each.

Then the dynamic run's decisions: base rows, drafts chosen, the model's predicted cost of the
step with and without them, and the sweep's measured cost at those row counts (the
prediction's error is the policy's error), and the run's counts: steps without a proposal,
drafts per verify, accepted per verify, verify-step cost / decode-step cost. ``--json-out``
keeps it all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from spec_decode_steps import add_workload_args  # noqa: E402  (a sibling script: its shared flags)


def _engine(ns, spec):
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            model=ns.model,
            dtype=ns.dtype,
            kv_cache_memory_gib=ns.kv_cache_memory_gib,
            enable_prefix_caching=False,
            speculative_config=spec,
        )
    )


def _run(engine, reqs, tag):
    """Greedy run of ``reqs`` at once: decode-phase wall / CPU seconds, tokens, finals."""
    from kvserve import SamplingParams

    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    started: set[str] = set()
    finals, counts = {}, {}
    wall = cpu = 0.0
    steps = 0
    before = None
    while engine.has_unfinished_requests():
        all_started = len(started) == len(reqs)
        if all_started and before is None:
            before = sum(counts.values())
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = engine.step()
        dw, dc = time.perf_counter() - t0, time.thread_time() - c0
        for out in outs:
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
                counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
        if all_started:
            wall, cpu, steps = wall + dw, cpu + dc, steps + 1
    n = sum(len(t) for t in finals.values()) - (before or 0)
    return {
        "wall_ms_per_token": 1e3 * wall / max(1, n),
        "cpu_ms_per_token": 1e3 * cpu / max(1, n),
        "decode_steps": steps,
        "decode_tokens": n,
        "tokens": [finals[f"{tag}-{i}"] for i in range(len(reqs))],
    }


def _force_sweep(engine, k: int, batch: int) -> None:
    """Make ``engine`` (dynamic) draft a cycling total every decode step, from a proposer that
    always proposes ``k`` tokens (they are verified as any drafts: output is unchanged)."""
    from kvserve.spec_decode.interfaces import Proposal, Proposer

    class Always(Proposer):
        def propose(self, req, kk):
            out = {}
            for md in req.seq_group_metadata_list:
                m = min(kk, md.num_speculative_tokens)
                if not md.is_prompt and m >= 1:
                    for sid, data in md.seq_data.items():
                        out[sid] = Proposal([data.get_last_token_id()] * m, match_len=4)
            return out

    ex = engine.executor
    ex.proposer = Always()
    pol = ex.policy
    state = {"i": 0}
    schedule = list(range(0, batch * k + 1))

    def forced(metas, cands, pinned_rows=0):
        total = schedule[state["i"] % len(schedule)]
        state["i"] += 1
        ks = {c.seq_id: 0 for c in cands}
        left = total
        while left > 0 and any(ks[c.seq_id] < c.max_drafts for c in cands):
            for c in cands:
                if left > 0 and ks[c.seq_id] < c.max_drafts:
                    ks[c.seq_id] += 1
                    left -= 1
        return ks

    pol._allocate = forced


def _trace(pol) -> list:
    """Start recording ``pol``'s steps; returns the list it fills. A policy without a
    ``trace`` attribute (an older version, for a before/after comparison) is wrapped."""
    if hasattr(pol, "trace"):
        pol.trace = []
        return pol.trace
    from kvserve.spec_decode.draft_policy import base_rows

    trace: list = []
    pending: dict = {}
    alloc, observe, verified = pol._allocate, pol.observe_step, pol.observe_verified

    def _allocate(metas, cands, pinned_rows=0):
        ks = alloc(metas, cands, pinned_rows)
        base = base_rows(metas) + pinned_rows
        n = sum(ks.values())
        cost = pol.cost_model.cost
        pending.update(
            base_rows=base,
            prefill=any(md.is_prompt for md in metas),
            cands=[(c.max_drafts, round(c.p_accept, 3)) for c in cands],
            drafts=n,
            pred_base_s=cost(base),
            pred_s=cost(base + n),
        )
        return ks

    def observe_step(rows, seconds, *args, **kw):
        entry = dict(pending)
        pending.clear()
        entry.update(rows=rows, wall_s=seconds, cpu_s=float("nan"))
        entry.setdefault("prefill", rows > 64 and "drafts" not in entry)
        trace.append(entry)
        return observe(rows, seconds, *args, **kw)

    def observe_verified(drafted, accepted):
        if trace:
            trace[-1].update(
                verified=sum(drafted.values()), accepted=sum(accepted.get(s, 0) for s in drafted)
            )
        return verified(drafted, accepted)

    pol._allocate, pol.observe_step, pol.observe_verified = _allocate, observe_step, observe_verified
    return trace


def _curve(trace) -> dict[int, dict]:
    by: dict[int, list[tuple[float, float]]] = {}
    for e in trace:
        if not e.get("prefill"):
            by.setdefault(e["rows"], []).append((e["wall_s"], e["cpu_s"]))
    out = {}
    for r, xs in sorted(by.items()):
        w = [x[0] for x in xs]
        c = [x[1] for x in xs]
        out[r] = {
            "n": len(xs),
            "wall_min_ms": 1e3 * min(w),
            "wall_med_ms": 1e3 * statistics.median(w),
            "cpu_min_ms": 1e3 * min(c),
            "cpu_med_ms": 1e3 * statistics.median(c),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, dtype="bfloat16", rounds=2, output_len=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sweep-rounds", type=int, default=1)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--curve-from", default=None, help="take the sweep's curve from an earlier --json-out")
    p.add_argument("--show", type=int, default=40, help="decision steps printed")
    p.add_argument("--json-out", default=None)
    ns = p.parse_args()

    from kvserve.benchmarks.spec_decode import build_workload
    from kvserve.model_executor.model_loader import resolve_model_dir
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    k = ns.num_speculative_tokens
    tok = load_tokenizer(resolve_model_dir(ns.model))
    reqs = build_workload(tok, ns.batch, ns.prompt_len, ns.output_len)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": ns.prompt_lookup_min,
        "prompt_lookup_max": ns.prompt_lookup_max,
        "disable_below_acceptance_rate": 0.0,
    }
    off = _engine(ns, None)
    dyn = _engine(ns, dict(spec))
    _run(off, reqs[:1], "warm")
    _run(dyn, reqs[:1], "warm")
    result: dict = {"args": vars(ns)}
    curve = {}
    if ns.curve_from:
        curve = {int(r): c for r, c in json.loads(Path(ns.curve_from).read_text())["sweep"].items()}
    elif not ns.no_sweep:
        sw = _engine(ns, dict(spec))
        _run(sw, reqs[:1], "warm")
        sweep_trace = _trace(sw.executor.policy)
        _force_sweep(sw, k, ns.batch)
        for i in range(ns.sweep_rounds):
            _run(sw, reqs, f"sweep{i}")
        curve = _curve(sweep_trace)
        result["sweep"] = curve
        print(f"sweep: decode-only step (forward + verify) by rows, dtype {ns.dtype}, batch {ns.batch}")
        print(f"{'rows':>5} {'n':>3} {'wall min':>9} {'wall med':>9} {'cpu min':>8} {'cpu med':>8}")
        for r, c in curve.items():
            print(
                f"{r:>5} {c['n']:>3} {c['wall_min_ms']:9.2f} {c['wall_med_ms']:9.2f} "
                f"{c['cpu_min_ms']:8.2f} {c['cpu_med_ms']:8.2f}"
            )
        del sw
    best: dict[str, dict] = {}
    trace: list = []
    for i in range(ns.rounds):
        r_off = _run(off, reqs, f"off{i}")
        pol = dyn.executor.policy
        trace = _trace(pol) if i == 0 or hasattr(pol, "trace") else trace
        trace.clear()
        r_dyn = _run(dyn, reqs, f"dyn{i}")
        r_dyn["trace"] = list(trace)
        r_dyn["same"] = r_dyn["tokens"] == r_off["tokens"]
        for name, r in (("off", r_off), ("dynamic", r_dyn)):
            if name not in best or r["wall_ms_per_token"] < best[name]["wall_ms_per_token"]:
                best[name] = r
        print(
            f"round {i}: off {r_off['wall_ms_per_token']:.2f} ms/tok wall ({r_off['cpu_ms_per_token']:.2f} cpu), "
            f"dynamic {r_dyn['wall_ms_per_token']:.2f} ({r_dyn['cpu_ms_per_token']:.2f} cpu): "
            f"x off wall {r_off['wall_ms_per_token'] / r_dyn['wall_ms_per_token']:.3f}, "
            f"cpu {r_off['cpu_ms_per_token'] / r_dyn['cpu_ms_per_token']:.3f}; same tokens {r_dyn['same']}"
        )
    trace = best["dynamic"]["trace"]
    dec = [e for e in trace if "drafts" in e and not e.get("prefill")]
    print(f"\ndynamic, best round: {len(trace)} forwards, {len(dec)} decode steps with a decision")
    print(
        f"{'base':>4} {'drafts':>6} {'pred base':>9} {'pred':>8} {'actual':>8} {'sweep':>8}  cands (cap, p)"
    )
    for e in dec[: ns.show]:
        sweep_ms = curve.get(e["rows"], {}).get("wall_med_ms", float("nan"))
        cands = " ".join(f"{m}:{p:.2f}" for m, p in e["cands"])
        print(
            f"{e['base_rows']:>4} {e['drafts']:>6} {1e3 * e['pred_base_s']:9.2f} {1e3 * e['pred_s']:8.2f} "
            f"{1e3 * e['wall_s']:8.2f} {sweep_ms:8.2f}  {cands}"
        )
    decode = [e for e in trace if not e.get("prefill")]
    verify = [e for e in decode if e.get("verified")]
    plain = [e for e in decode if not e.get("verified")]
    no_cand = [e for e in decode if "drafts" not in e]
    summary = {
        "decode_forwards": len(decode),
        "without_proposal": len(no_cand),
        "decided_none": sum(1 for e in decode if e.get("drafts") == 0),
        "verify_steps": len(verify),
        "drafts_per_verify": statistics.mean(e["verified"] for e in verify) if verify else 0.0,
        "accepted_per_verify": statistics.mean(e["accepted"] for e in verify) if verify else 0.0,
        "verify_ms_med": 1e3 * statistics.median(e["wall_s"] for e in verify) if verify else None,
        "plain_ms_med": 1e3 * statistics.median(e["wall_s"] for e in plain) if plain else None,
        "actual_over_pred_med": statistics.median(e["wall_s"] / e["pred_s"] for e in dec) if dec else None,
        "pred_error_med": statistics.median(
            e["pred_s"] / (curve[e["rows"]]["wall_med_ms"] / 1e3) - 1 for e in dec if e["rows"] in curve
        )
        if curve and any(e["rows"] in curve for e in dec)
        else None,
    }
    print("summary:", json.dumps(summary))
    get_params = getattr(dyn.executor.policy.cost_model, "params", None)
    params = get_params(False) if get_params is not None else None
    print("learned decode fit (a, b, c, R0):", params)
    result.update(
        summary=summary,
        fit=params,
        off={kk: v for kk, v in best["off"].items() if kk != "tokens"},
        dynamic={kk: v for kk, v in best["dynamic"].items() if kk != "tokens"},
    )
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
