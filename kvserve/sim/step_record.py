"""Per-step records of a replay, and the report of predicted vs measured step time.

A replay with ``record_steps`` keeps one ``StepRecord`` per ``engine.step()`` that ran a
forward: the step's ``StepShape`` (the same ``step_shape`` the profiler and the simulated
executor use), the wall time of the step itself (``step_s``), of the executor call inside it
(``exec_s``), of the whole replay-loop iteration around it (``loop_s``: adding arrived
requests, the step, noting token times; up to the start of the next iteration), the Python GC
time that fell inside the iteration (``gc_s``) and the queue lengths the scheduler saw.

``compare_steps`` sets each record's measured time against a cost model's prediction, per
shape class and per step size, so the steps the model gets wrong (and by how much of the total
clock) can be found; ``refit_steps`` fits the cost model's terms to the replay's own steps, so
the coefficient that differs from the profile's says which cost the profile does not see;
``save_steps``/``load_steps`` write and read the records (JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

from kvserve.sim.cost_model_file import load_cost_model
from kvserve.sim.step_shape import StepShape

STEPS_SCHEMA = "kvserve-steps"
STEPS_SCHEMA_VERSION = 1

#: step-size bins for ``compare_steps``: query rows (prompt tokens + decodes) at most this many
SIZE_BINS = (64, 256, 1024, 1536, 2048, 4096)


@dataclass
class StepRecord:
    """One measured step (seconds; counts as in ``StepShape``).

    Attributes:
        shape: what the step ran.
        step_s: wall time of ``engine.step()``.
        exec_s: wall time of the executor's ``execute_model`` inside it (the forward, sampling
            and block moves; ``step_s - exec_s`` is scheduling and output processing).
        loop_s: wall time of the replay loop's iteration around the step (from its start to the
            next iteration's start): what the real side's clock advances by per step.
        gc_s: Python GC pauses within the iteration.
        num_waiting / num_running / num_swapped: the scheduler's queues before the step.
        start_s: the replay clock when the iteration checked for arrived requests, seconds
            from the replay's start (None in records written before it was kept): lets an
            oracle replay (``kvserve.sim.oracle``) start each step where the real one started.
        max_context_len: the longest decode's KV positions (None in older records).
        context_blocks: KV blocks the decodes read (None in older records).
        num_threads: torch's thread count after the step (the worker re-chooses it every 20 s).
    """

    shape: StepShape
    step_s: float
    exec_s: float = 0.0
    loop_s: float = 0.0
    gc_s: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    start_s: float | None = None
    max_context_len: int | None = None
    context_blocks: int | None = None
    num_threads: int | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = self.shape.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "step record") -> StepRecord:
        """The inverse of ``as_dict``.

        Raises:
            ValueError: naming the field (``where.field``): not an object, a missing
                ``shape`` or ``step_s``, an unknown field, or a value that is not a finite
                number >= 0 (an integer for the counts).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{where}: must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}")
        for key in ("shape", "step_s"):
            if key not in d:
                raise ValueError(f"{where}: missing field {key!r}")
        shape_d = d["shape"]
        if not isinstance(shape_d, dict):
            raise ValueError(f"{where}.shape: must be an object, got {type(shape_d).__name__}")
        kinds = {f.name: f.type for f in fields(StepShape)}
        unknown = sorted(set(shape_d) - set(kinds))
        if unknown:
            raise ValueError(f"{where}.shape: unknown field(s) {unknown}")
        shape = StepShape(
            **{k: _count(v, f"{where}.shape.{k}", kinds[k] != "float") for k, v in shape_d.items()}
        )
        times = {
            k: _count(d[k], f"{where}.{k}", False) for k in ("step_s", "exec_s", "loop_s", "gc_s") if k in d
        }
        q = {
            k: _count(d[k], f"{where}.{k}", True)
            for k in ("num_waiting", "num_running", "num_swapped")
            if k in d
        }
        start = d.get("start_s")
        start_s = None if start is None else _count(start, f"{where}.start_s", False)
        ext = {
            k: _count(d[k], f"{where}.{k}", True)
            for k in ("max_context_len", "context_blocks", "num_threads")
            if d.get(k) is not None
        }
        return cls(shape=shape, **times, **q, start_s=start_s, **ext)


def _count(v, where: str, integer: bool):
    """``v`` when it is a finite number >= 0 (an integer when ``integer``), else ValueError
    naming ``where``."""
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and v >= 0
    if ok and not integer:
        try:
            v = float(v)
        except OverflowError:  # an integer past float's range
            ok = False
        ok = ok and math.isfinite(v)
    if not ok:
        want = "an integer >= 0" if integer else "a finite number >= 0"
        raise ValueError(f"{where} must be {want}, got {v!r}")
    return v


