"""The machinery of ``kvserve bench fairness`` and ``kvserve bench preemption``: run the
scheduling workloads (``kvserve.workload.scheduling``) through the simulator and the real
engine for every scheduling policy, backfill setting and preemption mode, and tabulate them.

Policies are the scheduler's registered names (``PolicyFactory``), preemption modes the
``PreemptionMode`` members (plus ``auto`` where the scheduler config accepts it, and
``default``: the engine's own choice per group), backfill ``on`` / ``off`` where the scheduler
config has ``scheduling_backfill``; a policy, mode or backfill setting registered later shows up
here without a change. A request's tenant is passed to ``add_request(tenant=...)`` where the
engine takes one.

Each run is one fresh engine with the workload's KV-cache size, prefix caching off (so every
prefill token past a prompt's first prefill is a recomputed one). The real engine runs in this
process on the wall clock, the simulator on its virtual clock with ``--cost-model`` (default: the
built-in fit); one loop (``kvserve.sim.replay``) drives both with the same requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from kvserve.benchmarks.common import fmt_table, system_info
from kvserve.config import SchedulerConfig
from kvserve.workload import scheduling as ws
from kvserve.workload.stats import summarize
from kvserve.workload.workload import load_corpus, load_trace

RUNNERS = ("sim", "real")
#: the simulator's vocabulary when no real engine tells it (the default model's)
SIM_VOCAB = 49152
#: values within this relative distance are a tie when ranking
RANK_TIE = 0.05
#: service weights of Jain's index: the ``fair`` policy's defaults (``SchedulerConfig``)
FAIR_INPUT_WEIGHT = SchedulerConfig.fair_input_weight
FAIR_OUTPUT_WEIGHT = SchedulerConfig.fair_output_weight


# ---------------------------------------------------------------- what the scheduler offers
def policy_names() -> list[str]:
    """The scheduler's registered policy names, in registration order."""
    from kvserve.core.policy import PolicyFactory

    return list(PolicyFactory._POLICY_REGISTRY)


def preemption_modes() -> list[str]:
    """``PreemptionMode`` members (lower case), then ``auto`` if the scheduler config takes it."""
    from kvserve.config import PreemptionMode, SchedulerConfig

    modes = [m.name.lower() for m in PreemptionMode]
    if "auto" not in modes:
        try:
            SchedulerConfig.parse_preemption_mode("auto")
            modes.append("auto")
        except ValueError:
            pass
    return modes


def backfill_supported() -> bool:
    """Whether the engine settings have ``scheduling_backfill``."""
    from kvserve.config import EngineArgs

    return "scheduling_backfill" in {f.name for f in dataclasses.fields(EngineArgs)}


def parse_choice(flag: str, value: str, allowed: Sequence[str]) -> list[str]:
    """A comma-separated ``value`` of ``allowed`` names, in the order given, without repeats.

    Raises:
        ValueError: an empty list or a name not in ``allowed``, naming ``flag``.
    """
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    if not names:
        raise ValueError(f"{flag}: give at least one of {', '.join(allowed)}")
    bad = [n for n in names if n not in allowed]
    if bad:
        raise ValueError(f"{flag}: {', '.join(bad)} not available (choose from {', '.join(allowed)})")
    return names


# ---------------------------------------------------------------- one run
@dataclasses.dataclass(frozen=True)
class Config:
    """One scheduler setting: policy name, backfill (``on`` / ``off``; ``-`` where the engine
    has no backfill), preemption mode (a ``preemption_modes`` name or ``default``)."""

    policy: str
    backfill: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.policy}/{self.backfill}/{self.mode}"


def engine_args(base, workload: ws.SchedWorkload, cfg: Config):
    """``base`` (``EngineArgs``) with the workload's cache size and ``cfg``'s settings."""
    kw = dict(
        num_gpu_blocks=workload.num_gpu_blocks,
        num_cpu_blocks=workload.num_cpu_blocks,
        max_model_len=workload.max_model_len,
        enable_prefix_caching=False,
        policy=cfg.policy,
        preemption_mode=None if cfg.mode == "default" else cfg.mode,
    )
    if cfg.backfill != "-":
        kw["scheduling_backfill"] = cfg.backfill == "on"
    return dataclasses.replace(base, **kw)


