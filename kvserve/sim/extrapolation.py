"""How much of a simulation ran on extrapolated step costs, and the warning that says so.

A profile (``kvserve profile``) measures steps up to some size (``CostModel.ranges``); a
simulated step past those sizes (``CostModel.outside_range``) is priced by extrapolation,
bounded (``CostModel.attention_pairs``) but still a guess. ``extrapolation_report`` sums those
steps from a ``SimulatedExecutor``; ``warning_block`` is the text ``kvserve simulate`` prints
above and below its figures; past ``TRUST_SHARE`` of the simulated time the figures are called
untrustworthy (and ``--refuse-extrapolation`` makes that an error).
"""

from __future__ import annotations

from kvserve.sim.cost_model import CostModel

#: Past this share of the simulated busy time spent in extrapolated steps, a simulation's
#: figures are not trustworthy: a cost model's error outside its range is unknown; at 5% of
#: the time even a 2x error there moves the summed time (every latency's clock) by only 5%.
TRUST_SHARE = 0.05

#: How each ranged count is named in the warning.
_NAMES = {
    "prefill_tokens": "prompt tokens per step",
    "prefill_attn_pairs": "prompt attention pairs per step",
    "decode_seqs": "decodes per step",
    "context_tokens": "decode context tokens per step",
}


def extrapolation_report(cost_model: CostModel, executor) -> dict:
    """The extrapolated share of a finished simulation.

    Args:
        cost_model: the simulation's cost model (its ``ranges``).
        executor: the ``SimulatedExecutor`` that ran it (``num_steps``, ``busy_time_s``,
            ``num_extrapolated_steps``, ``extrapolated_time_s``, ``largest``).

    Returns:
        ``{"steps", "of_steps", "time_s", "busy_time_s", "share"`` (of the busy time, 0..1),
        ``"past"``: ``[{"count", "largest", "profiled"}]`` for each count past its profiled
        maximum (attention pairs in pairs, not thousands), ``"threshold"``: ``TRUST_SHARE``,
        ``"trustworthy"``: share <= threshold``}``.
    """
    busy = float(executor.busy_time_s)
    time_s = float(executor.extrapolated_time_s)
    share = time_s / busy if busy > 0 else 0.0
    past = []
    for attr, seen, top in cost_model.past_range(executor.largest):
        scale = 1000 if attr == "prefill_attn_pairs" else 1  # StepShape counts it in thousands
        past.append({"count": attr, "largest": seen * scale, "profiled": top * scale})
    return {
        "steps": int(executor.num_extrapolated_steps),
        "of_steps": int(executor.num_steps),
        "time_s": time_s,
        "busy_time_s": busy,
        "share": share,
        "past": past,
        "threshold": TRUST_SHARE,
        "trustworthy": share <= TRUST_SHARE,
    }


def warning_block(rep: dict) -> str:
    """The multi-line WARNING ``kvserve simulate`` prints at the top and the bottom of its
    summary when ``rep`` (``extrapolation_report``) has extrapolated steps; "" when none."""
    if not rep["steps"]:
        return ""
    bar = "=" * 100
    lines = [
        bar,
        f"WARNING: EXTRAPOLATED FIGURES: {rep['steps']:,} of {rep['of_steps']:,} steps "
        f"({rep['share']:.1%} of the simulated busy time, {rep['time_s']:,.1f} of {rep['busy_time_s']:,.1f} s) "
        "were larger than any step the cost model was profiled on; their costs are extrapolated:",
    ]
    for p in rep["past"]:
        lines.append(f"  {_NAMES[p['count']]} up to {p['largest']:,.0f}, profiled up to {p['profiled']:,.0f}")
    if rep["trustworthy"]:
        lines.append(
            f"That is within {rep['threshold']:.0%} of the time: the figures hold if the cost model "
            "holds near its range."
        )
    else:
        lines.append(
            f"These figures are NOT TRUSTWORTHY: more than {rep['threshold']:.0%} of the simulated time is "
            "extrapolated, and a cost model's error outside its profiled range is unknown."
        )
    lines.append(
        "Profile shapes that cover this workload (`kvserve profile` with the default grid, or larger "
        "--prefill-lens / --context-lens / --batch-sizes / --mixed-batch-sizes); "
        "--refuse-extrapolation makes this an error (exit 2)."
    )
    lines.append(bar)
    return "\n".join(lines)