def save_steps(path, records: Sequence[StepRecord], meta: dict | None = None) -> None:
    """Write ``records`` (and ``meta``, e.g. the trace and engine) as one JSON object,
    atomically (``kvserve.workload.io.atomic_write``)."""
    from kvserve.workload.io import write_text_atomic

    data = {
        "schema": STEPS_SCHEMA,
        "schema_version": STEPS_SCHEMA_VERSION,
        "meta": meta or {},
        "steps": [r.as_dict() for r in records],
    }
    write_text_atomic(path, json.dumps(data, default=str))


def load_steps(path) -> tuple[list[StepRecord], dict]:
    """Read a file ``save_steps`` wrote: ``(records, meta)``.

    Raises:
        ValueError: not such a file (naming what is wrong).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        raise ValueError(f"{path}: cannot read step records ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != STEPS_SCHEMA:
        raise ValueError(f"{path}: not a step-record file (schema must be {STEPS_SCHEMA!r})")
    if data.get("schema_version") != STEPS_SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {data.get('schema_version')!r}, expected {STEPS_SCHEMA_VERSION}"
        )
    steps, meta = data.get("steps", []), data.get("meta", {})
    if not isinstance(steps, list):
        raise ValueError(f"{path}: steps must be a list of step records, got {type(steps).__name__}")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: meta must be an object, got {type(meta).__name__}")
    return [StepRecord.from_dict(d, f"{path}: steps[{i}]") for i, d in enumerate(steps)], meta


def check_recorded_engine(meta: dict, cm_file) -> None:
    """Refuse to set records against a cost model profiled for another engine: ``meta``'s
    ``engine`` (the fidelity run's engine arguments) must match ``cm_file`` (a
    ``CostModelFile``) as ``CostModelFile.check_engine_args`` requires of a simulation
    (``block_size``; ``dtype`` unless auto; ``quantization`` when set; ``model`` when the
    recorded path exists here). Fields the records lack are not checked.

    Raises:
        ValueError: naming the mismatched field.
    """
    eng = meta.get("engine")
    if not isinstance(eng, dict):
        return
    model = eng.get("model")
    args = SimpleNamespace(
        block_size=eng.get("block_size", cm_file.block_size),
        dtype=eng.get("dtype"),
        quantization=eng.get("quantization"),
        model=model if isinstance(model, str) and Path(model).exists() else None,
    )
    try:
        cm_file.check_engine_args(args)
    except ValueError as e:
        raise ValueError(
            f"the step records were made with another engine than the cost model's: {e}"
        ) from None


def load_replay(steps_path, cost_model_path):
    """A recorded replay and the cost model to set it against, checked to belong together:
    ``(records, meta, cm_file)`` from ``load_steps(steps_path)``, ``load_cost_model`` and
    ``check_recorded_engine`` (what every step report reads first).

    Raises:
        ValueError: either file is malformed, or the records' engine is not the profile's.
    """
    records, meta = load_steps(steps_path)
    cm_file = load_cost_model(cost_model_path)
    check_recorded_engine(meta, cm_file)
    return records, meta, cm_file


def size_bin(shape: StepShape) -> str:
    """The ``SIZE_BINS`` bin of a step's query rows (prompt tokens + decodes), e.g. ``"<=256"``."""
    rows = shape.prefill_tokens + shape.decode_seqs + shape.verify_tokens
    for top in SIZE_BINS:
        if rows <= top:
            return f"<={top}"
    return f">{SIZE_BINS[-1]}"


def _group_stats(preds: list[float], recs: list[StepRecord]) -> dict:
    from kvserve.workload.stats import percentile

    step = sum(r.step_s for r in recs)
    loop = sum(r.loop_s for r in recs)
    pred = sum(preds)
    ratios = [r.step_s / p for r, p in zip(recs, preds) if p > 0]
    return {
        "n": len(recs),
        "predicted_s": pred,
        "step_s": step,
        "exec_s": sum(r.exec_s for r in recs),
        "loop_s": loop,
        "gc_s": sum(r.gc_s for r in recs),
        # signed errors of the summed time (what a clock accumulates); < 0: the model is fast
        "err_vs_step": (pred - step) / step if step else None,
        "err_vs_loop": (pred - loop) / loop if loop else None,
        "ratio_p50": percentile(ratios, 50) if ratios else None,
        "ratio_p90": percentile(ratios, 90) if ratios else None,
        "outside_exec_s": step - sum(r.exec_s for r in recs),
        "outside_step_s": loop - step,
    }


