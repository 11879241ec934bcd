"""``kvserve bench fidelity``: the same timed requests through the real engine and the simulator.

Both sides get identical inputs: the trace's arrival times (times ``--time-scale``), prompts of
the trace's (capped) lengths cut from the shared corpus, ``max_tokens`` = the trace's output
length with ``ignore_eos`` and greedy sampling, and the same engine settings: the simulator is
built from the real engine's resolved configs (block counts, step budget, chunked prefill,
policy, preemption mode). The real engine is ``LLMEngine`` in this process on the wall clock
(what ``LLM`` and the server run); the simulator is the same engine class on
``SimulatedExecutor`` with the profiled cost model (``--cost-model``; without one the real
engine is profiled first, ``--profile-grid``). One loop (``kvserve.sim.replay``) drives both.

Prints TTFT, TPOT, inter-token latency, end-to-end latency and queue time (mean, p50, p90,
p99), preemptions and output throughput side by side with the relative error
``(simulated - real) / real``, and how many of the requests preempted on one side were
preempted on the other. ``--json-out`` writes ``{"real": S, "simulated": S, "relative_error":
S, ...}``; ``--plot`` a CDF plot (real vs simulated). ``--steps-out FILE`` writes a record of
every real step (``kvserve.sim.step_record``: shape, wall time of the step, the executor call
and the loop iteration, GC) and prints predicted vs measured step time by shape class and size
(``--real-from`` with ``--real-steps FILE`` prints it again, for any ``--cost-model``) and
runs the *oracle* replay (``kvserve.sim.oracle``): the simulator charged each real step's
measured time, which separates the simulation's own error (should be ~0) from the cost model's.

``--real-from RESULT.json`` runs no real engine: it takes the real side (its latencies, the
trace, time scale, caps and engine settings) from an earlier run's ``--json-out`` and simulates
the same requests with ``--cost-model``, so a changed cost model (or fit) is judged against a
recorded quiet run; with ``--real-steps STEPS.json`` (that run's ``--steps-out``) the oracle runs
too. Files written before the engine settings were recorded need the run's engine flags again,
or ``--real-steps`` (whose meta holds them); unset KV-cache sizes then come from the profile's.
``--real-steps`` must be the ``--real-from`` run's (same trace, same engine arguments); flags the
re-simulation would ignore (the trace's, ``--steps-out``, the ``--profile-*`` grid, engine flags
when the files record the run's) are errors, as are ``--profile-out`` and the grid flags with
``--cost-model``. Bad input is a one-line ``Error:`` (exit status 2) before the engine is built;
output paths are checked first and every file is written whole (atomically).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Set as AbstractSet
from pathlib import Path

from kvserve.benchmarks.common import system_info
from kvserve.sim.cli_checks import (
    check_arrival_span,
    check_float,
    check_int,
    flag_of,
    given_dests,
    refuse_unused,
)
from kvserve.sim.replay import (
    LATENCY_KEYS,
    STAT_KEYS,
    ReplayResult,
    sim_replay,
    summarize_replay,
    wall_replay,
)
from kvserve.workload import workload as wl
from kvserve.workload.io import check_output_path, write_json

#: keys of a side's summary ``S`` in the JSON (``--json-out``)
SUMMARY_KEYS = (*LATENCY_KEYS, "num_preemptions", "output_tok_s")
#: Longest span of arrivals (seconds) a replay may have: the real side waits for them in real
#: time, so a time scale stretching a trace past a day is a typo, not a run to wait for.
MAX_REPLAY_S = 86400.0


def side(summary: dict) -> dict:
    """The JSON's ``S``: each latency ``{mean, p50, p90, p99}`` (seconds), ``num_preemptions``,
    ``output_tok_s``."""
    out: dict = {k: {q: summary[k].get(q) for q in STAT_KEYS} for k in LATENCY_KEYS}
    out["num_preemptions"] = summary["num_preemptions"]
    out["output_tok_s"] = summary["output_tok_s"]
    return out


def _rel(sim, real):
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None  # undefined: shown as "-"
    return (sim - real) / real


def relative_error(real: dict, sim: dict) -> dict:
    """``(simulated - real) / real`` for every number of ``side``'s layout (None where the real
    value is 0 and the simulated one is not, or either is missing)."""
    out: dict = {k: {q: _rel(sim[k][q], real[k][q]) for q in STAT_KEYS} for k in LATENCY_KEYS}
    out["num_preemptions"] = _rel(sim["num_preemptions"], real["num_preemptions"])
    out["output_tok_s"] = _rel(sim["output_tok_s"], real["output_tok_s"])
    return out


def preemption_agreement(real_ids: list[int], sim_ids: list[int]) -> dict:
    """How far the two sides preempted the same requests: counts and the Jaccard index of the
    two sets (1.0 when both preempted none)."""
    a, b = set(real_ids), set(sim_ids)
    union = a | b
    return {
        "real": len(a),
        "simulated": len(b),
        "both": len(a & b),
        "jaccard": len(a & b) / len(union) if union else 1.0,
    }


def samples_ms(res: ReplayResult) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, e2e (ms) of finished requests, for the CDF plot."""
    out: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "e2e_ms": []}
    for rid, o in res.outcome.items():
        tt = res.token_times.get(rid) or []
        if o != "finished" or not tt:
            continue
        a = res.arrival[rid]
        out["ttft_ms"].append((tt[0] - a) * 1000)
        out["e2e_ms"].append((tt[-1] - a) * 1000)
        if len(tt) > 1:
            out["tpot_ms"].append((tt[-1] - tt[0]) / (len(tt) - 1) * 1000)
    return out