def make_submit(engine) -> Callable:
    """A ``replay`` submit for ``SchedRequest``s: greedy for ``n == 1``, temperature 1 with a
    seed per request for ``n > 1``; priority and tenant passed on."""
    from kvserve.sampling_params import SamplingParams

    def submit(eng, r: ws.SchedRequest, arrival_time: float) -> None:
        n = r.n
        params = SamplingParams(
            n=n,
            max_tokens=r.output_len,
            ignore_eos=True,
            temperature=0 if n == 1 else 1.0,
            seed=None if n == 1 else r.id,
        )
        eng.add_request(
            str(r.id),
            {"prompt_token_ids": r.prompt_token_ids},
            params,
            arrival_time,
            r.priority,
            tenant=r.tenant,
        )

    return submit


def _warm_up(engine, prompt_ids: list[int]) -> None:
    """Two small requests before the clock starts (first-call costs)."""
    from kvserve.sampling_params import SamplingParams

    for i in range(2):
        engine.add_request(
            f"warmup-{i}",
            {"prompt_token_ids": prompt_ids[:32]},
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
        )
    while engine.has_unfinished_requests():
        engine.step()


def run_one(runner: str, args, workload: ws.SchedWorkload, cost_model) -> dict:
    """Replay ``workload`` on a fresh engine (``runner``: ``sim`` or ``real``) built from
    ``args``; returns ``metrics``' dict."""
    from kvserve.sim.replay import replay, simulated_engine

    if runner == "real":
        from kvserve.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(args)
        _warm_up(engine, workload.requests[0].prompt_token_ids)
        clock = engine.clock

        def wait_until(t: float) -> None:
            if t > engine.clock():
                time.sleep(t - engine.clock())

        timer: Callable[[], float] = time.perf_counter
    else:
        configs = args.create_configs(args.max_model_len)
        engine, vclock = simulated_engine(configs, cost_model, SIM_VOCAB)
        clock, wait_until, timer = vclock, vclock.set, vclock
    stats0 = engine.get_kv_cache_stats()
    try:
        res = replay(
            engine,
            workload.requests,
            clock,
            wait_until,
            record_steps=True,
            timer=timer,
            submit=make_submit(engine),
        )
        stats = engine.get_kv_cache_stats()
    finally:
        if runner == "real":
            engine.shutdown()
            del engine
            gc.collect()
    out = metrics(res, workload)
    for k in (
        "num_recompute_preemptions",
        "num_swap_preemptions",
        "num_rank_preemptions",
        "num_rank_swap_preemptions",
        "num_rank_recomputed_tokens",
        "num_backfill_reclaims",
    ):
        out[k] = stats.get(k, 0) - stats0.get(k, 0)
    return out