def compare_steps(records: Sequence[StepRecord], cost_model) -> dict:
    """Predicted (``cost_model.step_cost``) vs measured time of ``records``.

    Returns ``{"all": G, "by_class": {class: G}, "by_size": {bin: G}, "by_class_size":
    {"class bin": G}, "extrapolated": G}`` where ``G`` = ``{"n", "predicted_s", "step_s",
    "exec_s", "loop_s", "gc_s", "err_vs_step", "err_vs_loop", "ratio_p50", "ratio_p90",
    "outside_exec_s", "outside_step_s"}`` (sums in seconds; ``err_*``: signed relative error of
    the summed prediction, < 0 when the model is too fast; ``ratio_*``: measured step / predicted
    per step; ``extrapolated``: the steps ``cost_model.outside_range`` flags).
    """
    preds = [cost_model.step_cost(r.shape) for r in records]
    groups: dict[str, dict[str, list[int]]] = {"by_class": {}, "by_size": {}, "by_class_size": {}}
    extra: list[int] = []
    for i, r in enumerate(records):
        c, b = r.shape.shape_class, size_bin(r.shape)
        groups["by_class"].setdefault(c, []).append(i)
        groups["by_size"].setdefault(b, []).append(i)
        groups["by_class_size"].setdefault(f"{c} {b}", []).append(i)
        if cost_model.outside_range(r.shape):
            extra.append(i)

    def stats(idx: list[int]) -> dict:
        return _group_stats([preds[i] for i in idx], [records[i] for i in idx])

    out: dict = {"all": stats(list(range(len(records))))}
    for name, g in groups.items():
        out[name] = {k: stats(v) for k, v in sorted(g.items(), key=lambda kv: _bin_order(kv[0]))}
    out["extrapolated"] = stats(extra)
    return out


def _bin_order(key: str) -> tuple:
    parts = key.split(" ")
    b = parts[-1]
    n = int(b.lstrip("<=>")) + (1 if b.startswith(">") else 0) if b.lstrip("<=>").isdigit() else 0
    return (parts[0] if len(parts) > 1 else "", n, key)


def print_comparison(report: dict, out=None) -> None:
    """``compare_steps``' result as a table (stdout by default)."""
    import sys

    out = out or sys.stdout
    head = (
        f"{'group':22}{'steps':>6}{'pred s':>9}{'step s':>9}{'loop s':>9}{'err/step':>9}{'err/loop':>9}"
        f"{'ratio p50':>10}{'sched+out':>10}{'replay':>8}{'gc':>7}"
    )

    def row(name: str, g: dict) -> str:
        def pct(v):
            return f"{v:9.1%}" if v is not None else f"{'-':>9}"

        r50 = f"{g['ratio_p50']:10.3f}" if g["ratio_p50"] is not None else f"{'-':>10}"
        return (
            f"{name:22}{g['n']:>6}{g['predicted_s']:9.2f}{g['step_s']:9.2f}{g['loop_s']:9.2f}"
            f"{pct(g['err_vs_step'])}{pct(g['err_vs_loop'])}{r50}{g['outside_exec_s']:10.2f}"
            f"{g['outside_step_s']:8.2f}{g['gc_s']:7.2f}"
        )

    print(head, file=out)
    print(row("all", report["all"]), file=out)
    if report["extrapolated"]["n"]:
        print(row("extrapolated", report["extrapolated"]), file=out)
    for section in ("by_class", "by_size", "by_class_size"):
        print(f"-- {section}", file=out)
        for k, g in report[section].items():
            print(row(k, g), file=out)


def refit_steps(records: Sequence[StepRecord], cost_model, min_steps: int = 20) -> dict | None:
    """The cost model's terms fitted (``fit_cost_model``) to the records' loop times (what the
    real clock advanced by per step) beside ``cost_model``'s coefficients:
    ``{"profile": {name: s}, "replay": {name: s}, "fit_error": fit_errors of the refit}``;
    None with fewer than ``min_steps`` records (too few to fit). Swap and copy terms are not
    refitted (a replay's swaps ride inside steps)."""
    from kvserve.sim.cost_model import FEATURES, fit_cost_model, fit_errors

    samples = [(r.shape, r.loop_s or r.step_s) for r in records if (r.loop_s or r.step_s) > 0]
    if len(samples) < max(min_steps, len(FEATURES) + 1):
        return None
    fit = fit_cost_model(samples, attention_split=getattr(cost_model, "attention_split", None))
    return {
        "profile": cost_model.coefficients(),
        "replay": fit.coefficients(),
        "fit_error": fit_errors(fit, samples),
    }


def print_refit(refit: dict, out=None) -> None:
    """``refit_steps``' result as a table (stdout by default)."""
    import sys

    out = out or sys.stdout
    print(f"{'coefficient':18}{'profile':>12}{'replay fit':>12}", file=out)
    for k, v in refit["profile"].items():
        print(f"{k:18}{v:12.4g}{refit['replay'][k]:12.4g}", file=out)
    e = refit["fit_error"]["all"]
    print(f"replay fit on its own steps: p50 error {e['p50']:.1%}, summed {e['total']:+.1%}", file=out)