def print_comparison(real: dict, sim: dict, err: dict, out=None) -> None:
    """The side-by-side table (stdout by default)."""
    out = out or sys.stdout
    print(f"{'metric':14}{'real':>11}{'simulated':>11}{'rel err':>9}", file=out)
    for k in LATENCY_KEYS:
        for q in STAT_KEYS:
            r, s, e = real[k][q], sim[k][q], err[k][q]
            print(
                f"{k + ' ' + q:14}"
                + (f"{r:11.4f}" if r is not None else f"{'-':>11}")
                + (f"{s:11.4f}" if s is not None else f"{'-':>11}")
                + (f"{e:9.1%}" if e is not None else f"{'-':>9}"),
                file=out,
            )
    for k in ("num_preemptions", "output_tok_s"):
        e = err[k]
        print(
            f"{k:14}{real[k]:11.2f}{sim[k]:11.2f}" + (f"{e:9.1%}" if e is not None else f"{'-':>9}"), file=out
        )


def load_requests(ns) -> tuple[list[wl.BenchRequest], dict]:
    """The trace's first ``--num-requests`` rows, arrivals scaled, lengths capped."""
    try:
        corpus = wl.load_corpus()
    except ValueError:
        corpus = [3 + (i * 7919) % 40000 for i in range(1 << 17)]
    records = wl.scale_arrivals(
        wl.select_trace(wl.load_trace(ns.trace), num_requests=ns.num_requests), ns.time_scale
    )
    if records and records[0].arrival_s is None:
        raise ValueError(f"--trace {ns.trace}: the trace has no arrival times")
    # the real engine waits for each arrival in wall-clock time
    check_arrival_span(
        records, "--time-scale", MAX_REPLAY_S, "the real engine replays the arrivals in real time"
    )
    reqs, clip = wl.trace_to_requests(
        records, corpus, ns.max_model_len_cap, ns.max_input_len, ns.max_output_len, seed=ns.workload_seed
    )
    return reqs, clip.as_dict()