def metrics(res, workload: ws.SchedWorkload, window_s: float = ws.JAIN_WINDOW_S) -> dict:
    """The run's figures (times in seconds): per tenant ``ttft``/``tpot`` ``{p50, p90}`` of its
    finished requests (``ttft`` also ``max``: head-of-line's long prompt is tenant A's last), ``jain`` (``windowed_jain`` of served tokens weighted as the ``fair``
    policy's counters count them: a request's prompt tokens x ``FAIR_INPUT_WEIGHT`` spread evenly
    from its first scheduling to its first token (chunked prefill computes them over those steps;
    credited all at the first token, a long prompt on a slow host lands in a later window than
    the one that served it), each output token x ``FAIR_OUTPUT_WEIGHT`` at its time, while every tenant is
    backlogged: from its first arrival to its last request's first token), ``output_tok_s`` (tokens
    of all samples / run duration), ``num_preemptions``, ``recomputed_tokens`` (prefill tokens
    computed beyond each admitted prompt's one prefill), ``num_finished``, ``duration_s``."""
    by_id = {r.id: r for r in workload.requests}
    tenants = sorted({r.tenant for r in workload.requests})
    per: dict = {}
    service: dict[str, list[tuple[float, float]]] = {t: [] for t in tenants}
    active: dict[str, tuple[float, float]] = {}
    for t in tenants:
        ttft, tpot = [], []
        for rid, o in res.outcome.items():
            tt = res.token_times.get(rid) or []
            if by_id[rid].tenant != t or o != "finished" or not tt:
                continue
            a = res.arrival[rid]
            ttft.append(tt[0] - a)
            if len(tt) > 1:
                tpot.append((tt[-1] - tt[0]) / (len(tt) - 1))
            start = res.first_scheduled.get(rid)
            service[t].extend(
                spread(by_id[rid].prompt_len * FAIR_INPUT_WEIGHT, tt[0] if start is None else start, tt[0])
            )
            service[t].extend((x, FAIR_OUTPUT_WEIGHT) for x in tt)
            # backlogged from its first arrival until its last request starts (first token)
            lo, hi = active.get(t, (a, tt[0]))
            active[t] = (min(lo, a), max(hi, tt[0]))
        per[t] = {
            k: {q: s[q] for q in ("p50", "p90")}
            for k, s in (("ttft", summarize(ttft)), ("tpot", summarize(tpot)))
        }
        per[t]["ttft"]["max"] = max(ttft) if ttft else None
    finished = [rid for rid, o in res.outcome.items() if o == "finished"]
    admitted = [rid for rid in res.token_times if res.outcome.get(rid) != "rejected"]
    prefill = sum(s.shape.prefill_tokens for s in res.steps)
    out_tokens = sum(res.num_tokens.get(rid, 0) for rid in finished)
    recomputed = prefill - sum(by_id[rid].prompt_len for rid in admitted)
    token_s, decode_s = step_prices(res.steps)
    jain = ws.windowed_jain(service, active, workload.weights, window_s)
    return {
        "tenants": per,
        "jain": jain["mean"],
        "jain_min": jain["min"],
        "jain_windows": jain["windows"],
        "output_tok_s": out_tokens / res.duration_s if res.duration_s else 0.0,
        "num_preemptions": res.total_preemptions,
        "recomputed_tokens": recomputed,
        "prefill_token_s": token_s,
        "decode_step_s": decode_s,
        "recompute_s_est": None if token_s is None else token_s * max(0, recomputed),
        "num_finished": len(finished),
        "num_requests": len(workload.requests),
        "duration_s": res.duration_s,
    }


def spread(amount: float, start: float, end: float, step_s: float = 0.1) -> list[tuple[float, float]]:
    """``amount`` as ``(time, amount)`` pieces evenly over ``[start, end]``, one per ``step_s``
    seconds (at least one, at ``end`` when the span is empty)."""
    n = max(1, math.ceil((end - start) / step_s))
    return [(start + (end - start) * (i + 1) / n, amount / n) for i in range(n)]


def step_prices(steps) -> tuple[float | None, float | None]:
    """``(prefill_token_s, decode_step_s)`` of a run's step records (seconds): the slope of a
    least-squares fit ``step_s ~ a + prefill_token_s * prefill tokens + c * decode sequences``
    over all its steps, and the mean ``step_s`` of its decode-only steps; None where the steps
    do not determine them (too few, or no prompt tokens). Recomputed tokens times the first is
    what the run spent re-prefilling: the price a re-prefill had in this run, on this host."""
    import numpy as np

    decode = [s.step_s for s in steps if not s.shape.prefill_tokens and s.shape.decode_seqs]
    decode_s = sum(decode) / len(decode) if decode else None
    rows = [(1.0, s.shape.prefill_tokens, s.shape.decode_seqs) for s in steps]
    if len(rows) < 4 or not any(r[1] for r in rows):
        return None, decode_s
    coef = np.linalg.lstsq(np.array(rows, dtype=float), np.array([s.step_s for s in steps]), rcond=None)[0]
    return float(coef[1]), decode_s


# ---------------------------------------------------------------- the matrix and its table
def run_matrix(
    workloads: Sequence[ws.SchedWorkload],
    runners: Sequence[str],
    configs: Sequence[Config],
    base_args,
    cost_model,
    progress: bool = True,
) -> list[dict]:
    """Every workload x runner x config; rows ``{"workload", "runner", "policy", "backfill",
    "mode", **run_one(...)}`` (sim rows before real ones)."""
    import logging

    # the scheduler's "cache too small" warning: these workloads preempt on purpose
    sched_log = logging.getLogger("kvserve.scheduler")
    level = sched_log.level
    sched_log.setLevel(logging.ERROR)
    try:
        return _run_matrix(workloads, runners, configs, base_args, cost_model, progress)
    finally:
        sched_log.setLevel(level)


