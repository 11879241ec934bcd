"""The oracle replay: a recorded real run re-simulated with each step's measured time."""

import pytest

from kvserve.config import EngineArgs
from kvserve.sim.cost_model import CostModel
from kvserve.sim.oracle import MeasuredStepCost, compare_step_sequences, oracle_replay
from kvserve.sim.replay import sim_replay, summarize_replay, wall_replay
from kvserve.sim.step_record import StepRecord
from kvserve.sim.step_shape import StepShape
from kvserve.workload.workload import BenchRequest


def _bursts(num_bursts=3, per_burst=4, gap=0.6, output_len=16):
    """Bursts of requests arriving together, ``gap`` seconds apart (the tiny model drains a
    burst in tens of ms, so each burst meets an idle engine: which step an arrival joins is not
    a race between the two clocks)."""
    reqs = []
    for b in range(num_bursts):
        for j in range(per_burst):
            i = b * per_burst + j
            reqs.append(
                BenchRequest(
                    prompt_token_ids=[(11 * i + 3 * k) % 900 + 5 for k in range(40 + 8 * j)],
                    output_len=output_len,
                    arrival_s=b * gap,
                    id=i,
                )
            )
    return reqs


def test_oracle_replay_reproduces_a_real_run_on_the_tiny_model(tiny_llama_dir):
    """Same steps, same shapes, same order as the real engine (a small cache: preemptions
    included), and its latencies within 1% + 1 ms of the real ones: the simulation adds no
    error of its own once each step costs what it cost."""
    from kvserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_llama_dir), num_gpu_blocks=10, max_model_len=128, dtype="float32", device="cpu"
        )
    )
    reqs = _bursts()
    real = wall_replay(engine, reqs, record_steps=True)
    assert real.total_preemptions > 0  # the cache of 10 blocks cannot hold a burst of four
    assert all(r.start_s is not None for r in real.steps)
    configs = (engine.model_config, engine.cache_config, engine.scheduler_config)
    res, cost, cmp = oracle_replay(configs, real.steps, engine.vocab_size, reqs)
    assert cmp["num_diverged"] == 0, cmp["why"]
    assert cmp["real_steps"] == cmp["simulated_steps"] == len(real.steps) == cost.num_charged
    assert [s.shape for s in res.steps] == [s.shape for s in real.steps]
    assert cost.num_past_records == 0 and cost.anchored
    rs, os_ = summarize_replay(real), summarize_replay(res)
    assert os_["preempted_ids"] == rs["preempted_ids"] and os_["num_finished"] == rs["num_finished"] == 12
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for q in ("mean", "p50", "p90"):
            assert os_[key][q] == pytest.approx(rs[key][q], rel=0.01, abs=1e-3), (key, q)
    # every token lands within a millisecond of the real one
    for rid, times in real.token_times.items():
        assert res.token_times[rid] == pytest.approx(times, abs=1e-3), rid


def _rec(shape, t, start=None, waiting=0):
    return StepRecord(shape, t, t, t, num_waiting=waiting, start_s=start)


def test_measured_step_cost_charges_records_in_order_and_anchors_their_start():
    from kvserve.sim.cost_model import VirtualClock

    a, b = StepShape(prefill_tokens=8, prefill_seqs=1), StepShape(decode_seqs=1, context_tokens=9)
    clock = VirtualClock()
    cost = MeasuredStepCost([_rec(a, 0.5, 0.0), _rec(b, 0.25, 2.0)], clock, fallback=CostModel(base_s=7.0))
    assert cost.step_cost(StepShape()) == 0.0  # an empty step takes no record
    assert cost.step_cost(a) == 0.5
    clock.set(1.5)  # the real step started at 2.0: the 0.5 s the real loop spent first is charged
    assert cost.step_cost(b) == pytest.approx(0.75) and cost.resync_s == pytest.approx(0.5)
    assert cost.step_cost(b) == 7.0 + CostModel(base_s=0.0).step_cost(b)  # past the records
    assert (cost.num_charged, cost.num_past_records) == (2, 1)
    # durations only when the records have no start
    plain = MeasuredStepCost([_rec(a, 0.5), _rec(b, 0.25)], VirtualClock(3.0))
    assert not plain.anchored and plain.step_cost(a) == 0.5 and plain.step_cost(b) == 0.25


def test_step_comparison_names_the_first_divergence_and_its_arrival():
    a, b = StepShape(prefill_tokens=8, prefill_seqs=1), StepShape(prefill_tokens=16, prefill_seqs=2)
    real = [_rec(a, 0.1, 0.0, waiting=1), _rec(b, 0.1, 0.1, waiting=2)]
    sim = [_rec(a, 0.1, 0.0, waiting=1), _rec(a, 0.1, 0.1, waiting=1)]
    cmp = compare_step_sequences(real, sim, arrivals={0: 0.0, 1: 0.1004})
    assert cmp["num_diverged"] == 1 and cmp["first_diverged"] == 1
    assert cmp["diverged"][0]["real_queues"] == [2, 0, 0] and cmp["diverged"][0]["simulated_queues"] == [
        1,
        0,
        0,
    ]
    assert "different requests arrived" in cmp["why"] and "request 1 arrives +0.4 ms" in cmp["why"]
    same = compare_step_sequences(real, real)
    assert same["num_diverged"] == 0 and same["why"] is None
    longer = compare_step_sequences(real + [_rec(a, 0.1)], real)
    assert longer["first_diverged"] == 2 and "real run ran more steps" in longer["why"]


def test_oracle_of_a_simulated_run_is_that_run():
    """Records of a simulated run (the cost model's times) replayed by the oracle give back the
    same latencies exactly: the oracle adds nothing when the recording clock is the truth."""
    configs = EngineArgs(num_gpu_blocks=12, num_cpu_blocks=12, max_model_len=512).create_configs(512)
    reqs = _bursts(num_bursts=2, per_burst=6, gap=0.3, output_len=20)
    cm = CostModel(base_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, context_token_s=1e-6)
    first = sim_replay(configs, cm, 1000, reqs, record_steps=True)
    assert first.total_preemptions > 0
    res, _, cmp = oracle_replay(configs, first.steps, 1000, reqs)
    assert cmp["num_diverged"] == 0
    for rid, times in first.token_times.items():
        assert res.token_times[rid] == pytest.approx(times, abs=1e-9)