def requests_from_result(result: dict, path: str = "<result>") -> tuple[list[wl.BenchRequest], dict]:
    """The requests of a recorded run (its JSON's ``trace``: path, count, time scale, caps,
    workload seed), rebuilt as ``load_requests`` built them.

    Raises:
        ValueError: the file lacks the trace fields, or the trace is gone.
    """
    import argparse

    try:
        tr = result["trace"]
        clip = tr["clip"]
        ns = argparse.Namespace(
            trace=tr["path"],
            num_requests=int(tr["num_requests"]),
            time_scale=float(tr["time_scale"]),
            max_input_len=clip.get("max_input_len"),
            max_output_len=clip.get("max_output_len"),
            max_model_len_cap=int(clip["max_model_len"]),
            workload_seed=int(tr.get("workload_seed", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a bench fidelity result (trace field {e})") from e
    if not Path(ns.trace).is_file():
        raise ValueError(f"{path}: its trace {ns.trace} is not there")
    return load_requests(ns)


def oracle_comparison(real: dict, configs: tuple, records, vocab_size: int, requests, fallback) -> dict:
    """The oracle replay (``kvserve.sim.oracle``) of recorded steps against the real side
    ``real`` (``side``'s layout): ``{"simulated": S, "relative_error": S, "steps": the step
    comparison, "preempted_ids", "mode", "resync_s", "num_past_records", "duration_s"}``."""
    from kvserve.sim.oracle import oracle_replay

    res, cost, steps = oracle_replay(configs, records, vocab_size, requests, fallback=fallback)
    summ = summarize_replay(res)
    sim = side(summ)
    return {
        "simulated": sim,
        "relative_error": relative_error(real, sim),
        "steps": steps,
        "preempted_ids": summ["preempted_ids"],
        "mode": cost.describe(),
        "resync_s": cost.resync_s,
        "num_past_records": cost.num_past_records,
        "duration_s": summ["duration_s"],
    }


def print_oracle(o: dict, out=None) -> None:
    """The oracle's errors on the target metrics and its step check, a few lines."""
    out = out or sys.stdout
    e = o["relative_error"]

    def pct(v):
        return f"{v:+.2%}" if v is not None else "-"

    print(f"oracle replay ({o['mode']}):", file=out)
    print(
        "  error vs real: "
        + ", ".join(
            f"{k[:-2].upper()} {q} {pct(e[k][q])}"
            for k in ("ttft_s", "tpot_s", "e2e_s")
            for q in ("p50", "p90")
        ),
        file=out,
    )
    st = o["steps"]
    print(
        f"  steps: real {st['real_steps']}, simulated {st['simulated_steps']}, "
        f"{st['num_diverged']} with another shape"
        + (f" (first: {st['why']})" if st["why"] else " (same steps, same shapes, same order)"),
        file=out,
    )


def run_fidelity(
    engine, args, requests: list[wl.BenchRequest], cost_model, record_steps: bool = False
) -> dict:
    """Replay ``requests`` on ``engine`` (real, idle, warmed up) and on the simulator with
    ``cost_model`` and the engine's configs; returns the comparison (the JSON's layout; with
    ``record_steps`` also ``"_steps"``: the real side's ``StepRecord`` list)."""
    t0 = time.perf_counter()
    real_res = wall_replay(engine, requests, record_steps=record_steps)
    real_wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    configs = (engine.model_config, engine.cache_config, engine.scheduler_config)
    sim_res = sim_replay(configs, cost_model, engine.vocab_size or 49152, requests)
    sim_wall = time.perf_counter() - t1
    rs, ss = summarize_replay(real_res), summarize_replay(sim_res)
    real, sim = side(rs), side(ss)
    return {
        "real": real,
        "simulated": sim,
        "relative_error": relative_error(real, sim),
        "preempted_requests": preemption_agreement(rs["preempted_ids"], ss["preempted_ids"]),
        "finished": {"real": rs["num_finished"], "simulated": ss["num_finished"]},
        "duration_s": {"real": rs["duration_s"], "simulated": ss["duration_s"]},
        "num_steps": {"real": rs["num_steps"], "simulated": ss["num_steps"]},
        "num_extrapolated_steps": ss["num_extrapolated_steps"],
        "wall_s": {"real": real_wall, "simulated": sim_wall},
        "cost_model": cost_model.describe(),
        "preempted_ids": {"real": rs["preempted_ids"], "simulated": ss["preempted_ids"]},
        "_samples": {"real": samples_ms(real_res), "simulated": samples_ms(sim_res)},
        "_steps": real_res.steps,
    }


def engine_record(engine, args) -> dict:
    """What a re-simulation needs of the real engine (``--real-from``): the engine flags
    (``args``: ``EngineArgs``), the settings they resolved to (KV-cache sizes, step budget,
    chunked prefill, ``max_model_len``, sliding window), the vocabulary size, and the model
    (``model_identity``) and dtype it ran, which a later cost model must match."""
    import dataclasses

    from kvserve.sim.cost_model_file import model_identity

    cc, sc = engine.cache_config, engine.scheduler_config
    return {
        "args": {f.name: getattr(args, f.name) for f in dataclasses.fields(args)},
        "model": model_identity(args.model, args.quantization),
        "dtype": str(engine.model_config.resolved_dtype()).replace("torch.", ""),
        "resolved": {
            "num_gpu_blocks": cc.num_gpu_blocks,
            "num_cpu_blocks": cc.num_cpu_blocks,
            "sliding_window": cc.sliding_window,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "enable_chunked_prefill": sc.chunked_prefill_enabled,
            "max_model_len": sc.max_model_len,
        },
        "vocab_size": engine.vocab_size or 49152,
    }


def configs_from_record(args_dict: dict, resolved: dict | None, profile_engine: dict | None = None):
    """The real engine's ``(model_config, cache_config, scheduler_config)`` rebuilt without a
    model: ``args_dict`` (the engine flags) with ``resolved`` filled in (``engine_record``);
    without ``resolved`` (older files), unset KV-cache sizes, step budget, chunked prefill and
    ``max_model_len`` are the profiled engine's (``profile_engine``: the cost-model file's
    ``engine``; the same host's default engine). Returns ``(configs, notes)``: notes name each
    value taken from the profile.

    Raises:
        ValueError: a setting is out of range, or a KV-cache size is known from neither.
    """
    import dataclasses

    from kvserve.config import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in (args_dict or {}).items() if k in names}
    notes: list[str] = []
    if resolved is not None:
        kw.update(
            num_gpu_blocks=resolved["num_gpu_blocks"],
            num_cpu_blocks=resolved["num_cpu_blocks"],
            max_num_batched_tokens=resolved["max_num_batched_tokens"],
            enable_chunked_prefill=resolved["enable_chunked_prefill"],
            max_model_len=resolved["max_model_len"],
        )
        window = resolved.get("sliding_window")
    else:
        window = None
        prof = profile_engine or {}
        keys = ("num_gpu_blocks", "num_cpu_blocks", "max_num_batched_tokens", "max_model_len")
        for key in (*keys, "enable_chunked_prefill"):
            if kw.get(key) is None and prof.get(key) is not None:
                kw[key] = prof[key]
                notes.append(f"{key} {prof[key]} (the profiled engine's: the run did not record it)")
        for key in ("num_gpu_blocks", "num_cpu_blocks"):
            if kw.get(key) is None:
                raise ValueError(f"{key}: not recorded by the run and not in the profile's engine")
    args = EngineArgs(**kw)
    return args.create_configs(args.max_model_len or 8192, window), notes


#: the metrics the fidelity target is set on (docs/benchmarks.md): (latency, statistic)
TARGETS = (
    ("ttft_s", "p50"),
    ("ttft_s", "p90"),
    ("tpot_s", "p50"),
    ("tpot_s", "p90"),
    ("e2e_s", "p50"),
    ("e2e_s", "p90"),
)


def real_vs_real(a: dict, b: dict) -> dict:
    """Two real runs of one cell (``--json-out`` files ``a`` and ``b``) set against each other:
    ``{"relative_difference": S ((b - a) / a, ``side``'s layout), "targets": {"ttft_s p50": d,
    ...}, "max_abs_target": the largest |d| of ``TARGETS``, "duration_s", "num_steps": [a, b],
    "preempted_requests": agreement or None}`` -- the host's noise floor: no simulator can be
    closer to one real run than the two real runs are to each other.

    Raises:
        ValueError: either lacks a real side, or they replay different traces.
    """
    for name, r in (("A", a), ("B", b)):
        if not isinstance(r, dict) or not isinstance(r.get("real"), dict):
            raise ValueError(f"{name}: not a bench fidelity result (no 'real' field)")
    ta, tb = a.get("trace") or {}, b.get("trace") or {}
    for key in ("path", "num_requests", "time_scale", "clip"):
        va, vb = ta.get(key), tb.get(key)
        if key == "path":  # relative to each run's directory: the file name must match
            va, vb = Path(str(va)).name, Path(str(vb)).name
        if va != vb:
            raise ValueError(
                f"the runs replay different requests: trace {key} {ta.get(key)!r} vs {tb.get(key)!r}"
            )
    diff = relative_error(a["real"], b["real"])
    targets = {f"{k} {q}": diff[k][q] for k, q in TARGETS}
    known = [abs(v) for v in targets.values() if v is not None]
    ids_a = (a.get("preempted_ids") or {}).get("real")
    ids_b = (b.get("preempted_ids") or {}).get("real")
    return {
        "relative_difference": diff,
        "targets": targets,
        "max_abs_target": max(known) if known else None,
        "duration_s": [(a.get("duration_s") or {}).get("real"), (b.get("duration_s") or {}).get("real")],
        "num_steps": [(a.get("num_steps") or {}).get("real"), (b.get("num_steps") or {}).get("real")],
        "preempted_requests": None if ids_a is None or ids_b is None else preemption_agreement(ids_a, ids_b),
    }


def _warm_up(engine, prompt_ids: list[int]) -> None:
    """Two small requests before the clock starts (first-call costs), as the profiler does."""
    from kvserve.sampling_params import SamplingParams

    for i in range(2):
        engine.add_request(
            f"fidelity-warmup-{i}",
            {"prompt_token_ids": prompt_ids[:32]},
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
        )
    while engine.has_unfinished_requests():
        engine.step()


def build_parser() -> argparse.ArgumentParser:
    from kvserve.entrypoints.cli import add_engine_args

    ap = argparse.ArgumentParser(
        prog="kvserve bench fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--trace", default=None, help="trace with arrival times (azure csv, vidur csv, mooncake jsonl)"
    )
    ap.add_argument(
        "--num-requests", type=int, default=200, help="the trace's first N requests (default 200)"
    )
    ap.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply trace arrival times by this (default 1)"
    )
    ap.add_argument("--max-input-len", type=int, default=None, help="cap prompt lengths")
    ap.add_argument("--max-output-len", type=int, default=None, help="cap output lengths")
    ap.add_argument("--workload-seed", type=int, default=0, help="seed for the synthesised prompts")
    ap.add_argument("--cost-model", default=None, help="profile JSON (kvserve profile); default: profile now")
    ap.add_argument("--profile-out", default=None, help="where to save the profile made now")
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--steps-out", default=None, help="JSON of every real step (shape, wall times), for --real-steps"
    )
    ap.add_argument("--plot", default=None, help="PNG of the latency CDFs, real vs simulated")
    ap.add_argument(
        "--real-from",
        default=None,
        metavar="RESULT.json",
        help="no real run: take the real side from this earlier --json-out and simulate with --cost-model",
    )
    ap.add_argument(
        "--real-steps",
        default=None,
        metavar="STEPS.json",
        help="with --real-from: that run's --steps-out (the oracle replay; engine flags of older files)",
    )
    ap.add_argument("--no-progress", action="store_true")
    from kvserve.sim.profile import add_grid_args

    add_grid_args(ap, prefix="profile-")  # the grid when profiling now (no --cost-model)
    add_engine_args(ap)
    return ap


