"""Per-step records of a replay (``kvserve.sim.step_record``) and the predicted-vs-measured report."""

import dataclasses
import json

import pytest

from kvserve.sim.cost_model import CostModel
from kvserve.sim.replay import sim_replay, summarize_replay
from kvserve.sim.step_record import StepRecord, compare_steps, load_steps, save_steps, size_bin
from kvserve.sim.step_shape import StepShape

from .test_replay import _burst, _configs


def _rec(prefill=0, decodes=0, ctx=0, step=1.0, exec_s=0.8, loop=1.1, gc=0.0, waiting=0):
    shape = StepShape(
        prefill_tokens=prefill,
        prefill_seqs=1 if prefill else 0,
        decode_seqs=decodes,
        context_tokens=ctx,
        sampled_rows=decodes + (1 if prefill else 0),
    )
    return StepRecord(shape, step, exec_s, loop, gc, num_waiting=waiting)


def test_step_records_round_trip_through_the_file(tmp_path):
    recs = [_rec(prefill=512, decodes=3, ctx=300, waiting=7), _rec(decodes=40, ctx=9000, gc=0.01)]
    p = tmp_path / "steps.json"
    save_steps(p, recs, {"trace": {"path": "t.csv"}})
    back, meta = load_steps(p)
    assert back == recs and meta == {"trace": {"path": "t.csv"}}
    assert back[0].shape.prefill_tokens == 512 and back[0].num_waiting == 7