def _run_matrix(workloads, runners, configs, base_args, cost_model, progress) -> list[dict]:
    rows = []
    for runner in runners:
        for w in workloads:
            for cfg in configs:
                t0 = time.perf_counter()
                m = run_one(runner, engine_args(base_args, w, cfg), w, cost_model)
                if progress:
                    print(
                        f"  {runner:4} {w.name:13} {cfg.label:28} {time.perf_counter() - t0:6.1f} s",
                        flush=True,
                    )
                rows.append({"workload": w.name, "runner": runner, **dataclasses.asdict(cfg), **m})
    return rows


def rank_agreement(
    rows: Sequence[dict], key: Callable[[dict], float | None], higher_better: bool, tie: float = RANK_TIE
) -> dict:
    """Whether ``sim`` and ``real`` rows rank the configs of each workload alike by ``key``:
    a pair of configs is *discordant* when one runner puts the first strictly ahead and the
    other the second (values within ``tie`` relative distance are a tie, which agrees with any
    order; a missing value ranks last). Returns ``{workload: {"agree": bool (None with fewer
    than two configs on both runners), "pairs": n, "discordant": [(label, label), ...],
    "ties": {runner: tied pairs}, "order": {runner: [labels best first]}}}``. A pair one runner
    ties agrees with any order: ``ties`` says how much of an agreement is only that."""
    out: dict = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        val: dict[str, dict[str, float | None]] = {"sim": {}, "real": {}}
        for r in rows:
            if r["workload"] == w and r["runner"] in val:
                val[r["runner"]][Config(r["policy"], r["backfill"], r["mode"]).label] = key(r)
        common = [c for c in val["sim"] if c in val["real"]]

        def cmp(a, b) -> int:  # +1: a better, -1: b better, 0: tie
            if a is None or b is None:
                return 0 if a is None and b is None else (1 if b is None else -1)
            if abs(a - b) <= tie * max(abs(a), abs(b)):
                return 0
            return 1 if (a > b) == higher_better else -1

        disc = []
        ties = {"sim": 0, "real": 0}
        for i, a in enumerate(common):
            for b in common[i + 1 :]:
                s_ab, r_ab = cmp(val["sim"][a], val["sim"][b]), cmp(val["real"][a], val["real"][b])
                if s_ab * r_ab < 0:
                    disc.append((a, b))
                ties["sim"] += s_ab == 0
                ties["real"] += r_ab == 0
        n = len(common) * (len(common) - 1) // 2
        out[w] = {
            "agree": None if n == 0 else not disc,
            "pairs": n,
            "discordant": disc,
            "ties": ties,
            "order": {k: _order(v, higher_better) for k, v in val.items()},
        }
    return out


def _order(v: dict[str, float | None], higher_better: bool) -> list[str]:
    """Labels best first; those without a value last."""
    known = sorted((c for c in v if v[c] is not None), key=lambda c: v[c] or 0.0, reverse=higher_better)
    return known + [c for c in v if v[c] is None]


def agreement_lines(agreement: dict, metric: str) -> list[str]:
    """One line per workload: whether simulator and real engine rank the configs alike."""
    lines = []
    for w, a in agreement.items():
        if a["agree"] is None:
            lines.append(f"ranking by {metric} ({w}): needs both runners and two configs")
        elif a["agree"]:
            t = a["ties"]
            lines.append(
                f"ranking by {metric} ({w}): sim and real agree ({' > '.join(a['order']['real'])}; tied "
                f"pairs: sim {t['sim']}/{a['pairs']}, real {t['real']}/{a['pairs']})"
            )
        else:
            d = "; ".join(f"{x} vs {y}" for x, y in a["discordant"])
            lines.append(f"ranking by {metric} ({w}): sim and real DISAGREE on {d}")
    return lines


# ---------------------------------------------------------------- command-line plumbing
def trace_rows(quick: bool, num: int) -> list[tuple[int, int]]:
    """The first ``num`` rows of the shared Azure 2023 code trace, scaled by
    ``ws.scale_lengths`` (outputs capped at 24 with ``quick``, else 48).

    Raises:
        ValueError: the trace is not there (naming its path and ``KVSERVE_SHARED_DIR``).
    """
    from kvserve.envs import shared_dir

    path = shared_dir() / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
    if not path.is_file():
        raise ValueError(f"{path}: no such trace (set KVSERVE_SHARED_DIR to the shared data folder)")
    recs = load_trace(path)[:num]
    return ws.scale_lengths([(r.input_len, r.output_len) for r in recs], 512, 24 if quick else 48)