#: the flags that choose and shape the live run's requests (a --real-from run takes its own)
_TRACE_FLAGS = ("trace", "num_requests", "time_scale", "max_input_len", "max_output_len", "workload_seed")
#: the flags of the output files a run writes
_OUT_FLAGS = ("json_out", "steps_out", "plot", "profile_out")


def _profile_dests(ns) -> list[str]:
    """The ``--profile-*`` grid flags' destinations (``add_grid_args(prefix="profile-")``)."""
    return [k for k in vars(ns) if k.startswith("profile_") and k != "profile_out"]


def _check_outputs(ns) -> None:
    """Every output path given can be written (before a run of minutes).

    Raises:
        ValueError: naming the flag (``check_output_path``).
    """
    for dest in _OUT_FLAGS:
        path = getattr(ns, dest, None)
        if path:
            check_output_path(flag_of(dest), path)


def _check_live_flags(ns, given: set[str]) -> None:
    """A live run's own flags, before the engine is built.

    Raises:
        ValueError: a value out of range, a flag the run would ignore (``--profile-out`` and the
            ``--profile-*`` grid with ``--cost-model``), or an output path that cannot be
            written, naming the flag.
    """
    from kvserve.sim.profile import SPEC_NOT_PROFILED

    # the simulated side replays without an acceptance model: a speculating real run would be
    # compared with a simulation that never speculates
    refuse_unused(given, ["speculative_config"], SPEC_NOT_PROFILED)
    check_int("--num-requests", ns.num_requests)
    for name in ("max_input_len", "max_output_len"):
        if getattr(ns, name) is not None:
            check_int(flag_of(name), getattr(ns, name))
    check_int("--workload-seed", ns.workload_seed, lo=0)
    check_float("--time-scale", ns.time_scale, lo=0.0, lo_open=False, meaning="0 = every request at t=0")
    if ns.cost_model:
        refuse_unused(
            given,
            ["profile_out", *_profile_dests(ns)],
            "does not apply with --cost-model (nothing is profiled: the file's cost model is used)",
        )
    _check_outputs(ns)


