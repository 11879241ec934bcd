"""Failure scenarios of /work/shared/scenarios/README.md at the scheduler level, run on the
simulated executor (the engine-level/real-model halves live in tests/engine/test_scenarios_engine.py)."""

import pytest

from kvserve.core.block_manager import AllocStatus
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import SequenceStatus
from tests.core.simutil import Harness, configs, make_group, prompt_of


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------- B01
def test_B01_prompt_over_prompt_limit_ignored_first_step_not_blocking():
    cc, sc = configs(BS=4, G=64, C=0, S=4, T=32, L=64, CP=False, PC=False, PM="recompute")
    h = Harness(cc, sc)
    assert h.scheduler.prompt_limit == 32
    h.add("R1", prompt_of(1, 40), SamplingParams(max_tokens=4, temperature=0))
    h.add("R2", prompt_of(2, 8), SamplingParams(max_tokens=4, temperature=0))
    outs = h.step()
    first = h.history[0]
    assert [g.request_id for g in first.ignored_seq_groups] == ["R1"]
    r1 = first.ignored_seq_groups[0]
    assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in r1.get_seqs())
    assert "40" in r1.ignored_reason and "32" in r1.ignored_reason
    assert [s.seq_group.request_id for s in first.scheduled_seq_groups] == ["R2"]
    assert not h.scheduler.block_manager.has_blocks(r1.get_seqs()[0])
    r1_out = [o for o in outs if o.request_id == "R1"][0]
    assert r1_out.finished and r1_out.outputs[0].finish_reason == "ignored"
    assert "40" in r1_out.error and "32" in r1_out.error
    h.run()
    assert len(h.tokens("R2")[0]) == 4
    assert not h.scheduler.waiting
    h.assert_idle()
    assert h.num_final == {"R1": 1, "R2": 1}


def test_B01_variant_a_chunked_prefill_runs_40_token_prompt_in_chunks():
    cc, sc = configs(BS=4, G=64, C=0, S=4, T=32, L=64, CP=True, PC=False, PM="recompute")
    h = Harness(cc, sc)
    assert h.scheduler.prompt_limit == 64
    h.add("R1", prompt_of(1, 40), greedy(4))
    h.add("R2", prompt_of(2, 8), greedy(4))
    h.run()
    r1_prefill = [
        ssg.token_chunk_size
        for out in h.history[:2]
        for ssg in out.scheduled_seq_groups
        if ssg.seq_group.request_id == "R1"
    ]
    assert r1_prefill == [32, 8], r1_prefill
    assert len(h.tokens("R1")[0]) == 4 and len(h.tokens("R2")[0]) == 4
    assert not h.history[0].ignored_seq_groups
    h.assert_idle()


def test_B01_variant_b_prompt_over_max_model_len_rejected_with_L():
    cc, sc = configs(BS=4, G=64, C=0, S=4, T=32, L=64, CP=True, PM="recompute")
    sched = Scheduler(sc, cc)
    r1 = make_group("R1", prompt_of(1, 70), max_tokens=4)
    r2 = make_group("R2", prompt_of(2, 8), max_tokens=4)
    sched.add_seq_group(r1)
    sched.add_seq_group(r2)
    _, out = sched.schedule()
    assert out.ignored_seq_groups == [r1]
    assert "70" in r1.ignored_reason and "64" in r1.ignored_reason and "max_model_len" in r1.ignored_reason
    assert [s.seq_group for s in out.scheduled_seq_groups] == [r2]
    # The engine refuses it before queueing (validation names the limit).
    h = Harness(cc, sc)
    with pytest.raises(ValueError, match="64"):
        h.add("R1", prompt_of(1, 70), greedy(4))
    assert not h.scheduler.has_unfinished_seqs()


# ---------------------------------------------------------------------------------- B03
def test_B03_prompt_bigger_than_pool_is_never_and_does_not_block():
    cc, sc = configs(BS=4, G=8, C=16, S=4, T=64, L=64, CP=False, PC=False, PM="recompute", WM=0.0)
    sched = Scheduler(sc, cc)
    r1 = make_group("R1", prompt_of(1, 33), max_tokens=2)
    assert sched.block_manager.can_allocate(r1) == AllocStatus.NEVER
    h = Harness(cc, sc)
    h.add("R1", prompt_of(1, 33), greedy(2))
    h.add("R2", prompt_of(2, 4), greedy(2))
    steps = h.run(max_steps=10)
    first = h.history[0]
    assert [g.request_id for g in first.ignored_seq_groups] == ["R1"]
    reason = first.ignored_seq_groups[0].ignored_reason
    assert "9" in reason and "8" in reason, reason
    assert h.outputs["R1"].outputs[0].finish_reason == "ignored"
    assert len(h.tokens("R2")[0]) == 2 and steps <= 4
    h.assert_idle()