def corpus() -> list[int]:
    """Token ids to cut prompts from: the shared workloads' prompts, else a fixed pattern."""
    try:
        return load_corpus()
    except ValueError:
        return [3 + (i * 7919) % 40000 for i in range(1 << 17)]


def build_parser(prog: str, doc: str, default_modes: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model of the real engine (default: the default model)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the real engine (default auto)",
    )
    ap.add_argument("--runners", default="sim,real", help="sim, real or both (default sim,real)")
    ap.add_argument("--policies", default=None, help="comma-separated (default: every registered policy)")
    ap.add_argument(
        "--modes", default=default_modes, help=f"preemption modes and/or 'default' (default {default_modes})"
    )
    ap.add_argument(
        "--backfill", default=None, help="on,off where the scheduler has backfill (default: both)"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="step token budget of both runners (default: the engine's; on CPU, chunked prefill "
        "with 2,048): a smaller budget shortens the step a newcomer may arrive during",
    )
    ap.add_argument("--cost-model", default=None, help="the simulator's cost model (kvserve profile JSON)")
    ap.add_argument("--quick", action="store_true", help="fewer requests and shorter outputs")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the rows and rankings here")
    return ap


def resolve(ns) -> tuple[list[str], list[Config], object, object]:
    """``(runners, configs, base EngineArgs, cost model)`` of the parsed flags.

    Raises:
        ValueError: an unknown runner, policy, mode or backfill value, backfill asked of a
            scheduler without it, an output path that cannot be written, a bad cost model.
    """
    from kvserve.config import EngineArgs
    from kvserve.sim.cost_model import CostModel
    from kvserve.workload.io import check_output_path

    runners = parse_choice("--runners", ns.runners, RUNNERS)
    policies = parse_choice("--policies", ns.policies or ",".join(policy_names()), policy_names())
    modes = parse_choice("--modes", ns.modes, [*preemption_modes(), "default"])
    if backfill_supported():
        backfill = parse_choice("--backfill", ns.backfill or "off,on", ["off", "on"])
    elif ns.backfill and ns.backfill.strip() != "off":
        raise ValueError("--backfill: this scheduler has no backfill (SchedulerConfig.scheduling_backfill)")
    else:
        backfill = ["-"]
    if ns.json:
        check_output_path("--json", ns.json)
    budget = getattr(ns, "max_num_batched_tokens", None)
    if budget is not None and budget < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
    base = EngineArgs(model=ns.model, dtype=ns.dtype, max_num_batched_tokens=budget)
    if ns.cost_model:
        from kvserve.sim.cost_model_file import load_cost_model

        cost_model = load_cost_model(ns.cost_model).cost_model
    else:
        cost_model = CostModel()
    configs = [Config(p, b, m) for p in policies for b in backfill for m in modes]
    return runners, configs, base, cost_model


def select_workloads(
    flag_value: str | None, wls: list[ws.SchedWorkload], companions: Mapping[str, str] | None = None
) -> list[ws.SchedWorkload]:
    """The workloads ``--workloads`` names (all when ``None``), in their own order; a workload
    in ``companions`` (name -> the workload it belongs to, e.g. a baseline run of one tenant
    alone) comes along with that workload and cannot be named itself.

    Raises:
        ValueError: an unknown or companion name, naming ``--workloads`` and the choices.
    """
    companions = companions or {}
    if flag_value is None:
        return wls
    names = parse_choice("--workloads", flag_value, [w.name for w in wls if w.name not in companions])
    return [w for w in wls if w.name in names or companions.get(w.name) in names]


def finish(ns, command: str, table: str, lines: list[str], payload: dict) -> int:
    """Print the table and ranking lines; write ``--json``."""
    from kvserve.workload.io import write_json

    print(table)
    for ln in lines:
        print(ln)
    if ns.json:
        write_json(ns.json, {"command": command, "quick": ns.quick, **payload, "system": system_info()})
        print(f"wrote {ns.json}")
    return 0


def ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    return fmt_table(headers, rows)


def error(e: Exception) -> int:
    print(f"Error: {e}", file=sys.stderr)
    return 2