def _print_result(result: dict) -> None:
    """The comparison a run (or a re-simulation) prints."""
    print_comparison(result["real"], result["simulated"], result["relative_error"])
    if result["num_extrapolated_steps"]:
        print(
            f"note: {result['num_extrapolated_steps']} simulated steps were larger than any profiled "
            f"(their times are extrapolated: profile a larger grid)"
        )
    pa = result["preempted_requests"]
    jac = f"{pa['jaccard']:.2f}" if pa.get("jaccard") is not None else "- (ids not recorded)"
    print(
        f"preempted requests: real {pa['real']}, simulated {pa['simulated']}, both {pa.get('both', '-')} "
        f"(Jaccard {jac})"
    )
    if "oracle" in result:
        print_oracle(result["oracle"])


def main(argv: list[str] | None = None) -> int:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.cli import engine_args_from, flag_names
    from kvserve.sim.cost_model_file import load_cost_model, parse_cost_model, save_cost_model
    from kvserve.sim.profile import grid_flags, grid_from_args, profile_engine

    ap = build_parser()
    ns = ap.parse_args(argv)
    given = given_dests(ap, argv, ns)
    if ns.real_from:
        return _main_real_from(ns, given)
    if ns.real_steps:
        print("Error: --real-steps goes with --real-from (a live run records its own steps)", file=sys.stderr)
        return 2
    if not ns.trace:
        print("Error: --trace is required (or --real-from RESULT.json)", file=sys.stderr)
        return 2
    if not Path(ns.trace).is_file():
        print(f"Error: --trace {ns.trace}: no such file", file=sys.stderr)
        return 2
    try:
        _check_live_flags(ns, given)
        args = engine_args_from(ns)
        args.create_configs(args.max_model_len or 1 << 31)  # the settings' ranges, before a model loads
    except ValueError as e:
        print(f"Error: {flag_names(str(e))}", file=sys.stderr)
        return 2
    try:
        cm_file = load_cost_model(ns.cost_model) if ns.cost_model else None
        if cm_file is not None:
            cm_file.check_engine_args(args)
        engine = LLMEngine.from_engine_args(args)
        ns.max_model_len_cap = engine.scheduler_config.max_model_len
        try:
            requests, clip = load_requests(ns)
        except ValueError as e:  # the file's errors start with its path: name the flag too
            raise ValueError(f"--trace {e}" if str(e).startswith(str(ns.trace)) else str(e)) from None
        if not requests:
            raise ValueError(f"--trace {ns.trace}: no requests selected")
        if cm_file is None:
            grid = grid_from_args(ns, prefix="profile-")
            flags = grid_flags(ns, prefix="profile-")
            data = profile_engine(engine, args, grid, progress=not ns.no_progress, flags=flags)
            if ns.profile_out:
                save_cost_model(ns.profile_out, data)
            cm_file = parse_cost_model(data, ns.profile_out or "<profiled now>")
        _warm_up(engine, requests[0].prompt_token_ids)
        print(f"cost model: {cm_file.cost_model.describe()}")
        print(f"replaying {len(requests)} requests through the real engine (wall clock) ...", flush=True)
        result = run_fidelity(engine, args, requests, cm_file.cost_model, record_steps=bool(ns.steps_out))
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    samples = result.pop("_samples")
    steps = result.pop("_steps")
    result["trace"] = {
        "path": ns.trace,
        "num_requests": len(requests),
        "time_scale": ns.time_scale,
        "workload_seed": ns.workload_seed,
        "clip": clip,
    }
    result["engine"] = engine_record(engine, args)
    result["samples_ms"] = {"real": samples["real"]}
    if steps:
        configs = (engine.model_config, engine.cache_config, engine.scheduler_config)
        result["oracle"] = oracle_comparison(
            result["real"], configs, steps, result["engine"]["vocab_size"], requests, cm_file.cost_model
        )
    result["system"] = system_info()
    # The worker picks its thread count by measuring (again every few hundred steps): a profile
    # taken under other load may hold another count, and its step costs then do not apply.
    import torch

    threads = {"profile": (cm_file.data.get("host") or {}).get("threads"), "real": torch.get_num_threads()}
    result["threads"] = threads
    if threads["profile"] is not None and threads["profile"] != threads["real"]:
        print(
            f"note: the cost model was profiled with {threads['profile']} threads, the real engine ended "
            f"with {threads['real']} (the host's load differed; KVSERVE_NUM_THREADS fixes the count)"
        )
    print(
        f"real: {result['finished']['real']} finished in {result['duration_s']['real']:.1f} s; simulated: "
        f"{result['finished']['simulated']} in {result['duration_s']['simulated']:.1f} virtual s "
        f"({result['wall_s']['simulated']:.2f} s to simulate)"
    )
    _print_result(result)
    if ns.json_out:
        write_json(ns.json_out, result)
    if ns.steps_out:
        from kvserve.sim.step_record import compare_steps, save_steps
        from kvserve.sim.step_record import print_comparison as print_steps

        save_steps(
            ns.steps_out,
            steps,
            {"trace": result["trace"], "cost_model": cm_file.cost_model.coefficients(), "engine": vars(args)},
        )
        print(f"wrote {len(steps)} step records to {ns.steps_out}; predicted vs measured step time:")
        print_steps(compare_steps(steps, cm_file.cost_model))
    if ns.plot:
        from kvserve.benchmarks.plots import plot_latency_cdfs

        print(
            f"wrote {plot_latency_cdfs(samples, ns.plot, title='real vs simulated: ' + Path(ns.trace).name)}"
        )
    return 0