def test_B03_boundary_prompt_of_exactly_the_pool_runs():
    cc, sc = configs(BS=4, G=8, C=16, S=4, T=64, L=64, CP=False, PC=False, PM="recompute", WM=0.0)
    h = Harness(cc, sc)
    assert h.scheduler.block_manager.can_allocate(make_group("x", prompt_of(3, 32))) == AllocStatus.OK
    h.add("R3", prompt_of(3, 32), greedy(1))
    h.run(max_steps=5)
    assert h.tokens("R3") == [h.tokens("R3")[0]] and len(h.tokens("R3")[0]) == 1
    assert h.outputs["R3"].outputs[0].finish_reason == "length"
    h.assert_idle()


def test_B03_sequence_outgrowing_the_pool_ends_instead_of_thrashing():
    # Same kind of fault for a *running* sequence: 32-token prompt fills the 8 blocks; its
    # second token needs a 9th. It must end with a reason, not loop preempting itself.
    cc, sc = configs(BS=4, G=8, C=16, S=4, T=64, L=64, PM="recompute", WM=0.0)
    h = Harness(cc, sc)
    h.add("R", prompt_of(3, 32), greedy(5))
    h.add("R2", prompt_of(4, 4), greedy(2))
    h.run(max_steps=30)
    assert h.outputs["R"].finished and "8" in (h.outputs["R"].error or "")
    assert len(h.tokens("R2")[0]) == 2
    h.assert_idle()


# ---------------------------------------------------------------------------------- B08
def _b08(PM=None, stop_for_r1=None):
    cc, sc = configs(BS=4, G=12, C=32, S=8, T=64, L=64, CP=False, PC=False, PM=PM)
    h = Harness(cc, sc)
    for i in range(1, 5):
        kw = {}
        if i == 1 and stop_for_r1 is not None:
            kw["stop_token_ids"] = [stop_for_r1]
        h.add(
            f"R{i}",
            prompt_of(i, 8),
            SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True, **kw),
        )
    waiting_multi = []

    def on_step(h, _):
        for g in h.scheduler.waiting:
            if g.num_unfinished_seqs() > 1:
                waiting_multi.append(g.request_id)

    h.run(max_steps=500, on_step=on_step)
    return h, waiting_multi


def test_B08_multi_seq_groups_preempted_by_swap_only():
    h, waiting_multi = _b08()
    stats = h.scheduler.get_kv_cache_stats()
    assert stats["num_swap_preemptions"] >= 1, stats
    assert not waiting_multi
    for i in range(1, 5):
        toks = h.tokens(f"R{i}")
        assert len(toks) == 2 and all(len(t) == 16 for t in toks)
    h.assert_idle()
    assert h.scheduler.block_manager.get_num_free_gpu_blocks() == 12
    assert h.scheduler.block_manager.get_num_free_cpu_blocks() == 32


def test_B08_outputs_equal_no_pressure_run_in_every_mode():
    base_cc, base_sc = configs(BS=4, G=200, C=32, S=8, T=64, L=64)
    base = Harness(base_cc, base_sc)
    for i in range(1, 5):
        base.add(
            f"R{i}",
            prompt_of(i, 8),
            SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True),
        )
    base.run()
    for pm in (None, "swap", "recompute"):
        h, waiting_multi = _b08(PM=pm)
        for i in range(1, 5):
            assert h.tokens(f"R{i}") == base.tokens(f"R{i}"), pm
        if pm is None:
            assert not waiting_multi
        h.assert_idle()


def test_B08_variant_finished_sibling_is_left_alone():
    # Pick R1's stop token so one of its two samples stops within 3 tokens.
    h0, _ = _b08()
    s0, s1 = h0.tokens("R1")
    stop = next(t for t in s0[:3] if t not in s1)
    h, waiting_multi = _b08(stop_for_r1=stop)
    r1 = h.outputs["R1"].outputs
    assert len(r1) == 2
    lens = sorted(len(c.token_ids) for c in r1)
    assert lens[0] <= 3 and lens[1] == 16
    assert sorted(c.finish_reason for c in r1) == ["length", "stop"]
    assert not waiting_multi
    h.assert_idle()