def test_load_steps_refuses_other_files_naming_what_is_wrong(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "nope"}))
    with pytest.raises(ValueError, match="not a step-record file"):
        load_steps(p)
    p.write_text(json.dumps({"schema": "kvserve-steps", "schema_version": 1, "steps": [{"step_s": 1.0}]}))
    with pytest.raises(ValueError, match="missing field 'shape'"):
        load_steps(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_steps(tmp_path / "absent.json")


def test_compare_steps_arithmetic_on_a_synthetic_record():
    cm = CostModel(base_s=0.1, prefill_token_s=0.001, decode_seq_s=0.01, context_token_s=0.0, info={})
    cm.swap_block_s = cm.lora_adapter_s = 0.0
    # predictions: 0.1 + 0.512 = 0.612; 0.1 + 0.02 + 0.512 = 0.632; 0.1 + 0.4 = 0.5
    recs = [
        _rec(prefill=512, step=0.612, exec_s=0.5, loop=0.7),
        _rec(prefill=512, decodes=2, step=0.79, exec_s=0.6, loop=0.8, gc=0.05),
        _rec(decodes=40, step=0.4, exec_s=0.3, loop=0.5),
    ]
    rep = compare_steps(recs, cm)
    a = rep["all"]
    assert a["n"] == 3
    assert a["predicted_s"] == pytest.approx(0.612 + 0.632 + 0.5)
    assert a["step_s"] == pytest.approx(1.802) and a["loop_s"] == pytest.approx(2.0)
    assert a["err_vs_step"] == pytest.approx((1.744 - 1.802) / 1.802)
    assert a["err_vs_loop"] == pytest.approx((1.744 - 2.0) / 2.0)
    assert a["outside_exec_s"] == pytest.approx(1.802 - 1.4) and a["outside_step_s"] == pytest.approx(0.198)
    assert a["gc_s"] == pytest.approx(0.05)
    assert set(rep["by_class"]) == {"prefill", "mixed", "decode"}
    m = rep["by_class"]["mixed"]
    assert m["n"] == 1 and m["ratio_p50"] == pytest.approx(0.79 / 0.632)
    assert rep["by_class"]["prefill"]["err_vs_step"] == pytest.approx(0.0, abs=1e-12)
    assert rep["by_class"]["decode"]["err_vs_step"] == pytest.approx(0.25)
    assert set(rep["by_size"]) == {"<=64", "<=1024"}
    assert rep["by_size"]["<=1024"]["n"] == 2
    assert rep["by_class_size"]["mixed <=1024"]["n"] == 1
    assert rep["extrapolated"]["n"] == 0  # no ranges: nothing flagged
    cm.ranges = {"decode_seqs": 10}
    assert compare_steps(recs, cm)["extrapolated"]["n"] == 1


def test_size_bins():
    assert size_bin(StepShape(prefill_tokens=2000, decode_seqs=48)) == "<=2048"
    assert size_bin(StepShape(decode_seqs=5)) == "<=64"
    assert size_bin(StepShape(prefill_tokens=5000)) == ">4096"


def test_simulated_replay_records_every_step_at_its_cost():
    """On the virtual clock a step's recorded time is the cost model's time of its shape, and the
    loop adds nothing: the records add up to the run (no idle gaps in a burst)."""
    cm = CostModel()
    res = sim_replay(_configs(64), cm, 1000, _burst(5, output_len=6), record_steps=True)
    s = summarize_replay(res)
    assert len(res.steps) == s["num_steps"] > 5
    for r in res.steps:
        assert r.step_s == pytest.approx(cm.step_cost(r.shape)) and r.exec_s == pytest.approx(r.step_s)
        assert r.loop_s == pytest.approx(r.step_s) and r.gc_s == 0.0
    assert sum(r.loop_s for r in res.steps) == pytest.approx(res.duration_s)
    assert res.steps[0].num_waiting == 5 and res.steps[0].shape.prefill_seqs == 5
    rep = compare_steps(res.steps, cm)
    assert rep["all"]["err_vs_step"] == pytest.approx(0.0, abs=1e-9)


def test_replay_without_record_keeps_no_steps_and_puts_the_executor_back():
    from kvserve.sim.replay import replay, simulated_engine

    engine, clock = simulated_engine(_configs(64), CostModel(), 1000)
    inner = engine.executor
    res = replay(engine, _burst(2, output_len=3), clock, clock.set)
    assert res.steps == [] and engine.executor is inner
    res = replay(engine, _burst(2, output_len=3, first_id=10), clock, clock.set, record_steps=True)
    assert res.steps and engine.executor is inner


def _profile_on_simulator(grid, blocks=1456):
    """The profiler's scenarios on a simulated engine with the default engine's configs (the
    virtual clock stands in for the wall clock): which shapes a grid measures, in seconds."""
    from kvserve.config import EngineArgs
    from kvserve.sim.profile import Profiler
    from kvserve.sim.replay import simulated_engine

    configs = EngineArgs(num_gpu_blocks=blocks, num_cpu_blocks=728, device="cpu").create_configs(8192)
    engine, clock = simulated_engine(configs, CostModel(), 49152)
    prof = Profiler(engine, grid, progress=False)
    prof.timer = clock
    prof.warm_up()
    for kind, arg in prof.scenarios():
        if kind != "swap":
            prof.run_scenario(kind, arg)
    return prof


def test_default_grid_measures_the_steps_a_loaded_default_replay_runs():
    """Regression: the default grid's largest decode batch (48 decodes, 15,425 KV positions) and
    mixed steps (at most 512 prompt tokens beside 16 decodes) were below the steps a loaded
    default replay spends most of its time in (a ~2,000-token chunked step with 48-59 decodes
    over ~20,000-23,000 positions): 59 of 362 steps, half the simulated time, were extrapolated."""
    from kvserve.sim.profile import ProfileGrid

    prof = _profile_on_simulator(ProfileGrid(repeats=1))
    shapes = [s for s, _ in prof.samples]
    assert max(s.decode_seqs for s in shapes) >= 64
    assert 1.25 * max(s.context_tokens for s in shapes) >= 23_000
    full_mixed = [
        s for s in shapes if s.shape_class == "mixed" and s.decode_seqs >= 48 and s.prefill_tokens >= 1900
    ]
    assert full_mixed, "no full chunked-prefill step with many decodes riding along"
    assert all(s.prefill_tokens + s.decode_seqs <= prof.budget for s in shapes)
    cm = CostModel(
        ranges={
            k: max(getattr(s, k) for s in shapes)
            for k in ("prefill_tokens", "prefill_attn_pairs", "decode_seqs", "context_tokens")
        }
    )
    loaded = StepShape(
        prefill_tokens=2000, prefill_seqs=7, prefill_attn_pairs=431.0, decode_seqs=59, context_tokens=22_758
    )
    assert not cm.outside_range(loaded)


def test_decode_scenario_decodes_its_whole_batch_together():
    """Regression: decoders generated ``decode_steps + 1`` tokens, so with a chunked prefill of
    several steps the first ones finished before the last started and the batch of ``b`` was
    never measured decoding together."""
    from kvserve.sim.profile import ProfileGrid

    grid = ProfileGrid(
        prefill_lens=[16],
        prefill_batch=[1],
        long_prompt_chunks=0,
        context_lens=[256],
        batch_sizes=[64],
        decode_steps=4,
        decode_warm_steps=6,
        mixed_batch_sizes=[1],
        mixed_prefill_lens=[16],
        repeats=1,
    )
    first = {}
    for warm in (0, 6):
        prof = _profile_on_simulator(dataclasses.replace(grid, decode_warm_steps=warm))
        full = [s for s, _ in prof.samples if s.shape_class == "decode" and s.decode_seqs == 64]
        assert len(full) == 4  # decode_steps of them, all 64 decoding together
        assert all(s.context_tokens >= 64 * 256 for s in full)
        first[warm] = min(s.context_tokens for s in full)
    # the first 6 decode-only steps (64 positions each) are the unrecorded warm-in
    assert first[6] - first[0] == 6 * 64


def test_refit_of_replay_steps_recovers_the_cost_that_timed_them():
    """The refit names the cost the profile misses: steps timed by a known model whose
    per-decode cost is twice the profile's give back that per-decode cost."""
    from kvserve.sim.step_record import refit_steps

    profile = CostModel(base_s=0.02, prefill_token_s=1e-3, decode_seq_s=1e-3, context_token_s=3e-6, info={})
    truth = CostModel(base_s=0.02, prefill_token_s=1e-3, decode_seq_s=2e-3, context_token_s=3e-6, info={})
    recs = []
    for i in range(60):
        p, d, c = (i * 37) % 2000 if i % 3 else 0, 1 + (i * 13) % 60, 0
        c = d * (100 + (i * 53) % 400)
        shape = StepShape(prefill_tokens=p, prefill_seqs=1 if p else 0, decode_seqs=d, context_tokens=c)
        t = truth.step_cost(shape)
        recs.append(StepRecord(shape, t, t, t))
    out = refit_steps(recs, profile)
    assert out is not None and out["profile"]["decode_seq_s"] == pytest.approx(1e-3)
    assert out["replay"]["decode_seq_s"] == pytest.approx(2e-3, rel=0.02)
    assert out["replay"]["prefill_token_s"] == pytest.approx(1e-3, rel=0.02)
    assert out["fit_error"]["all"]["max"] < 0.01
    assert refit_steps(recs[:5], profile) is None
