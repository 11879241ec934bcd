"""The replay loop shared by the real and the simulated side of ``bench fidelity``."""

import pytest

from kvserve.config import EngineArgs
from kvserve.sim.cost_model import CostModel
from kvserve.sim.replay import replay, sim_replay, simulated_engine, summarize_replay
from kvserve.workload.workload import BenchRequest


def _configs(blocks):
    return EngineArgs(num_gpu_blocks=blocks, num_cpu_blocks=blocks, max_model_len=512).create_configs(512)


def _burst(n, start=0.0, gap=0.0, output_len=30, first_id=0):
    return [
        BenchRequest(
            prompt_token_ids=[(5 * i + j) % 700 + 3 for j in range(40)],
            output_len=output_len,
            arrival_s=start + gap * i,
            id=first_id + i,
        )
        for i in range(n)
    ]


def test_replay_times_tokens_and_counts_preempted_requests():
    res = sim_replay(_configs(12), CostModel(), 1000, _burst(6))
    s = summarize_replay(res)
    assert s["num_finished"] == 6 and s["num_preemptions"] > 0
    assert s["preempted_ids"] and set(s["preempted_ids"]) <= set(range(6))
    assert sum(res.preemptions.values()) == s["num_preemptions"]
    for rid in range(6):
        tt = res.token_times[rid]
        assert len(tt) == 30 and tt == sorted(tt) and tt[0] > 0
    assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["itl_s"]["n"] == 6 * 29


def test_preemptions_of_an_earlier_run_are_not_counted():
    """Regression: the engine's count is cumulative; a profiled engine had preempted before."""
    engine, clock = simulated_engine(_configs(12), CostModel(), 1000)
    first = replay(engine, _burst(6), clock, clock.set)
    assert first.total_preemptions > 0
    second = replay(engine, _burst(2, start=1.0, gap=5.0, output_len=4, first_id=100), clock, clock.set)
    assert second.total_preemptions == 0 and summarize_replay(second)["preempted_ids"] == []


def test_idle_gaps_are_waited_for_and_arrivals_count_from_the_trace():
    reqs = _burst(3, start=0.0, gap=10.0, output_len=3)
    res = sim_replay(_configs(64), CostModel(), 1000, reqs)
    s = summarize_replay(res)
    # each request arrives to an idle engine: no queueing, TTFT = its prefill step
    assert s["queue_s"]["max"] == pytest.approx(0.0, abs=1e-9)
    assert res.token_times[2][0] > 20.0 and res.duration_s == pytest.approx(res.token_times[2][-1])


def test_after_id_times_an_arrival_from_that_requests_first_token():
    first = _burst(1, output_len=20)
    # 0.5 s after request 0's first token; a second one chained on the first
    late = _burst(1, start=0.5, output_len=3, first_id=1)[0]
    late.after_id = 0
    chained = _burst(1, start=0.25, output_len=3, first_id=2)[0]
    chained.after_id = 1
    res = sim_replay(_configs(64), CostModel(), 1000, [*first, late, chained])
    assert res.arrival[1] == pytest.approx(res.token_times[0][0] + 0.5)
    assert res.arrival[2] == pytest.approx(res.token_times[1][0] + 0.25)
    assert res.token_times[1][0] > res.arrival[1] and res.token_times[2][0] > res.arrival[2]


def test_after_id_of_no_request_or_a_cycle_is_an_error():
    a, b = _burst(2, output_len=3)
    a.after_id = 7
    with pytest.raises(ValueError, match="after_id 7"):
        sim_replay(_configs(64), CostModel(), 1000, [a, b])
    a.after_id, b.after_id = 1, 0
    with pytest.raises(ValueError, match="after_id cycle"):
        sim_replay(_configs(64), CostModel(), 1000, [a, b])


def test_a_run_whose_last_arrivals_are_rejected_ends():
    """The engine is idle and the only requests left are refused as they arrive (a prompt over
    the context): the replay ends with them counted as rejected."""
    late = BenchRequest(prompt_token_ids=[7] * 600, output_len=4, arrival_s=1.0, id=9)
    res = sim_replay(_configs(64), CostModel(), 1000, [*_burst(1, output_len=3), late])
    assert res.rejected == 1 and res.outcome[9] == "rejected"
    assert len(res.token_times[0]) == 3