def test_B08_variant_recompute_readmission_skips_finished_sibling():
    # Scheduler level: a forked group with one finished and one live seq is recomputed; on
    # re-admission only the live seq is prefilled and counted in the budget.
    cc, sc = configs(BS=4, G=64, C=0, S=8, T=64, L=64, PM="recompute")
    sched = Scheduler(sc, cc)
    g = make_group("R1", prompt_of(1, 8), n=2, max_tokens=16)
    sched.add_seq_group(g)
    metas, out = sched.schedule()
    sched.mark_computed(out)
    parent = g.get_seqs()[0]
    child = parent.fork(10_000_001)
    g.add(child)
    sched.fork_seq(parent, child)
    g.forked = True
    parent.append_token_id(5)
    child.append_token_id(6)
    child.status = SequenceStatus.FINISHED_STOPPED
    sched.free_seq(child)
    # Preempt by recompute.
    from kvserve.core.scheduler import _Step

    sched.running.remove(g)
    sched._preempt(g, _Step(0.0))
    sched.waiting.appendleft(g)
    assert parent.status == SequenceStatus.WAITING and child.status == SequenceStatus.FINISHED_STOPPED
    metas, out = sched.schedule()
    assert out.num_batched_tokens == 9  # the live seq's 8 prompt + 1 output token
    assert list(metas[0].seq_data) == [parent.seq_id]
    assert metas[0].num_samples == 1 and metas[0].is_prompt
    assert child.get_output_token_ids() == [6]  # text/tokens of the finished one kept


# ---------------------------------------------------------------------------------- B10
def _b10(CP, max_tokens):
    cc, sc = configs(BS=4, G=24, C=24, S=8, T=16, L=64, CP=CP, PC=False, PM=None)
    h = Harness(cc, sc)
    for i in range(12):
        h.add(f"R{i}", prompt_of(i, 12), SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=max_tokens))
    h.run(max_steps=3000)
    return h


@pytest.mark.parametrize("CP", [True, False])
def test_B10_no_admission_while_swapped(CP):
    # Feasible length: a group at 12 + 20 tokens needs 3 shared + 4*5 = 23 <= 24 blocks.
    h = _b10(CP, 20)
    assert h.admitted_while_swapped == 0
    assert h.scheduler.num_swap_preemptions >= 1
    for i in range(12):
        toks = h.tokens(f"R{i}")
        assert len(toks) == 4 and all(len(t) == 20 for t in toks)
    h.assert_idle()


@pytest.mark.parametrize("CP", [True, False])
def test_B10_exact_config_max_tokens_24_ends_cleanly(CP):
    # README config verbatim. With the simulator no sample ever hits EOS, and one n=4 group at
    # 12 + 23 tokens needs 3 + 4*6 = 27 > 24 blocks, so it cannot finish all 24 tokens even
    # alone: it must end (with a reason naming the cache size), never hang, crash or leak.
    h = _b10(CP, 24)
    assert h.admitted_while_swapped == 0
    for i in range(12):
        out = h.outputs[f"R{i}"]
        assert out.finished and len(out.outputs) == 4
        if out.error:
            assert "24" in out.error
        else:
            assert all(len(c.token_ids) == 24 for c in out.outputs)
    h.assert_idle()


# ---------------------------------------------------------------------------------- B11
@pytest.mark.parametrize("CP", [False, True])
def test_B11_recompute_keeps_outputs_as_outputs(CP):
    def run(G):
        cc, sc = configs(BS=4, G=G, C=0, S=4, T=64, L=64, CP=CP, PC=False, PM="recompute")
        h = Harness(cc, sc)
        for i in range(1, 4):
            kw = {"repetition_penalty": 1.3} if i == 2 else {}
            h.add(f"R{i}", prompt_of(i, 8), greedy(16, **kw))
        h.run()
        return h

    alone = {}
    for i in range(1, 4):
        cc, sc = configs(BS=4, G=64, C=0, S=4, T=64, L=64, CP=CP, PM="recompute")
        h1 = Harness(cc, sc)
        h1.add(f"R{i}", prompt_of(i, 8), greedy(16))
        h1.run()
        alone[f"R{i}"] = h1.tokens(f"R{i}")
    h = run(10)
    assert h.scheduler.num_preemptions >= 1
    for rid, toks in alone.items():
        assert h.tokens(rid) == toks
        assert len(toks[0]) == 16
        assert list(h.outputs[rid].prompt_token_ids) == prompt_of(int(rid[1]), 8)
    h.assert_idle()


