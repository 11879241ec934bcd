"""Oracle replay: a recorded real run re-simulated with each step's *measured* time.

``bench fidelity`` compares the real engine with the simulator, and the difference has two
causes: the simulated engine may take other steps than the real one (the scheduling and
simulation error), and the cost model may put a wrong time on a step (the step-cost error).
The oracle separates them. It replays the same requests on the simulated engine (the same
scheduler, block manager and configs) but charges the ``i``-th simulated step the time the
``i``-th real step took (its ``StepRecord.loop_s``: what the real clock advanced by, from one
iteration of the replay loop to the next), so the cost model is out of the picture. If the
simulator takes the same steps in the same order, the oracle's latencies are the real run's up
to the loop's own bookkeeping: its error is the simulation error, and what is left of the
cost-model run's error is the step-cost error.

Step records that carry ``start_s`` (the real clock when that iteration checked for arrivals)
anchor each simulated step where the real one started: the sleep before an arrival overshoots
on the wall clock, an iteration without a forward takes time, and both are charged to the next
step (``MeasuredStepCost.resync_s``). Older records (no ``start_s``) charge the durations only.

``compare_step_sequences`` then sets the simulated steps against the recorded ones, index by
index (shape and the queues before the step), and explains the first step where they part:
nearly always a request arriving within a few milliseconds of a step boundary, seen by one side
one step before the other (the clocks differ by the loop's bookkeeping and a sleep's overshoot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvserve.sim.cost_model import CostModel, VirtualClock
from kvserve.sim.replay import ReplayResult, replay, simulated_engine
from kvserve.sim.step_record import StepRecord
from kvserve.sim.step_shape import StepShape
from kvserve.workload.workload import BenchRequest


class MeasuredStepCost:
    """A stand-in for ``CostModel`` in ``SimulatedExecutor``: step ``i`` (counting the steps
    that run something) costs ``records[i]``'s measured time.

    Args:
        records: the real run's steps, in order (``bench fidelity --steps-out``).
        clock: the simulated engine's clock (read to anchor a step at its record's
            ``start_s``); may be set after construction.
        fallback: prices steps past the last record (a simulation that took more steps than the
            real run); default the built-in ``CostModel``.

    Attributes:
        num_charged: steps priced from a record; ``num_past_records``: steps priced by
            ``fallback``; ``resync_s``: seconds added (or, when negative, taken off) to start steps
            where the real ones started (0 without ``start_s``).
    """

    def __init__(
        self,
        records: Sequence[StepRecord],
        clock: VirtualClock | None = None,
        fallback: CostModel | None = None,
    ) -> None:
        self.records = list(records)
        self.clock = clock
        self.fallback = fallback or CostModel()
        self.num_charged = 0
        self.num_past_records = 0
        self.resync_s = 0.0
        self.anchored = bool(self.records) and all(r.start_s is not None for r in self.records)

    def step_cost(self, shape: StepShape) -> float:
        """Seconds for the next non-empty step (0 for an empty one, as ``CostModel``)."""
        if shape.is_empty:
            return 0.0
        i = self.num_charged + self.num_past_records
        if i >= len(self.records):
            self.num_past_records += 1
            return self.fallback.step_cost(shape)
        self.num_charged += 1
        r = self.records[i]
        dt = r.loop_s or r.step_s
        if self.anchored and self.clock is not None and r.start_s is not None:
            # end the step where the real one ended: the gap is the real loop's time outside
            # the recorded steps (a sleep's overshoot, an iteration that ran no forward)
            gap = r.start_s - self.clock()
            gap = max(gap, -dt)  # never a negative step
            self.resync_s += gap
            dt += gap
        return dt

    def outside_range(self, shape: StepShape) -> bool:
        """Never: measured times are not extrapolated."""
        return False

    def coefficients(self) -> dict[str, float]:
        return self.fallback.coefficients()

    def describe(self) -> str:
        mode = "anchored at each real step's start" if self.anchored else "durations only"
        return f"measured step times of {len(self.records)} recorded real steps ({mode})"


def _nonzero(shape: StepShape) -> dict:
    return {k: v for k, v in shape.as_dict().items() if v}


def same_shape(a: StepShape, b: StepShape) -> bool:
    """Equal counts (attention pairs, a float sum, to 1e-9 relative)."""
    da, db = a.as_dict(), b.as_dict()
    for k, v in da.items():
        w = db[k]
        if isinstance(v, float) or isinstance(w, float):
            if not math.isclose(v, w, rel_tol=1e-9, abs_tol=1e-9):
                return False
        elif v != w:
            return False
    return True


def compare_step_sequences(
    real: Sequence[StepRecord],
    sim: Sequence[StepRecord],
    arrivals: dict[int, float] | None = None,
    limit: int = 10,
) -> dict:
    """Index-by-index comparison of the real run's steps and the simulated ones.

    Returns ``{"real_steps", "simulated_steps", "num_diverged", "first_diverged", "diverged":
    [D, ...] (the first ``limit``), "why"}`` where ``D`` = ``{"index", "real", "simulated"
    (the shapes' non-zero counts), "real_queues", "simulated_queues" ([waiting, running,
    swapped] before the step), "real_clock_s", "simulated_clock_s" (``start_s``, None where not
    recorded), "nearest_arrival"}``; ``nearest_arrival`` (with ``arrivals``: request id ->
    arrival seconds) is ``{"id", "arrival_s", "from_simulated_clock_s"}`` of the request whose
    arrival is nearest the simulated step's start. ``why``: the first divergence in words (None
    when every step matches and the counts are equal).
    """
    n = min(len(real), len(sim))
    diverged = [i for i in range(n) if not same_shape(real[i].shape, sim[i].shape)]
    if len(real) != len(sim):
        diverged.append(n)  # one side ran more steps: they part at the shorter one's end

    def detail(i: int) -> dict:
        r = real[i] if i < len(real) else None
        s = sim[i] if i < len(sim) else None
        d: dict = {
            "index": i,
            "real": _nonzero(r.shape) if r else None,
            "simulated": _nonzero(s.shape) if s else None,
            "real_queues": [r.num_waiting, r.num_running, r.num_swapped] if r else None,
            "simulated_queues": [s.num_waiting, s.num_running, s.num_swapped] if s else None,
            "real_clock_s": r.start_s if r else None,
            "simulated_clock_s": s.start_s if s else None,
            "nearest_arrival": None,
        }
        if arrivals and s is not None and s.start_s is not None:
            t = s.start_s
            rid, a = min(arrivals.items(), key=lambda kv: abs(kv[1] - t))
            d["nearest_arrival"] = {"id": rid, "arrival_s": a, "from_simulated_clock_s": a - t}
        return d

    details = [detail(i) for i in diverged[:limit]]
    return {
        "real_steps": len(real),
        "simulated_steps": len(sim),
        "num_diverged": len(diverged),
        "first_diverged": diverged[0] if diverged else None,
        "diverged": details,
        "why": _why(details[0]) if details else None,
    }


def _why(d: dict) -> str:
    i = d["index"]
    if d["real"] is None or d["simulated"] is None:
        side = "real run" if d["simulated"] is None else "simulation"
        return f"step {i}: the {side} ran more steps (the earlier steps all match)"
    rq, sq = d["real_queues"], d["simulated_queues"]
    near = d["nearest_arrival"]
    where = ""
    if near is not None:
        where = (
            f"; request {near['id']} arrives {near['from_simulated_clock_s'] * 1000:+.1f} ms from "
            f"the simulated step's start"
        )
    if rq != sq:
        return (
            f"step {i}: the queues before it differ (waiting, running, swapped: real {rq}, "
            f"simulated {sq}): the two sides saw different requests arrived{where}"
        )
    return (
        f"step {i}: same queues ({rq}) but another schedule: the engine state differs "
        f"(an earlier arrival seen at another step, or nondeterministic scheduling){where}"
    )


def oracle_replay(
    engine_configs: tuple,
    records: Sequence[StepRecord],
    vocab_size: int,
    requests: list[BenchRequest],
    fallback: CostModel | None = None,
) -> tuple[ReplayResult, MeasuredStepCost, dict]:
    """Replay ``requests`` on a simulated engine with ``engine_configs`` (the real run's
    resolved ``(model_config, cache_config, scheduler_config)``), each step charged its
    recorded time (``MeasuredStepCost``). Returns ``(result, cost, comparison)``: the
    replay's result (with its own step records), the cost stand-in (its counters) and
    ``compare_step_sequences`` of the real and simulated steps."""
    cost = MeasuredStepCost(records, fallback=fallback)
    engine, clock = simulated_engine(engine_configs, cost, vocab_size)
    cost.clock = clock
    res = replay(engine, requests, clock, clock.set, record_steps=True, timer=clock)
    arrivals = {r.id: r.arrival_s for r in requests}
    return res, cost, compare_step_sequences(records, res.steps, arrivals)
