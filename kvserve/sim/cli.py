"""``kvserve simulate``: replay a request trace on the real scheduler with a cost model.

The engine (``LLMEngine``), scheduler and block manager are the production ones; only the
executor is replaced by ``SimulatedExecutor`` and wall time by its virtual clock, so a what-if
study (policy, cache size, chunked prefill, preemption mode) runs in seconds for hours of
trace. Prints a latency table (and writes it as JSON with ``--json-out``).

``--cost-model FILE`` uses a profile of a real host (``kvserve profile``) instead of the built-in
Llama-2-70B/H100 fit; the simulation's block size, dtype and model must be the profile's, and an
unset chunked prefill / step budget / KV-cache size takes the profiled engine's. The output's
first line always names the cost model in use. Steps larger than the profile measured are
priced by a bounded extrapolation (``kvserve.sim.cost_model``) and reported in a WARNING block
above and below the figures (how many steps, what share of the simulated time, how far past
the profiled sizes); past 5% of the time the figures are called untrustworthy, and
``--refuse-extrapolation`` then exits 2 instead of printing them.

``--speculative-config`` takes the engine's JSON plus an acceptance model (``acceptance_rate``
or ``mean_accepted_len``, optionally ``draft_step_s``; see ``kvserve.sim.acceptance``).

Multi-LoRA: each request's adapter comes from the trace's ``lora_id`` column or, with
``--num-loras N``, is drawn from ``--lora-dist uniform|zipf`` (``--lora-zipf-alpha``) over
adapters ``1..N`` (``kvserve.sim.lora``); the scheduler then holds at most ``--max-loras``
adapters per step, and the cost model adds ``lora_adapter_s`` per adapter in a step.

Arrivals: a trace with arrival times keeps them (times ``--time-scale``); a ``--workload`` or a
length-only trace gets ``--request-rate`` arrivals. Bad input -- a malformed trace (named by
file, line and field), a value out of range, a flag the chosen mode would ignore (e.g.
``--request-rate`` with a timed trace, engine memory flags), an output path that cannot be
written -- is a one-line ``Error:`` and exit status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
from pathlib import Path

from kvserve.config import CHUNKED_PREFILL_TOKENS, EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.cli import add_engine_args, engine_args_from, flag_names
from kvserve.envs import shared_dir
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.sim.acceptance import AcceptanceModel, split_speculative_config
from kvserve.sim.cli_checks import (
    check_arrival_span,
    check_float,
    check_int,
    flag_of,
    given_dests,
    refuse_unused,
)
from kvserve.sim.cost_model import CostModel, VirtualClock
from kvserve.sim.executor import SimulatedExecutor
from kvserve.sim.extrapolation import TRUST_SHARE, extrapolation_report, warning_block
from kvserve.sim.lora import LORA_DISTRIBUTIONS, draw_lora_ids, sim_lora_request
from kvserve.sim.preemption_cost import CostModelPreemptionCost
from kvserve.workload import workload as wl
from kvserve.workload.io import check_output_path, write_text_atomic
from kvserve.workload.stats import summarize

VOCAB = 49152


def simulate(
    args: EngineArgs,
    requests: list[wl.BenchRequest],
    cost_model: CostModel | None = None,
    acceptance: dict | AcceptanceModel | None = None,
    per_request: bool = False,
) -> dict:
    """Run ``requests`` (arrival_s on the virtual clock) to completion; returns a summary dict
    with TTFT/TPOT/e2e/queue-time statistics (seconds), throughput and preemption counts, and
    ``extrapolation`` (``kvserve.sim.extrapolation.extrapolation_report``: the steps priced
    past the cost model's profiled range, and their share of the simulated time).

    ``num_gpu_blocks`` must be set (there is no memory to derive it from); ``num_cpu_blocks``
    defaults to the same. With ``args.speculative_config``, ``acceptance`` is the acceptance
    model: an ``AcceptanceModel`` or the simulator's keys of the JSON (``acceptance_rate`` /
    ``mean_accepted_len``, ``draft_step_s``: ``kvserve.sim.acceptance``; ``split_speculative_config``
    separates them from the engine's); the summary then reports the speculation counters.

    Requests with a ``lora_id`` run with that adapter (LoRA is switched on for them when
    ``enable_lora`` is unset; ``max_loras`` limits the adapters per step); the summary then
    has a ``lora`` section (adapters, mean adapters per step, TTFT and e2e per adapter).
    Requests with a ``tenant`` are served for it (the ``fair`` policy shares service between
    tenants); the summary then has ``tenants``: per tenant, finished requests, served tokens
    (prompt + output) and TTFT / queue-time statistics.
    ``per_request``: the summary also has ``requests``: request id -> ``ttft_s`` and ``e2e_s``
    of each finished request (seconds on the virtual clock).

    Raises:
        ValueError: a bad setting (naming the field), e.g. speculation without an acceptance
            model.
    """
    if args.num_gpu_blocks is None:
        raise ValueError(
            "num_gpu_blocks must be set for a simulation (there is no device memory to size it from)."
        )
    if args.num_cpu_blocks is None:
        args.num_cpu_blocks = args.num_gpu_blocks
    if args.enable_chunked_prefill is None:  # the simulated device is not this machine's
        args.enable_chunked_prefill = False
    if args.enable_chunked_prefill and args.max_num_batched_tokens is None:
        # nor is its budget: the V0 default, not the CPU engine's 2,048 -- else the same
        # simulation would give other results on a CPU host than on a CUDA host
        args.max_num_batched_tokens = CHUNKED_PREFILL_TOKENS
    if any(r.lora_id for r in requests):
        args.enable_lora = True  # the simulator loads no weights: any adapter id "exists"
    lora_config = args.create_lora_config()
    spec = args.create_speculative_config()
    if spec is None:
        acceptance = None
    elif not isinstance(acceptance, AcceptanceModel):
        acceptance = AcceptanceModel.from_config(acceptance or {}, spec.num_speculative_tokens)
    model_config, cache_config, scheduler_config = args.create_configs(args.max_model_len or 8192)
    clock = VirtualClock()
    executor = SimulatedExecutor(
        VOCAB,
        cost_model,
        cache_config=cache_config,
        check_kv=False,
        strict=False,
        clock=clock,
        acceptance=acceptance,
    )
    engine = LLMEngine(
        model_config,
        cache_config,
        scheduler_config,
        executor=executor,
        clock=clock,
        vocab_size=VOCAB,
        speculative_config=spec,
        lora_config=lora_config,
        preemption_cost=CostModelPreemptionCost(executor.cost_model),
    )
    pending = sorted(requests, key=lambda r: r.arrival_s)
    finals: list[RequestOutput] = []
    i = 0
    rejected: dict[str, int] = {}  # the engine's refusal -> how many requests got it
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_s <= clock.now():
            r = pending[i]
            try:
                engine.add_request(
                    str(r.id),
                    {"prompt_token_ids": r.prompt_token_ids},
                    SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0),
                    arrival_time=r.arrival_s,
                    lora_request=sim_lora_request(r.lora_id) if lora_config is not None else None,
                    tenant=r.tenant,
                )
            except ValueError as e:
                rejected[str(e)] = rejected.get(str(e), 0) + 1
            i += 1
        if not engine.has_unfinished_requests():
            if i == len(pending):  # the last arrivals were all rejected at admission
                break
            clock.set(pending[i].arrival_s)  # idle: jump to the next arrival
            continue
        finals.extend(o for o in engine.step() if o.finished)
    duration = clock.now()
    out_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
    # Latencies of finished requests only (as `bench fidelity` reports them): an ignored one's
    # "end to end" is its refusal, which would pull e2e below TTFT.
    done = [o for o in finals if o.outcome == "finished"]
    metrics = [o.metrics for o in done if o.metrics is not None]
    if len(metrics) != len(done):
        raise RuntimeError("a finished request without metrics: the engine records them for every request")
    summary = {
        "num_requests": len(requests),
        "finished": sum(o.outcome == "finished" for o in finals),
        "ignored": sum(o.outcome == "rejected" for o in finals),
        "ignored_reasons": dict(collections.Counter(o.error for o in finals if o.outcome == "rejected")),
        "rejected_at_admission": sum(rejected.values()),
        "rejection_reasons": rejected,
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else 0.0,
        "num_preemptions": engine.get_kv_cache_stats()["num_preemptions"],
        "num_recomputed_tokens": engine.get_kv_cache_stats()["num_recomputed_tokens"],
        "num_swapped_out_blocks": engine.get_kv_cache_stats()["num_swapped_out_blocks"],
        "ttft_s": summarize(m.ttft for m in metrics),
        "tpot_s": summarize(m.tpot(len(o.outputs[0].token_ids)) for m, o in zip(metrics, done)),
        "e2e_s": summarize(m.e2e_latency for m in metrics),
        "queue_s": summarize(m.queue_time for m in metrics),
        "num_steps": executor.num_steps,
        "mean_groups_per_step": executor.num_scheduled_groups / max(1, executor.num_steps),
        "num_extrapolated_steps": executor.num_extrapolated_steps,
        "extrapolation": extrapolation_report(executor.cost_model, executor),
    }
    kv = engine.get_kv_cache_stats()
    if cache_config.enable_prefix_caching:
        summary["prefix_cache"] = {
            k: kv[k]
            for k in (
                "prefix_cache_queries",
                "prefix_cache_hits",
                "prefix_cache_hit_rate",
                "gpu_prefix_cache_hit_blocks",
                "host_tier_capacity_blocks",
                "host_tier_hits",
                "host_tier_demotions",
            )
        }
    if per_request:
        summary["requests"] = {
            o.request_id: {"ttft_s": m.ttft, "e2e_s": m.e2e_latency} for o, m in zip(done, metrics)
        }
    if lora_config is not None:
        adapter_of = {str(r.id): r.lora_id for r in requests}
        by_adapter: dict[int, list] = {}
        for o in finals:
            by_adapter.setdefault(adapter_of.get(o.request_id, 0), []).append(o.metrics)
        summary["lora"] = {
            "max_loras": lora_config.max_loras,
            "num_adapters": len({r.lora_id for r in requests} - {0}),
            "mean_adapters_per_step": executor.num_lora_adapter_steps / max(1, executor.num_steps),
            "slot_steps_by_groups": dict(sorted(executor.lora_slot_steps.items())),
            "num_slot_preemptions": engine.scheduler.num_slot_preemptions,
            "ttft_s_by_adapter": {k: summarize(m.ttft for m in ms) for k, ms in sorted(by_adapter.items())},
            "e2e_s_by_adapter": {
                k: summarize(m.e2e_latency for m in ms) for k, ms in sorted(by_adapter.items())
            },
        }
    if any(r.tenant is not None for r in requests):
        tenant_of = {str(r.id): r.tenant or "default" for r in requests}
        by_tenant: dict[str, list] = {}
        for o in done:
            by_tenant.setdefault(tenant_of.get(o.request_id, "default"), []).append(o)
        summary["tenants"] = {
            t: {
                "finished": len(os_),
                "served_tokens": sum(
                    len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) for o in os_
                ),
                "ttft_s": summarize(o.metrics.ttft for o in os_),
                "queue_s": summarize(o.metrics.queue_time for o in os_),
            }
            for t, os_ in sorted(by_tenant.items())
        }
    if spec is not None:
        st = engine.stats
        summary["spec_decode"] = {
            "num_speculative_tokens": spec.num_speculative_tokens,
            "model_mean_accepted_len": acceptance.mean_accepted_len if acceptance else None,
            "num_drafts": st.spec_num_drafts,
            "num_draft_tokens": st.spec_num_draft_tokens,
            "num_accepted_tokens": st.spec_num_accepted_tokens,
            "acceptance_rate": st.spec_acceptance_rate,
            "mean_accepted_len": st.spec_mean_accepted_length,
        }
    return summary


def _cost_model_for(ns: argparse.Namespace) -> CostModel:
    """The ``--cost-model`` file's model, checked against the engine flags (which get the
    profiled engine's settings where unset), or the built-in one.

    Raises:
        ValueError: a malformed file or one profiled for another block size, dtype or model.
    """
    if not ns.cost_model:
        if ns.num_gpu_blocks is None:
            ns.num_gpu_blocks = 2048
        return CostModel()
    from kvserve.sim.cost_model_file import load_cost_model

    f = load_cost_model(ns.cost_model)
    # only the fields the profile pins (the simulator's speculation keys are not the engine's)
    f.check_engine_args(
        EngineArgs(model=ns.model, dtype=ns.dtype, block_size=ns.block_size, quantization=ns.quantization)
    )
    prof = f.engine
    if ns.enable_chunked_prefill is None and prof.get("enable_chunked_prefill") is not None:
        ns.enable_chunked_prefill = prof["enable_chunked_prefill"]
        if ns.max_num_batched_tokens is None:
            ns.max_num_batched_tokens = prof.get("max_num_batched_tokens")
    if ns.num_gpu_blocks is None:
        ns.num_gpu_blocks = prof.get("num_gpu_blocks") or 2048
    if ns.num_cpu_blocks is None and prof.get("num_cpu_blocks"):
        ns.num_cpu_blocks = prof["num_cpu_blocks"]
    return f.cost_model


#: The most KV blocks a simulated pool (``--num-gpu-blocks``, ``--num-cpu-blocks``) may have:
#: the block manager keeps ~150 bytes of Python bookkeeping per block (no KV memory), so 2**22
#: blocks are ~0.6 GiB and ~2 s to set up per pool -- and 67M tokens at block size 16, far past
#: any real device's cache. A larger count is a typo that would exhaust memory, not a what-if.
MAX_SIM_BLOCKS = 1 << 22
#: The most adapters ``--num-loras`` may draw from (each has a weight in memory).
MAX_SIM_LORAS = 1 << 20

#: engine flags a simulation has no use for, and why (an error rather than ignored)
_NOT_SIMULATED = (
    (
        ("kv_cache_memory_gib", "swap_space_gib"),
        "does not apply to a simulation (no memory is allocated): give --num-gpu-blocks / --num-cpu-blocks",
    ),
    (
        ("device",),
        "does not apply to a simulation: the simulated device is the cost model's, not this machine's",
    ),
    (
        ("data_parallel_size", "ray_address", "router", "router_balance_threshold", "tensor_parallel_size"),
        "is not simulated (one engine on one device: the cost model's)",
    ),
)


def _check_blocks(ns: argparse.Namespace, source: str = "") -> None:
    """``--num-gpu-blocks`` >= 1 and ``--num-cpu-blocks`` >= 0, both at most ``MAX_SIM_BLOCKS``
    (``source``: where an unset flag's value came from, for the message).

    Raises:
        ValueError: naming the flag.
    """
    for name in ("num_gpu_blocks", "num_cpu_blocks"):
        v = getattr(ns, name)
        if v is not None:
            check_int(
                flag_of(name) + source,
                v,
                lo=1 if name == "num_gpu_blocks" else 0,
                hi=MAX_SIM_BLOCKS,
                why="the simulator's cap: larger pools exhaust its memory",
            )


def _check_flags(ns: argparse.Namespace, given: set[str]) -> None:
    """The simulator's own flags and the engine flags it uses, checked before anything runs;
    a flag the chosen mode would ignore is an error.

    Raises:
        ValueError: naming the flag, its limit and the value.
    """
    check_int("--num-requests", ns.num_requests)
    check_float("--time-scale", ns.time_scale, lo=0.0, lo_open=False, meaning="0 = every request at t=0")
    if ns.request_rate is not None:
        check_float("--request-rate", ns.request_rate, allow_inf=True, meaning="inf = all at t=0")
    if not ns.trace:
        refuse_unused(
            given, ("time_scale",), "applies to --trace only (a workload's arrivals come from --request-rate)"
        )
    if ns.num_loras is None:
        refuse_unused(given, ("lora_dist", "lora_zipf_alpha"), "goes with --num-loras N (none given)")
    else:
        check_int("--num-loras", ns.num_loras, hi=MAX_SIM_LORAS)
        if ns.lora_dist != "zipf":
            refuse_unused(given, ("lora_zipf_alpha",), "goes with --lora-dist zipf")
    _check_blocks(ns)
    if ns.max_model_len is not None:
        check_int("--max-model-len", ns.max_model_len, lo=2)
    for dests, why in _NOT_SIMULATED:
        refuse_unused(given, dests, why)
    if not ns.cost_model:
        refuse_unused(
            given,
            ("model", "dtype", "quantization"),
            "applies with --cost-model FILE only (the built-in cost model is a fixed Llama-2-70B/H100 fit)",
        )
    if ns.json_out:
        check_output_path("--json-out", ns.json_out)


def _trace_requests(ns: argparse.Namespace, given: set[str], corpus: list[int]) -> list[wl.BenchRequest]:
    """The ``--trace``'s requests: its arrival times times ``--time-scale``, or (a length-only
    trace) arrivals at ``--request-rate``.

    Raises:
        ValueError: a malformed trace (naming file, line and field), or a flag its kind of
            trace ignores (``--request-rate`` with arrival times, ``--time-scale`` without).
    """
    records = wl.select_trace(wl.load_trace(ns.trace), num_requests=ns.num_requests)
    timed = records[0].arrival_s is not None
    if timed:
        refuse_unused(
            given,
            ("request_rate",),
            f"does not apply to --trace {ns.trace}, which has its own arrival times (scale them with --time-scale)",
        )
    else:
        refuse_unused(
            given,
            ("time_scale",),
            f"does not apply to --trace {ns.trace}, which has no arrival times (give --request-rate)",
        )
    requests, _ = wl.trace_to_requests(wl.scale_arrivals(records, ns.time_scale), corpus, ns.max_model_len)
    if not timed:
        _set_arrivals(requests, ns.request_rate)
    return requests


def _set_arrivals(requests: list[wl.BenchRequest], rate: float | None) -> None:
    rate = float("inf") if rate is None else rate
    for r, t in zip(requests, wl.generate_arrivals(len(requests), rate)):
        r.arrival_s = t


#: Tenants ``kvserve simulate`` prints a line for (the most served first); ``--json-out`` has all.
MAX_TENANT_LINES = 16


def tenant_lines(tenants: dict[str, dict]) -> list[str]:
    """One line per tenant of a summary's ``tenants`` section (``simulate``): finished
    requests, served tokens (prompt + output), queue time mean / max and TTFT p90 (virtual
    seconds), the most-served ``MAX_TENANT_LINES`` tenants first, then a count of the rest."""
    order = sorted(tenants, key=lambda t: (-tenants[t]["served_tokens"], t))
    out = []
    for t in order[:MAX_TENANT_LINES]:
        s = tenants[t]
        q, ttft = s["queue_s"], s["ttft_s"]

        def num(v) -> str:
            return "-" if v is None else f"{v:.3f}"

        out.append(
            f"tenant {t}: {s['finished']} finished, {s['served_tokens']} served tokens, queue s mean "
            f"{num(q.get('mean'))} max {num(q.get('max'))}, ttft s p90 {num(ttft.get('p90'))}"
        )
    if len(order) > MAX_TENANT_LINES:
        out.append(f"tenants: {len(order) - MAX_TENANT_LINES} more (--json-out lists them)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvserve simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--trace", help="trace file (azure csv, vidur csv, mooncake jsonl) from ../shared/traces"
    )
    src.add_argument("--workload", help="workload jsonl (token ids, output_len)")
    ap.add_argument("--num-requests", type=int, default=1000, help="at most this many requests (>= 1)")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="--trace with arrival times: multiply them by this (>= 0; 0 = all at t=0)",
    )
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="--workload, or a --trace without arrival times: Poisson arrivals at this rate "
        "(> 0 or inf; default inf = all at t=0)",
    )
    ap.add_argument("--json-out", default=None, help="write the summary here (checked before the run)")
    ap.add_argument(
        "--num-loras",
        type=int,
        default=None,
        help=f"draw each request's LoRA adapter from N adapters (ids 1..N, N <= {MAX_SIM_LORAS:,}; overrides "
        "a trace's lora_id column)",
    )
    ap.add_argument("--lora-dist", default="uniform", choices=LORA_DISTRIBUTIONS, help="with --num-loras")
    ap.add_argument(
        "--lora-zipf-alpha", type=float, default=1.0, help="--lora-dist zipf: adapter k has weight k**-alpha"
    )
    ap.add_argument(
        "--cost-model", default=None, help="cost-model JSON from `kvserve profile` (default: built-in fit)"
    )
    ap.add_argument(
        "--refuse-extrapolation",
        action="store_true",
        help=f"exit 2 (no figures) when more than {TRUST_SHARE * 100:.0f}%% of the simulated time is in steps "
        "larger than the cost model was profiled on (default: print the figures under a WARNING)",
    )
    cap = f"at most {MAX_SIM_BLOCKS:,} in a simulation (its bookkeeping is ~150 bytes a block)"
    add_engine_args(
        ap,
        help_overrides={
            "num_gpu_blocks": f"KV blocks of the simulated device (default: the profile's, else 2048; {cap})",
            "num_cpu_blocks": f"swap blocks (default: --num-gpu-blocks; {cap})",
            "model": "with --cost-model: must be the profiled model",
        },
    )
    ap.set_defaults(num_gpu_blocks=None, max_model_len=8192)
    ns = ap.parse_args(argv)
    try:
        _check_flags(ns, given := given_dests(ap, argv, ns))
        cost_model = _cost_model_for(ns)
        if ns.cost_model:  # unset block counts are now the profile's
            _check_blocks(ns, f" (or the engine of --cost-model {ns.cost_model})")
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(f"cost model: {cost_model.describe()}")
    try:
        corpus = wl.load_corpus()
    except ValueError as e:
        # Simulated tokens are never read as text: any ids do; say why real ones are not used.
        print(f"note: {e}; using synthetic prompt token ids")
        corpus = [3 + (i * 7919) % (VOCAB - 3) for i in range(1 << 17)]
    try:
        if ns.trace:
            if not Path(ns.trace).is_file() and not Path(ns.trace).is_dir():
                raise ValueError(
                    f"--trace {ns.trace}: no such file (relative paths are from the current directory, "
                    f"{Path.cwd()}; the shared traces are in {shared_dir() / 'traces'})"
                )
            try:
                requests = _trace_requests(ns, given, corpus)
            except ValueError as e:  # the file's errors start with its path: name the flag too
                raise ValueError(f"--trace {e}" if str(e).startswith(str(ns.trace)) else str(e)) from None
            check_arrival_span(requests, "--request-rate" if "request_rate" in given else "--time-scale")
            if len(requests) < ns.num_requests:
                print(
                    f"note: --trace {ns.trace} has {len(requests)} requests (< --num-requests {ns.num_requests})"
                )
        else:
            path = ns.workload or wl.default_workload_path()
            if ns.workload is None and not path.is_file():
                print(
                    f"note: {path} not found; simulating {ns.num_requests} synthetic requests (200 prompt + 128 output tokens)"
                )
                requests = wl.synthetic_requests(ns.num_requests, 200, 128, corpus)
            else:
                try:
                    requests = wl.load_workload(path, ns.num_requests)
                except ValueError as e:
                    raise ValueError(f"--workload {e}") from None
                if not requests:
                    raise ValueError(f"--workload {path}: no requests in the file")
            _set_arrivals(requests, ns.request_rate)
            check_arrival_span(requests, "--request-rate")
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if ns.num_loras is not None:
        try:
            lora_ids = draw_lora_ids(len(requests), ns.num_loras, ns.lora_dist, ns.lora_zipf_alpha, ns.seed)
        except ValueError as e:
            print(f"Error: {e}", file=sys.stderr)
            return 2
        for r, lid in zip(requests, lora_ids):
            r.lora_id = lid
    try:
        # The acceptance model's keys are the simulator's: the rest is the engine's config.
        engine_spec, sim_spec = split_speculative_config(ns.speculative_config)
        ns.speculative_config = engine_spec
        # one warning per refused request is noise over thousands: the summary names each reason
        engine_log = logging.getLogger("kvserve.engine")
        level = engine_log.level
        engine_log.setLevel(logging.ERROR)
        t0 = time.perf_counter()
        try:
            summary = simulate(engine_args_from(ns), requests, cost_model=cost_model, acceptance=sim_spec)
        finally:
            engine_log.setLevel(level)
        summary["wall_s"] = time.perf_counter() - t0
        summary["cost_model"] = cost_model.describe()
    except ValueError as e:  # an engine setting: named as the flag typed
        print(f"Error: {flag_names(str(e))}", file=sys.stderr)
        return 2
    ex = summary["extrapolation"]
    warning = warning_block(ex)
    if ns.refuse_extrapolation and not ex["trustworthy"]:
        print(f"Error: --refuse-extrapolation: no figures printed.\n{warning}", file=sys.stderr)
        return 2
    if warning:
        print(warning)
    print(
        f"simulated {summary['num_requests']} requests in {summary['duration_s']:.1f} virtual s: "
        f"{summary['finished']} finished, {summary['ignored']} ignored, {summary['rejected_at_admission']} rejected, "
        f"{summary['num_preemptions']} preemptions, {summary['output_tok_s']:.1f} output tok/s "
        f"({summary['wall_s']:.1f} wall s: {summary['num_requests'] / max(summary['wall_s'], 1e-9):.0f} requests/s simulated)"
    )
    for what, key in (
        ("ignored by the scheduler", "ignored_reasons"),
        ("rejected at admission", "rejection_reasons"),
    ):
        reasons = sorted(summary[key].items(), key=lambda kv: -kv[1])
        for reason, n in reasons[:3]:
            print(f"{what} ({n}): {reason}")
        if len(reasons) > 3:
            print(f"{what}: {len(reasons) - 3} more reasons (--json-out lists them)")
    pc = summary.get("prefix_cache")
    if pc:
        print(
            f"prefix cache: hit rate {pc['prefix_cache_hit_rate']:.3f} ({pc['prefix_cache_hits']} of "
            f"{pc['prefix_cache_queries']} prompt tokens), {pc['gpu_prefix_cache_hit_blocks']} device-pool "
            f"block hits, host tier of {pc['host_tier_capacity_blocks']} blocks: {pc['host_tier_hits']} "
            f"block hits, {pc['host_tier_demotions']} demotions"
        )
    sd = summary.get("spec_decode")
    if sd:
        print(
            f"speculative decoding: {sd['num_drafts']} drafts of {sd['num_draft_tokens']} tokens, "
            f"acceptance {sd['acceptance_rate']:.3f}, "
            f"mean accepted length {sd['mean_accepted_len']:.2f}, {summary['num_steps']} steps"
        )
    lo = summary.get("lora")
    if lo:
        print(
            f"LoRA: {lo['num_adapters']} adapters, max_loras {lo['max_loras']}, "
            f"{lo['mean_adapters_per_step']:.2f} adapters and {summary['mean_groups_per_step']:.2f} groups per step, "
            f"slot-steps by groups in the slot {lo['slot_steps_by_groups']}, "
            f"{lo['num_slot_preemptions']} slot turnover preemptions"
        )
    for line in tenant_lines(summary.get("tenants") or {}):
        print(line)
    quantiles = ("mean", "p50", "p90", "p99")
    print(f"{'metric':8}" + "".join(f" {q:>11}" for q in quantiles))
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        s = summary[key]  # a space before every column: large values never run together
        print(
            f"{key:8}" + "".join(" -".rjust(12) if s.get(q) is None else f" {s[q]:11.3f}" for q in quantiles)
        )
    if warning:
        print(warning)
    if ns.json_out:
        write_text_atomic(ns.json_out, json.dumps(summary, indent=2))
    return 0