# ---------------------------------------------------------------------------------- B13
@pytest.mark.parametrize("CP", [False, True])
def test_B13_block_aligned_full_hit_computes_one_token(CP):
    cc, sc = configs(BS=4, G=32, C=0, S=4, T=64, L=64, CP=CP, PC=True)
    h = Harness(cc, sc)
    p = prompt_of(1, 8)
    h.add("A", p, greedy(4))
    h.run()
    n_hist = len(h.history)
    h.add("B", p, greedy(4))
    h.run()
    b_first = h.history[n_hist]
    assert [s.token_chunk_size for s in b_first.scheduled_seq_groups] == [1]
    assert b_first.num_batched_tokens == 1
    assert b_first.blocks_to_copy, "the shared last block must be copied, not written in place"
    assert h.tokens("B") == h.tokens("A")
    stats = h.scheduler.get_kv_cache_stats()
    assert stats["prefix_cache_hits"] == 7
    h.assert_idle()
    assert all(b.ref_count == 0 for b in h.scheduler.block_manager.gpu.blocks)


@pytest.mark.parametrize("CP", [False, True])
def test_B13_variant_same_prompt_while_first_decodes(CP):
    p = prompt_of(2, 12)
    solo_cc, solo_sc = configs(BS=4, G=32, S=4, T=64, L=64, CP=CP, PC=False)
    solo = Harness(solo_cc, solo_sc)
    solo.add("A", p, greedy(4))
    solo.run()
    cc, sc = configs(BS=4, G=32, C=0, S=4, T=64, L=64, CP=CP, PC=True)
    h = Harness(cc, sc)
    h.add("A", p, greedy(4))
    h.step()
    h.step()  # A has decoded; its 3 prompt blocks are cached
    h.add("B", p, greedy(4))
    h.run()
    chunks = [
        s.token_chunk_size
        for out in h.history
        for s in out.scheduled_seq_groups
        if s.seq_group.request_id == "B" and s.token_chunk_size > 0
    ]
    assert chunks[0] == 1
    assert h.tokens("A") == solo.tokens("A") and h.tokens("B") == solo.tokens("A")
    for out in h.history:
        for s in out.scheduled_seq_groups:
            assert s.token_chunk_size >= 1
    h.assert_idle()


# ---------------------------------------------------------------------------------- B18
@pytest.mark.parametrize("where", ["running", "swapped", "waiting"])
def test_B18_abort_n2_request_everywhere(where):
    cc, sc = configs(BS=4, G=32, C=16, S=8, T=64, L=64, PC=False, PM=None)
    h = Harness(cc, sc)
    params = SamplingParams(
        n=2, temperature=0.3, seed=1, ignore_eos=True, max_tokens=58
    )  # README: 200; the engine caps prompt + max_tokens at L=64
    if where == "swapped":
        # Two long n=2 requests first so R gets swapped out.
        for i in (1, 2):
            h.add(
                f"O{i}",
                prompt_of(10 + i, 6),
                SamplingParams(n=2, temperature=0.3, seed=i, ignore_eos=True, max_tokens=40),
            )
    h.add("R", prompt_of(1, 6), params)
    if where == "waiting":
        h.engine.abort_request("R")
    elif where == "running":
        for _ in range(3):
            h.step()
        assert any(g.request_id == "R" for g in h.scheduler.running)
        h.engine.abort_request("R")
    else:
        for _ in range(200):
            h.step()
            if any(g.request_id == "R" for g in h.scheduler.swapped):
                break
        assert any(g.request_id == "R" for g in h.scheduler.swapped), "R never got swapped out"
        h.engine.abort_request("R")
    n_before = len(h.history)
    h.run()
    for out in h.history[n_before:]:
        assert all(s.seq_group.request_id != "R" for s in out.scheduled_seq_groups)
    assert h.num_final["R"] == 1
    final = h.outputs["R"]
    assert final.finished and all(c.finish_reason == "abort" for c in final.outputs)
    h.assert_idle()
    assert h.scheduler.block_manager.get_num_free_gpu_blocks() == 32
    assert h.scheduler.block_manager.get_num_free_cpu_blocks() == 16