def _load_result(path: str) -> dict:
    import json

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise ValueError(f"--real-from {path}: no such file") from e
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        raise ValueError(f"--real-from {path}: not a JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("real"), dict) or "trace" not in data:
        raise ValueError(f"--real-from {path}: not a bench fidelity result (no 'real' and 'trace' fields)")
    missing = [k for k in SUMMARY_KEYS if k not in data["real"]]
    if missing:
        raise ValueError(f"--real-from {path}: real side lacks {missing}")
    return data


def resimulate(recorded: dict, cm_file, args_dict: dict, steps=None, path: str = "<result>") -> dict:
    """The real side of a recorded run (``recorded``: its ``--json-out``) against a new
    simulation of the same requests with ``cm_file`` (a loaded cost-model file); ``args_dict``:
    the engine flags when the file has none; ``steps``: that run's step records (then the
    oracle runs too). Returns the JSON's layout, plus ``real_from`` and ``notes``.

    Raises:
        ValueError: a malformed file, a trace that is gone, a mismatched profile.
    """
    from kvserve.config import EngineArgs

    rec_engine = recorded.get("engine") or {}
    args_dict = rec_engine.get("args") or args_dict
    kw = {k: args_dict.get(k) for k in ("model", "dtype", "block_size", "quantization")}
    cm_file.check_engine_args(EngineArgs(**{k: v for k, v in kw.items() if v is not None}))
    cm_file.check_recorded_run(rec_engine.get("model"), rec_engine.get("dtype"), path)
    configs, notes = configs_from_record(args_dict, rec_engine.get("resolved"), cm_file.engine)
    vocab = int(rec_engine.get("vocab_size") or 49152)
    requests, _ = requests_from_result(recorded, path)
    t1 = time.perf_counter()
    sim_res = sim_replay(configs, cm_file.cost_model, vocab, requests)
    sim_wall = time.perf_counter() - t1
    ss = summarize_replay(sim_res)
    real, sim = recorded["real"], side(ss)
    real_ids = (recorded.get("preempted_ids") or {}).get("real")
    if real_ids is not None:
        agree = preemption_agreement(real_ids, ss["preempted_ids"])
    else:  # older files kept counts only
        agree = {
            "real": recorded.get("preempted_requests", {}).get("real"),
            "simulated": len(ss["preempted_ids"]),
        }
        agree.update(both=None, jaccard=None)
    out = {
        "real": real,
        "simulated": sim,
        "relative_error": relative_error(real, sim),
        "preempted_requests": agree,
        "finished": {"real": recorded.get("finished", {}).get("real"), "simulated": ss["num_finished"]},
        "duration_s": {"real": recorded.get("duration_s", {}).get("real"), "simulated": ss["duration_s"]},
        "num_steps": {"real": recorded.get("num_steps", {}).get("real"), "simulated": ss["num_steps"]},
        "num_extrapolated_steps": ss["num_extrapolated_steps"],
        "wall_s": {"simulated": sim_wall},
        "cost_model": cm_file.cost_model.describe(),
        "preempted_ids": {"real": real_ids, "simulated": ss["preempted_ids"]},
        "trace": recorded["trace"],
        "engine": rec_engine or {"args": args_dict},
        "real_from": path,
        "real_system": recorded.get("system"),
        "notes": notes,
        "_samples": {
            "real": (recorded.get("samples_ms") or {}).get("real"),
            "simulated": samples_ms(sim_res),
        },
    }
    if steps is not None:
        out["oracle"] = oracle_comparison(real, configs, steps, vocab, requests, cm_file.cost_model)
    return out


def _check_steps_match(recorded: dict, meta: dict, real_from: str, real_steps: str) -> None:
    """``--real-steps`` must be the steps file of the ``--real-from`` run: the same trace
    (file name, request count, time scale, caps) and, where both record them, the same engine
    arguments.

    Raises:
        ValueError: naming both flags and the first field that differs.
    """
    rt, st = recorded.get("trace") or {}, meta.get("trace")
    if isinstance(st, dict):
        for key in ("path", "num_requests", "time_scale", "workload_seed", "clip"):
            a, b = rt.get(key), st.get(key)
            if key == "path":
                a, b = Path(str(a)).name, Path(str(b)).name
            if key in rt and key in st and a != b:
                raise ValueError(
                    f"--real-steps {real_steps} records another run than --real-from {real_from}: "
                    f"trace {key} {st.get(key)!r} vs {rt.get(key)!r}"
                )
    ra, sa = (recorded.get("engine") or {}).get("args"), meta.get("engine")
    if isinstance(ra, dict) and isinstance(sa, dict):
        for key in sorted(set(ra) & set(sa)):
            if str(ra[key]) != str(sa[key]):  # the steps file's meta went through str()
                raise ValueError(
                    f"--real-steps {real_steps} records another engine than --real-from {real_from}: "
                    f"{key} {sa[key]!r} vs {ra[key]!r}"
                )


def _main_real_from(ns: argparse.Namespace, given: AbstractSet[str] = frozenset()) -> int:
    import dataclasses

    from kvserve.config import EngineArgs
    from kvserve.sim.cost_model_file import load_cost_model
    from kvserve.sim.step_record import load_steps

    if not ns.cost_model:
        print("Error: --real-from needs --cost-model (there is no engine to profile)", file=sys.stderr)
        return 2
    engine_dests = [f.name for f in dataclasses.fields(EngineArgs)]
    try:
        from kvserve.sim.profile import SPEC_NOT_PROFILED

        refuse_unused(given, ["speculative_config"], SPEC_NOT_PROFILED)
        why = "does not apply with --real-from (the recorded run's is used)"
        refuse_unused(given, _TRACE_FLAGS, why)
        refuse_unused(
            given, ["steps_out", "profile_out", *_profile_dests(ns)], "does not apply with --real-from"
        )
        _check_outputs(ns)
        if Path(ns.real_from).is_dir():
            raise ValueError(f"--real-from {ns.real_from}: is a folder, not a recorded result")
        if not Path(ns.real_from).is_file():
            raise ValueError(f"--real-from {ns.real_from}: no such file")
        recorded = _load_result(ns.real_from)
        cm_file = load_cost_model(ns.cost_model)
        try:
            steps, meta = load_steps(ns.real_steps) if ns.real_steps else (None, {})
        except ValueError as e:
            raise ValueError(f"--real-steps {e}") from None
        if ns.real_steps:
            _check_steps_match(recorded, meta, ns.real_from, ns.real_steps)
        if recorded.get("engine") or meta.get("engine"):  # the engine flags would be ignored
            refuse_unused(
                given,
                engine_dests,
                f"does not apply: {ns.real_from if recorded.get('engine') else ns.real_steps} records "
                "the run's engine settings, which are used",
            )
        flags = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
        # a file without engine settings: the steps file's meta has them, else the flags given
        args_dict = meta.get("engine") or flags
        try:
            result = resimulate(recorded, cm_file, args_dict, steps, ns.real_from)
        except ValueError as e:  # the recorded run's own errors start with its path
            raise ValueError(f"--real-from {e}" if str(e).startswith(str(ns.real_from)) else str(e)) from None
        if not recorded.get("engine") and not meta.get("engine"):
            result["notes"].insert(
                0,
                f"{ns.real_from} does not record its engine settings: the engine flags given here are "
                "used (give the run's own, e.g. --num-gpu-blocks, or its --real-steps file)",
            )
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    samples = result.pop("_samples")
    result["system"] = system_info()
    print(f"cost model: {cm_file.cost_model.describe()}")
    print(
        f"real side from {ns.real_from} (recorded {(result['real_system'] or {}).get('time', '?')}); "
        f"simulated {result['finished']['simulated']} requests in {result['duration_s']['simulated']:.1f} "
        f"virtual s ({result['wall_s']['simulated']:.2f} s to simulate)"
    )
    for n in result["notes"]:
        print(f"note: {n}")
    _print_result(result)
    if steps:
        from kvserve.sim.step_record import compare_steps, print_comparison

        print(f"{len(steps)} recorded steps; predicted vs measured step time:")
        print_comparison(compare_steps(steps, cm_file.cost_model))
    if ns.json_out:
        write_json(ns.json_out, result)
    if ns.plot:
        if samples["real"] is None:
            print(f"note: no plot: {ns.real_from} has no per-request samples (written before they were kept)")
        else:
            from kvserve.benchmarks.plots import plot_latency_cdfs

            title = "recorded real vs re-simulated: " + Path(result["trace"]["path"]).name
            print(f"wrote {plot_latency_cdfs(samples, ns.plot, title=title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
