"""``kvserve profile``: measure this host's engine steps and fit the simulator's cost model.

The profiler builds the real engine (``LLMEngine.from_engine_args``: real weights, real KV
cache, the engine flags given) and runs crafted requests through ``LLMEngine.step`` while a thin
wrapper around the executor records each step's ``StepShape``. Each sample is the wall time of
a *whole* ``step()``: scheduling, block moves, the forward, sampling, appending tokens and stop
checks -- what the simulator's virtual clock has to advance by. The grid:

* **prefill**: ``k`` prompts of ``p`` tokens at once (``k * p`` within the step budget), and
  prompts longer than the budget (chunked: later chunks attend over earlier ones);
* **decode**: ``b`` sequences of context ``L`` decoding together for ``--decode-steps`` steps
  (the prefill steps that start them are samples too; each generates as many more tokens as
  those steps, so the whole batch decodes together);
* **mixed** (chunked prefill): a prompt chunk of ``p`` tokens joining ``b`` running decodes of
  context ``mixed_context_len`` (``p`` clipped to the budget the decodes leave: the full
  chunked-prefill step with many decodes that a loaded replay mostly runs);
* **swap**: ``n`` blocks swapped out and in through the worker (``Worker.execute_model`` with
  only the block maps): fitted apart, per block, since those calls have no step around them.

Fit (``fit_cost_model``: relative least squares aimed at each shape's mean time, only gross
outliers (> 10x) trimmed, coefficients >= 0; the mean because a replay's clock sums step costs).
``kvserve profile --refit OLD.json --out NEW.json`` refits a file's stored measurements with
the current fit (no engine is built). Why these terms: on
this engine a step is Python work per step and per scheduled group (scheduling, metadata,
sampling, detokenizing: ``base_s``, ``prefill_seq_s``, ``sample_s``), GEMMs linear in the
query tokens (``prefill_token_s`` for prompt tokens; ``decode_seq_s`` for decodes, which on CPU
run on the separate native decode path), prefill attention quadratic in chunk length (causal
pairs: ``prefill_attn_s``) and decode attention linear in the KV positions read
(``context_token_s``). The per-class errors in the file say how well that holds here.

No term for time outside ``step()``: step records of a real replay (``bench fidelity
--steps-out``) put the replay loop's own work and Python GC at ~0.01% of the time, and
scheduling plus output processing (inside ``step()``, so in these samples) at ~0.1%, with up to
~100 requests queued. The default grid is sized to the steps a loaded default replay spends its time
in (full 2,048-token chunked steps of several prompt chunks with ~50-60 decodes over ~20,000 KV
positions): an extrapolated cost there was half the simulated time of the first quiet run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from kvserve.config import EngineArgs
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest
from kvserve.sim.cost_model import (
    CostModel,
    decode_knot_candidates,
    fit_cost_model,
    fit_errors,
    prefill_knot_candidates,
    profile_ranges,
)
from kvserve.sim.cost_model_file import (
    SCHEMA,
    SCHEMA_VERSION,
    fit_extras,
    host_info,
    model_identity,
    model_kv_heads,
    save_cost_model,
)
from kvserve.sim.step_shape import StepShape, step_shape


@dataclass
class ProfileGrid:
    """Which step shapes to measure (token counts are clipped to the engine's budget and
    ``max_model_len``). ``small()`` is a grid of seconds for tests and smoke runs."""

    prefill_lens: list[int] = field(default_factory=lambda: [16, 64, 256, 1024, 2048])
    prefill_batch: list[int] = field(default_factory=lambda: [1, 2, 4])
    long_prompt_chunks: int = 3
    # 64 decodes of ~300 tokens (256 + the warm-in and measured steps: ~19,500 KV positions,
    # ~85% of the default cache): the batch a loaded default replay runs (up to ~60-70 decodes
    # over ~23,000 positions) is within 1.25x
    context_lens: list[int] = field(default_factory=lambda: [32, 256, 1024])
    # every doubling: the decode line bends (decode_knots) where the measured batches say
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    decode_steps: int = 8
    # decode steps run, unrecorded, between a decode scenario's prompts and its measured steps:
    # a decode right after a prompt step (or an idle pause) is slower and speeds up over the
    # next ~100 steps (bfloat16 SmolLM2-135M, 1 sequence: 11.7 -> 8.7 ms; float32 19.8 -> 17.2
    # ms), and a loaded replay's decodes run mostly 16-255 steps after the last prompt (with
    # none, the profile measured steps 1-8 and over-predicted those by 10-14%)
    decode_warm_steps: int = 32
    # the last one is clipped to the budget left by the decodes: a full chunked-prefill step
    # with many decodes riding along, the step a loaded replay spends most of its time in
    mixed_prefill_lens: list[int] = field(default_factory=lambda: [16, 128, 512, 2048])
    mixed_batch_sizes: list[int] = field(default_factory=lambda: [2, 16, 64])
    mixed_context_len: int = 192
    swap_blocks: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    repeats: int = 2
    # scenarios (all repeats) run in an order shuffled with this seed, so a slow phase of a
    # host whose speed drifts over minutes falls on every shape class, not on one (None: grid
    # order, each class in turn)
    order_seed: int | None = 0

    def override(self, **lists) -> ProfileGrid:
        """A copy with the given fields replaced (None values are left as they are).

        Raises:
            ValueError: a list with a value < 1, or a count < 0, naming the field.
        """
        g = dataclasses.replace(self)
        for name, v in lists.items():
            if v is None:
                continue
            vals = v if isinstance(v, list) else [v]
            low = 0 if name in ("long_prompt_chunks", "order_seed", "decode_warm_steps") else 1
            if not vals or any(x < low for x in vals):
                raise ValueError(f"{name} must be >= {low}, got {v}")
            setattr(g, name, v)
        return g

    @classmethod
    def quick(cls) -> ProfileGrid:
        """The default shapes measured once each (half the default's time, ~2 min on this
        host): short enough to re-profile right before each run on a host whose speed drifts."""
        return cls(repeats=1)

    @classmethod
    def small(cls) -> ProfileGrid:
        return cls(
            prefill_lens=[8, 32, 96],
            prefill_batch=[1, 2],
            long_prompt_chunks=0,
            context_lens=[16, 64],
            batch_sizes=[1, 4],
            decode_steps=4,
            decode_warm_steps=2,
            mixed_prefill_lens=[8, 32],
            mixed_batch_sizes=[2],
            mixed_context_len=16,
            swap_blocks=[1, 4],
            repeats=1,
        )


class _RecordingExecutor:
    """Passes every call to the real executor; remembers the shape of the last step run."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last: StepShape | None = None

    def execute_model(self, req: ExecuteModelRequest):
        self.last = step_shape(req)
        return self.inner.execute_model(req)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Profiler:
    """Runs the grid on a real engine; ``samples`` are (StepShape, seconds) of whole steps,
    ``swap_samples`` (blocks moved, seconds) of bare swap calls."""

    def __init__(self, engine, grid: ProfileGrid, progress: bool = True) -> None:
        self.engine = engine
        self.grid = grid
        self.rec = _RecordingExecutor(engine.executor)
        engine.executor = self.rec
        self.samples: list[tuple[StepShape, float]] = []
        self.swap_samples: list[tuple[int, float]] = []
        self.progress = progress
        #: seconds, read before and after each measured call (a test may substitute its own)
        self.timer = time.perf_counter
        self._n = 0
        sc = engine.scheduler_config
        self.budget = sc.max_num_batched_tokens
        self.max_len = sc.max_model_len
        self.chunked = sc.chunked_prefill_enabled
        vocab = engine.vocab_size or 1000
        self._vocab = vocab

    # -- helpers
    def _prompt(self, n: int) -> list[int]:
        # distinct prompts (no prefix sharing even with prefix caching on)
        self._n += 1
        base = self._n * 7919
        return [3 + (base + j * 31) % (self._vocab - 3) for j in range(n)]

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        rid = f"profile-{self._n}"
        self.engine.add_request(
            rid,
            {"prompt_token_ids": self._prompt(prompt_len)},
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        )
        return rid

    def _step(self, record: bool = True) -> list:
        self.rec.last = None
        t0 = self.timer()
        outs = self.engine.step()
        dt = self.timer() - t0
        if record and self.rec.last is not None and not self.rec.last.is_empty:
            self.samples.append((self.rec.last, dt))
        return outs

    def _drain(self, record: bool = True, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self._step(record)
        raise RuntimeError("profile scenario did not finish")

    def _fits(self, prompt_len: int, out: int) -> bool:
        return prompt_len + out <= self.max_len

    def _fits_cache(self, num_seqs: int, seq_len: int, extra_len: int = 0) -> bool:
        """``num_seqs`` sequences of ``seq_len`` tokens (and one of ``extra_len``) fit the KV
        cache at once (a scenario that preempts would measure recomputes, not decodes)."""
        bs = self.engine.cache_config.block_size
        blocks = self.engine.cache_config.num_gpu_blocks or 0
        return num_seqs * -(-seq_len // bs) + -(-extra_len // bs) <= blocks * 0.9

    def _cache_room(self, num_seqs: int, seq_len: int) -> int:
        """Tokens one more sequence may hold beside ``num_seqs`` of ``seq_len`` within
        ``_fits_cache``'s bound (<= 0: none)."""
        bs = self.engine.cache_config.block_size
        blocks = self.engine.cache_config.num_gpu_blocks or 0
        free = int(blocks * 0.9) - num_seqs * -(-seq_len // bs)
        return free * bs - 1

    # -- scenarios
    def warm_up(self) -> None:
        """One small prefill and a few decodes, not recorded (first-call costs)."""
        for _ in range(2):
            self._add(min(64, self.max_len - 8), 4)
        self._drain(record=False)

    def scenarios(self) -> list[tuple[str, object]]:
        g = self.grid
        items: list[tuple[str, object]] = []
        for _ in range(g.repeats):
            for p in g.prefill_lens:
                for k in g.prefill_batch:
                    if k * p <= self.budget and self._fits(p, 1):
                        items.append(("prefill", (p, k)))
            for i in range(2, g.long_prompt_chunks + 1):
                if self.chunked and self._fits(i * self.budget, 1):
                    items.append(("prefill", (i * self.budget, 1)))
            for L in g.context_lens:
                for b in g.batch_sizes:
                    out = self._decode_tokens(L, b)
                    if (
                        self._fits(L, out)
                        and b <= self.engine.scheduler_config.max_num_seqs
                        and self._fits_cache(b, L + out)
                    ):
                        items.append(("decode", (L, b)))
            if self.chunked:
                for b in g.mixed_batch_sizes:
                    items.append(("mixed", (b,)))
            items.append(("swap", None))
        if g.order_seed is not None:
            import random

            random.Random(g.order_seed).shuffle(items)
        return items

    def run_prefill(self, p: int, k: int) -> None:
        for _ in range(k):
            self._add(p, 1)
        self._drain()

    def _decode_tokens(self, L: int, b: int) -> int:
        """Tokens each of ``b`` decoders of context ``L`` generates: ``decode_steps`` more than
        the steps their prompts take (chunked prefill of ``b * L`` tokens), so all ``b`` decode
        together for ``decode_steps`` steps (otherwise the first ones finish before the last
        one starts and the full batch is never measured)."""
        g = self.grid
        return g.decode_warm_steps + g.decode_steps + 1 + -(-b * L // max(1, self.budget))

    def run_decode(self, L: int, b: int) -> None:
        out = self._decode_tokens(L, b)
        for _ in range(b):
            self._add(L, out)
        warm = self.grid.decode_warm_steps
        for _ in range(100_000):
            if not self.engine.has_unfinished_requests():
                return
            n = len(self.samples)
            self._step()
            if warm and len(self.samples) > n and self.samples[-1][0].prefill_tokens == 0:
                self.samples.pop()  # one of the warm-in decodes
                warm -= 1
        raise RuntimeError("profile scenario did not finish")

    def run_mixed(self, b: int) -> None:
        L = self.grid.mixed_context_len
        # chunks longer than the budget the decodes leave are clipped to it (a full step), and
        # to the cache the decodes leave: a small cache still measures its mixed steps
        out = 2 * len(self.grid.mixed_prefill_lens) + 4
        room = self._cache_room(b, L + out)
        lens = sorted({min(p, self.budget - b, room) for p in self.grid.mixed_prefill_lens})
        lens = [p for p in lens if p >= 1 and self._fits(p, 1)]
        if not lens or not self._fits(L, out):
            return
        ids = [self._add(L, out) for _ in range(b)]
        seen: set[str] = set()
        for _ in range(10_000):  # until every decoder is past its prompt
            if len(seen) >= b:
                break
            seen.update(o.request_id for o in self._step() if o.outputs and o.outputs[0].token_ids)
        for p in lens:
            self._add(p, 1)
            self._step()  # the new prompt's chunk alongside the b decodes
            self._step()
        self.engine.abort_request(ids)
        self._drain()

    def run_swap(self) -> None:
        worker = getattr(self.rec.inner, "worker", self.rec.inner)
        ng = self.engine.cache_config.num_gpu_blocks or 0
        nc = self.engine.cache_config.num_cpu_blocks or 0
        for n in self.grid.swap_blocks:
            n = min(n, ng, nc)
            if n < 1:
                continue
            # free blocks at the top of both pools: their content does not matter here
            gpu = list(range(ng - n, ng))
            cpu = list(range(nc - n, nc))
            for req in (
                ExecuteModelRequest([], blocks_to_swap_out=dict(zip(gpu, cpu))),
                ExecuteModelRequest([], blocks_to_swap_in=dict(zip(cpu, gpu))),
            ):
                t0 = self.timer()
                worker.execute_model(req)
                self.swap_samples.append((n, self.timer() - t0))

    def run(self) -> None:
        """Warm up, then every scenario of the grid (with a progress bar on stderr)."""
        from tqdm.auto import tqdm

        self.warm_up()
        items = self.scenarios()
        for kind, arg in tqdm(items, desc="profiling steps", disable=not self.progress, file=sys.stderr):
            self.run_scenario(kind, arg)

    def run_scenario(self, kind: str, arg) -> None:
        """One item of ``scenarios()``: ``kind`` is prefill, decode, mixed or swap."""
        if kind == "prefill":
            self.run_prefill(*arg)
        elif kind == "decode":
            self.run_decode(*arg)
        elif kind == "mixed":
            self.run_mixed(*arg)
        else:
            self.run_swap()


def fit_swap(samples: list[tuple[int, float]]) -> tuple[float, dict | None]:
    """Seconds per swapped block: least squares of time on blocks with an intercept (the call's
    own overhead, which a real step already pays in ``base_s``); its relative error on the
    marginal time. ``(0.0, None)`` without samples."""
    import numpy as np

    if len({n for n, _ in samples}) < 2:
        return 0.0, None
    x = np.array([[1.0, n] for n, _ in samples])
    y = np.array([t for _, t in samples])
    sol, *_ = np.linalg.lstsq(x, y, rcond=None)
    per = max(float(sol[1]), 0.0)
    pred = sol[0] + per * x[:, 1]
    rel = (pred - y) / y
    a = np.abs(rel)
    return per, {
        "n": len(y),
        "mean": float(a.mean()),
        "p50": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
        "bias": float(rel.mean()),
        "total": float((pred.sum() - y.sum()) / y.sum()),
    }


def profile(
    args: EngineArgs,
    grid: ProfileGrid | None = None,
    progress: bool = True,
    flags: dict[str, str] | None = None,
) -> dict:
    """Build the engine ``args`` describe, profile it and return the cost-model file's JSON
    object (``kvserve.sim.cost_model_file``); ``flags``: as ``profile_engine``'s.

    Raises:
        ValueError: a bad engine setting (naming the field), grid values given by flag that
            do not fit the engine, or too few measured steps.
    """
    from kvserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    data = profile_engine(engine, args, grid, progress, flags)
    data["profile"]["load_s"] = time.perf_counter() - t0 - data["profile"]["wall_s"]
    return data


def profile_engine(
    engine,
    args: EngineArgs,
    grid: ProfileGrid | None = None,
    progress: bool = True,
    flags: dict[str, str] | None = None,
) -> dict:
    """Profile an already built real ``engine`` (built from ``args``; it is left idle, with its
    own executor back in place) and return the cost-model file's JSON object. ``flags``: the
    grid fields given on the command line (``grid_flags``), checked against the engine's
    limits before anything is measured (``check_grid_fits``).

    Raises:
        ValueError: grid values given by flag that do not fit the engine, or too few measured
            steps to fit.
    """
    import kvserve

    grid = grid or ProfileGrid()
    sc0 = engine.scheduler_config
    if sc0.max_model_len < MIN_PROFILE_LEN:
        raise ValueError(
            f"max_model_len={sc0.max_model_len} is too short to profile: at least {MIN_PROFILE_LEN} "
            "tokens (the warm-up's and the smallest shapes' prompts and their outputs)"
        )
    if flags:
        check_grid_fits(grid, flags, sc0.max_model_len, sc0.max_num_seqs)
    prof = Profiler(engine, grid, progress=progress)
    t1 = time.perf_counter()
    try:
        prof.run()
    finally:
        engine.executor = prof.rec.inner
        # the swap samples moved arbitrary content through free blocks: no cached block may
        # be reused after them
        engine.reset_prefix_cache()
    wall_s = time.perf_counter() - t1
    model = model_identity(args.model, args.quantization)
    host = host_info()
    cm = _fit(prof.samples, _split_of(model_kv_heads(model["path"]), host.get("threads")))
    cm.swap_block_s, swap_err = fit_swap(prof.swap_samples)
    errors = fit_errors(cm, prof.samples)
    if swap_err is not None:
        errors["swap"] = swap_err
    mc, cc, sc = engine.model_config, engine.cache_config, engine.scheduler_config
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kvserve_version": kvserve.__version__,
        "model": model,
        "dtype": str(mc.resolved_dtype()).replace("torch.", ""),
        "block_size": cc.block_size,
        "device": mc.resolved_device(),
        "host": host,
        "engine": {
            "enable_chunked_prefill": sc.chunked_prefill_enabled,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "max_model_len": sc.max_model_len,
            "num_gpu_blocks": cc.num_gpu_blocks,
            "num_cpu_blocks": cc.num_cpu_blocks,
        },
        "coefficients": cm.coefficients(),
        **fit_extras(cm),
        "fit_error": errors,
        "fit": {"method": FIT_METHOD},
        "profile": {
            "grid": dataclasses.asdict(grid),
            "load_s": 0.0,
            "wall_s": wall_s,
            "num_steps": len(prof.samples),
            # the largest of each count measured: a simulation past them extrapolates
            "ranges": profile_ranges([sh for sh, _ in prof.samples]),
            "samples": [{"shape": s.as_dict(), "t": t} for s, t in prof.samples],
            "swap_samples": [{"blocks": n, "t": t} for n, t in prof.swap_samples],
        },
    }


#: how ``fit_cost_model`` fits (recorded in each file's ``fit``)
FIT_METHOD = (
    "mean: relative least squares, 1/prediction weights, decode knots, prefill knots, attention split, "
    "trim 10x"
)


def _split_of(kv_heads: int | None, threads) -> tuple[int, int] | None:
    """The decode attention's ``(kv_heads, threads)``, or None when either is unknown."""
    if not kv_heads or not isinstance(threads, int) or threads < 1:
        return None
    return kv_heads, threads


def _fit(samples, attention_split, trim: float | None = 10.0) -> CostModel:
    """``fit_cost_model`` with the decode and prefill knots the samples offer and the attention
    split."""
    return fit_cost_model(
        samples,
        trim=trim,
        decode_knots=decode_knot_candidates(samples),
        prefill_knots=prefill_knot_candidates(samples),
        attention_split=attention_split,
    )


def refit_profile(data: dict, trim: float | None = 10.0, path: str = "<cost model>") -> dict:
    """A copy of a cost-model file's object (``data``, read from ``path``, which errors name)
    with its coefficients and fit errors refitted from its stored measurements
    (``profile.samples``, ``profile.swap_samples``) by the current ``fit_cost_model``; ``fit``
    says how and when (the previous fit is kept as ``fit.previous_coefficients``).

    Raises:
        ValueError: a malformed file or too few stored samples.
    """
    import copy

    from kvserve.sim.cost_model_file import parse_cost_model

    f = parse_cost_model(data, path)
    samples = f.samples()
    split = f.cost_model.attention_split or _split_of(
        model_kv_heads((data.get("model") or {}).get("path", "")), (data.get("host") or {}).get("threads")
    )
    cm = _fit(samples, split, trim=trim)
    swaps = f.swap_samples()
    cm.swap_block_s, swap_err = (
        fit_swap(swaps) if swaps else (data["coefficients"].get("swap_block_s", 0.0), None)
    )
    errors = fit_errors(cm, samples)
    if swap_err is not None:
        errors["swap"] = swap_err
    out = copy.deepcopy(data)
    for key in ("decode_knots", "prefill_knots", "attention_split"):
        out.pop(key, None)
    out["coefficients"] = cm.coefficients()
    out.update(fit_extras(cm))
    out["fit_error"] = errors
    if samples and isinstance(out.get("profile"), dict):
        out["profile"]["ranges"] = profile_ranges([sh for sh, _ in samples])
    out["fit"] = {
        "method": FIT_METHOD if trim == 10.0 else f"{FIT_METHOD.rsplit(',', 1)[0]}, trim {trim}",
        "refitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "previous_coefficients": data["coefficients"],
    }
    return out


def print_fit(data: dict, out=None) -> None:
    """The coefficients and the fit's error per shape class, as a table (stdout by default)."""
    out = out or sys.stdout
    print("coefficients:", file=out)
    for k, v in data["coefficients"].items():
        print(f"  {k:16} {v:.4g}", file=out)
    for k, v in (data.get("decode_knots") or {}).items():
        print(f"  {'decode past ' + k:16} {v:.4g}  (per decode, decode-only steps)", file=out)
    for k, v in (data.get("prefill_knots") or {}).items():
        print(f"  {'rows up to ' + k:16} {v:.4g}  (per forward row, steps with prompt tokens)", file=out)
    split = data.get("attention_split")
    if split:
        print(f"  attention split  {split['kv_heads']} KV heads over {split['threads']} threads", file=out)
    print(
        f"{'class':10}{'steps':>7}{'mean err':>10}{'p50 err':>10}{'p90 err':>10}{'max err':>10}{'total':>9}",
        file=out,
    )
    for k, e in data["fit_error"].items():
        print(
            f"{k:10}{e['n']:>7}{e['mean']:>10.1%}{e['p50']:>10.1%}{e['p90']:>10.1%}{e['max']:>10.1%}"
            f"{e['total']:>+9.1%}",
            file=out,
        )


def _int_list(flag: str, s: str) -> list[int]:
    """A comma list flag's value: integers >= 1, at least one.

    Raises:
        ValueError: empty, an item that is not an integer, or one < 1 (naming ``flag``).
    """
    items = [x.strip() for x in s.split(",")]
    if not any(items):
        raise ValueError(f"{flag} must be a comma-separated list of integers >= 1, got {s!r} (empty)")
    try:
        vals = [int(x) for x in items]
    except ValueError:
        bad = next(x for x in items if not x.lstrip("+-").isdigit())
        raise ValueError(
            f"{flag} must be a comma-separated list of integers >= 1, got {bad!r} in {s!r}"
        ) from None
    if any(v < 1 for v in vals):
        raise ValueError(f"{flag} must be a comma-separated list of integers >= 1, got {s!r}")
    return vals


#: The shortest ``max_model_len`` a profile runs at (its warm-up prompts are up to 8 tokens
#: short of it, and the small grid's shortest prompt is 16 tokens).
MIN_PROFILE_LEN = 32

#: ``ProfileGrid`` fields with a command-line flag (comma lists / single integers)
LIST_FIELDS = (
    "prefill_lens",
    "prefill_batch",
    "context_lens",
    "batch_sizes",
    "mixed_prefill_lens",
    "mixed_batch_sizes",
)
INT_FIELDS = (
    "decode_steps",
    "decode_warm_steps",
    "repeats",
    "long_prompt_chunks",
    "mixed_context_len",
    "order_seed",
)


#: why ``profile`` and ``bench fidelity`` refuse ``--speculative-config``
SPEC_NOT_PROFILED = (
    "does not apply: the cost model prices plain (non-speculating) steps; simulate speculation with "
    "`kvserve simulate --speculative-config` and its acceptance model"
)


def add_grid_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--[prefix]grid small|default`` and comma-list overrides of ``ProfileGrid``'s fields."""
    g = ap.add_argument_group("profile grid")
    g.add_argument(
        f"--{prefix}grid",
        choices=["default", "quick", "small"],
        default="default",
        help="quick: the default shapes once (half the time: a re-profile right before a run); "
        "small: seconds (smoke runs, tests)",
    )
    default = ProfileGrid()
    for name in LIST_FIELDS:
        g.add_argument(
            f"--{prefix}{name.replace('_', '-')}",
            default=None,
            metavar="N,N,...",
            help=f"{_MEANING[name]}: integers >= 1{_LIMIT_HELP.get(name, '')} "
            f"(default {','.join(map(str, getattr(default, name)))})",
        )
    for name in INT_FIELDS:
        g.add_argument(
            f"--{prefix}{name.replace('_', '-')}",
            type=int,
            default=None,
            metavar="N",
            help=f"{_MEANING[name]} (default {getattr(default, name)})",
        )


#: what each grid flag sets (its help text)
_MEANING = {
    "prefill_lens": "prompt lengths profiled",
    "prefill_batch": "prompts of one length prefilled together",
    "context_lens": "context lengths of the decode steps",
    "batch_sizes": "decodes per decode step",
    "mixed_prefill_lens": "prompt chunk lengths joining running decodes",
    "mixed_batch_sizes": "running decodes beside those chunks",
    "decode_steps": "decode steps timed per decode shape",
    "decode_warm_steps": "untimed decode steps before them",
    "repeats": "passes over the grid",
    "long_prompt_chunks": "prompts of 2..N step budgets (chunked prefill; 0 = none)",
    "mixed_context_len": "context of the decodes in mixed steps",
    "order_seed": "seed of the shuffled scenario order",
}


#: grid fields an engine limit bounds (``check_grid_fits``), and the help text that says so
_LIMIT_HELP = {
    "prefill_lens": "; each < the engine's max_model_len",
    "context_lens": "; each < the engine's max_model_len",
    "mixed_prefill_lens": "; each < the engine's max_model_len",
    "batch_sizes": "; each <= --max-num-seqs",
    "mixed_batch_sizes": "; each <= --max-num-seqs",
}


def grid_flags(ns: argparse.Namespace, prefix: str = "") -> dict[str, str]:
    """``ProfileGrid`` field -> its flag, for the grid flags given (``check_grid_fits``)."""
    p = prefix.replace("-", "_")
    return {
        n: f"--{prefix}{n.replace('_', '-')}"
        for n in LIST_FIELDS + INT_FIELDS
        if getattr(ns, p + n) is not None
    }


def grid_from_args(ns: argparse.Namespace, prefix: str = "") -> ProfileGrid:
    """The ``ProfileGrid`` ``add_grid_args``' flags describe.

    Raises:
        ValueError: a bad value (an empty list, a non-integer, a value < 1, a count < 0),
            naming the flag.
    """
    p = prefix.replace("-", "_")
    name = getattr(ns, f"{p}grid")
    grid = {"small": ProfileGrid.small, "quick": ProfileGrid.quick}.get(name, ProfileGrid)()
    values: dict = {}
    for n in LIST_FIELDS + INT_FIELDS:
        v, flag = getattr(ns, p + n), f"--{prefix}{n.replace('_', '-')}"
        if isinstance(v, str):
            v = _int_list(flag, v)
        try:
            grid.override(**{n: v})  # the field's own check (None: unset)
        except ValueError as e:  # "<field> must be ...": name the flag instead
            raise ValueError(str(e).replace(n, flag, 1)) from None
        values[n] = v
    return grid.override(**values)


def check_grid_fits(grid: ProfileGrid, flags: dict[str, str], max_model_len: int, max_num_seqs: int) -> None:
    """The grid values given by flag (``flags``: field -> flag, ``grid_flags``) must fit the
    engine: prompt and context lengths < ``max_model_len``, batch sizes <= ``max_num_seqs``
    (the profiler would skip them silently; the default grid's are clipped and skipped so).

    Raises:
        ValueError: naming the flag, the value and the limit.
    """
    for name, flag in flags.items():
        v = getattr(grid, name)
        vals = v if isinstance(v, list) else [v]
        if name in ("prefill_lens", "context_lens", "mixed_prefill_lens", "mixed_context_len"):
            over = [x for x in vals if x >= max_model_len]
            limit = f"< the engine's max_model_len {max_model_len} (a prompt must leave room to generate)"
        elif name in ("batch_sizes", "mixed_batch_sizes"):
            over = [x for x in vals if x > max_num_seqs]
            limit = f"<= --max-num-seqs {max_num_seqs} (larger batches never run at once)"
        else:
            continue
        if over:
            raise ValueError(f"{flag} values must be {limit}, got {', '.join(map(str, over))}")


def main(argv: list[str] | None = None) -> int:
    from kvserve.entrypoints.cli import add_engine_args, engine_args_from, flag_names
    from kvserve.sim.cli_checks import given_dests, refuse_unused
    from kvserve.workload.io import check_output_path

    ap = argparse.ArgumentParser(
        prog="kvserve profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="cost-model JSON to write (checked before profiling)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument(
        "--refit",
        default=None,
        metavar="PROFILE.json",
        help="measure nothing: refit this file's stored measurements with the current fit, write --out",
    )
    add_grid_args(ap)
    add_engine_args(ap)
    ns = ap.parse_args(argv)
    try:
        check_output_path("--out", ns.out)
        given = given_dests(ap, argv, ns)
        # the cost model prices plain steps; `simulate --speculative-config` adds speculation
        refuse_unused(given, ["speculative_config"], SPEC_NOT_PROFILED)
        if ns.refit:  # no engine is built: every grid and engine flag would be ignored
            refuse_unused(
                given - {"out", "refit", "no_progress"},
                sorted(given),
                "does not apply with --refit (it measures nothing: the file's stored steps are refitted)",
            )
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if ns.refit:
        from kvserve.sim.cost_model_file import load_cost_model

        try:
            data = refit_profile(load_cost_model(ns.refit, "--refit").data, path=ns.refit)
            save_cost_model(ns.out, data)
        except ValueError as e:
            print(f"Error: {e}", file=sys.stderr)
            return 2
        print(
            f"refitted {len(data['profile']['samples'])} stored steps of {ns.refit} ({FIT_METHOD}); wrote {ns.out}"
        )
        print_fit(data)
        return 0
    try:
        grid = grid_from_args(ns)
        data = profile(engine_args_from(ns), grid, progress=not ns.no_progress, flags=grid_flags(ns))
    except ValueError as e:  # engine settings' errors name fields: say the flags
        print(f"Error: {flag_names(str(e))}", file=sys.stderr)
        return 2
    try:
        save_cost_model(ns.out, data)
    except OSError as e:  # checked before the run, but a disk can fill or a folder go meanwhile
        import tempfile

        fd, spare = tempfile.mkstemp(prefix="kvserve-profile-", suffix=".json")
        os.close(fd)
        save_cost_model(spare, data)
        print(
            f"Error: --out {ns.out}: cannot write it ({e.strerror or e}); the profile is in {spare}",
            file=sys.stderr,
        )
        return 1
    p = data["profile"]
    print(
        f"profiled {p['num_steps']} steps in {p['wall_s']:.1f} s ({data['model']['name']}, {data['dtype']}, "
        f"{data['host']['cpu']}); wrote {ns.out}"
    )
    print_fit(data)
    return 0


__all__ = [
    "CostModel",
    "ProfileGrid",
    "Profiler",
    "profile",
    "profile_engine",
    "fit_swap",
    "refit_profile",
    "main",
]
