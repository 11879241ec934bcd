"""Unit tests of the Scheduler (budget, limits, preemption, priority, chunking, lookahead)."""

import pytest

from kvserve.config import PreemptionMode
from kvserve.core.policy import FCFS, PolicyFactory, PriorityPolicy
from kvserve.core.scheduler import Scheduler, SchedulingBudget
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceStatus
from kvserve.sim.executor import SimulatedExecutor
from tests.core.simutil import Harness, configs, make_group, prompt_of


def sched_step(sched, ex=None):
    """One step driven by hand: schedule, run on the simulator, mark computed, append one
    token to every sampled sequence (no forking; n=1 groups only)."""
    metas, out = sched.schedule()
    if ex is not None and not out.is_empty():
        results = ex.execute_model(
            ExecuteModelRequest(metas, out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy)
        )
    else:
        results = [None] * len(metas)
    sched.mark_computed(out)
    for ssg, m, r in zip(out.scheduled_seq_groups, metas, results):
        if not m.do_sample:
            continue
        g = ssg.seq_group
        for s in g.get_seqs(SequenceStatus.RUNNING):
            s.append_token_id(r.samples[0].output_token if r else 1)
            if s.get_output_len() >= g.sampling_params.max_tokens:
                s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                sched.free_seq(s)
    sched.free_finished_seq_groups()
    sched.block_manager.check_invariants()
    return metas, out


def ids(out):
    return [s.seq_group.request_id for s in out.scheduled_seq_groups]


def test_budget_dedup_by_request_id():
    b = SchedulingBudget(token_budget=10, max_num_seqs=2)
    b.add_num_batched_tokens("a", 4)
    b.add_num_batched_tokens("a", 4)
    b.add_num_seqs("a", 1)
    b.add_num_seqs("a", 1)
    assert b.num_batched_tokens == 4 and b.num_curr_seqs == 1
    assert b.can_schedule(num_new_tokens=6, num_new_seqs=1)
    assert not b.can_schedule(num_new_tokens=7, num_new_seqs=1)
    assert not b.can_schedule(num_new_tokens=1, num_new_seqs=2)
    b.subtract_num_batched_tokens("a", 4)
    b.subtract_num_batched_tokens("a", 4)
    assert b.num_batched_tokens == 0 and b.remaining_token_budget() == 10
    with pytest.raises(ValueError):
        b.can_schedule(num_new_tokens=0, num_new_seqs=1)


def test_prompt_limit_matches_seed():
    _, sc = configs(T=32, L=64, CP=False)
    cc, _ = configs()
    assert Scheduler(sc, cc).prompt_limit == 32
    _, sc = configs(T=32, L=64, CP=True)
    assert Scheduler(sc, cc).prompt_limit == 64


def test_scheduler_requires_int_blocks():
    cc, sc = configs()
    cc.num_gpu_blocks = None
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(sc, cc)


def test_policies_and_registry():
    a = make_group("a", [1], arrival_time=1.0, priority=5)
    b = make_group("b", [1], arrival_time=2.0, priority=0)
    assert list(FCFS().sort_by_priority(10.0, [b, a])) == [a, b]
    assert list(PriorityPolicy().sort_by_priority(10.0, [a, b])) == [b, a]
    assert PolicyFactory.get_policy("priority").outranks(0, b, a)
    with pytest.raises(ValueError, match="fcfs"):
        PolicyFactory.get_policy("nope")


def test_default_path_prefills_then_decodes_and_budgets():
    cc, sc = configs(G=64, S=2, T=16)
    sched = Scheduler(sc, cc)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", prompt_of(i, 8), arrival_time=i))
    _, out = sched_step(sched)
    assert ids(out) == ["r0", "r1"] and out.num_batched_tokens == 16 and out.num_prefill_groups == 2
    _, out = sched_step(sched)
    # r2 cannot join: max_num_seqs=2 reserved by the running groups -> decode step.
    assert ids(out) == ["r0", "r1"] and out.num_prefill_groups == 0 and out.num_batched_tokens == 2
    assert [g.request_id for g in sched.waiting] == ["r2"]


def test_recompute_preemption_from_the_tail():
    cc, sc = configs(G=6, S=4, T=64, PM="recompute")
    sched = Scheduler(sc, cc)
    ex = SimulatedExecutor(1000, cache_config=cc)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", prompt_of(i, 8), max_tokens=8, arrival_time=i))
    _, out = sched_step(sched, ex)
    assert ids(out) == ["r0", "r1", "r2"]  # 6 blocks used
    _, out = sched_step(sched, ex)  # every decode needs a new block
    assert out.preempted >= 1
    assert sched.waiting[0].request_id == "r2"  # the latest arrival is preempted first
    g = sched.waiting[0]
    assert g.metrics.num_preemptions == 1 and sched.num_preemptions >= 1
    assert g.get_seqs()[0].data.get_num_computed_tokens() == 0
    assert g.get_seqs()[0].get_output_len() == 1  # outputs kept as outputs


def test_default_mode_swaps_multi_seq_groups_and_falls_back_without_cpu():
    for C, expect in ((32, PreemptionMode.SWAP), (0, PreemptionMode.RECOMPUTE)):
        cc, sc = configs(G=64, C=C, PM=None)
        sched = Scheduler(sc, cc)
        g = make_group("a", prompt_of(1, 8), n=2)
        sched.add_seq_group(g)
        sched_step(sched)
        p = g.get_seqs()[0]
        child = p.fork(123_456 + C)
        g.add(child)
        sched.fork_seq(p, child)
        g.forked = True
        from kvserve.core.scheduler import _Step

        st = _Step(0.0)
        sched.running.remove(g)
        assert sched._preempt(g, st) == expect
        if expect == PreemptionMode.SWAP:
            assert st.blocks_to_swap_out and all(s.status == SequenceStatus.SWAPPED for s in g.get_seqs())
        else:
            assert all(s.status == SequenceStatus.WAITING for s in g.get_seqs())
        sched.block_manager.check_invariants()


def test_swap_out_of_two_groups_sharing_a_cached_block_in_one_step():
    # Stateful-test find. Decoding R (n=2) needs 2 new blocks: it swaps out S, which shares
    # R's prefix-cached first block, then itself, in the same step. Each group used to get its
    # own CPU copy of the shared block, but the step's GPU->CPU map keeps one per GPU block:
    # S's copy was never written and S read garbage after swap-in (KVCacheCorruption).
    p = prompt_of(7, 16)
    tokens = {}
    for G in (6, 64):  # under pressure, and the no-pressure answer
        cc, sc = configs(BS=4, G=G, C=6, S=4, T=16, L=32, PC=True, PM="swap")
        h = Harness(cc, sc)
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        h.add("Q", prompt_of(1, 1), greedy)
        h.add("R", p, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=2, ignore_eos=True))
        h.add("S", p[:5], greedy)
        h.run()
        h.assert_idle()
        tokens[G] = {rid: h.tokens(rid) for rid in "QRS"}
        if G == 6:
            assert any(out.preempted == 2 and out.blocks_to_swap_out for out in h.history)
    assert tokens[6] == tokens[64]


@pytest.mark.parametrize("CP", [False, True])
def test_priority_preemption_both_paths(CP):
    cc, sc = configs(G=10, C=0, S=4, T=64, CP=CP, policy="priority", PM="recompute")
    h = Harness(cc, sc)
    h.add("low1", prompt_of(1, 16), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), priority=5)
    h.add("low2", prompt_of(2, 12), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), priority=5)
    h.step()
    h.step()
    assert {g.request_id for g in h.scheduler.running} == {"low1", "low2"}
    h.add("high", prompt_of(3, 8), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), priority=0)
    h.step()
    assert any(g.request_id == "high" for g in h.scheduler.running)
    assert h.scheduler.num_preemptions >= 1
    assert any(g.request_id.startswith("low") and g.metrics.num_preemptions for g in h.scheduler.waiting)
    h.run()
    assert h.finished_order[0] == "high"
    h.assert_idle()


def test_priority_does_not_preempt_equal_or_when_useless():
    cc, sc = configs(G=8, C=0, S=4, T=64, policy="priority", PM="recompute")
    h = Harness(cc, sc)
    h.add("a", prompt_of(1, 28), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=1)
    h.step()
    h.add("b", prompt_of(2, 8), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=1)
    h.step()
    assert h.scheduler.num_preemptions == 0  # equal priority never preempts
    h.run()
    h.assert_idle()


def test_chunked_order_decodes_first_and_partial_cap():
    cc, sc = configs(G=64, S=8, T=16, L=64, CP=True, max_num_partial_prefills=1)
    sched = Scheduler(sc, cc)
    ex = SimulatedExecutor(1000, cache_config=cc)
    sched.add_seq_group(make_group("d", prompt_of(0, 4), arrival_time=0, max_tokens=10))
    sched_step(sched, ex)  # d is decoding now
    sched.add_seq_group(make_group("long1", prompt_of(1, 40), arrival_time=1))
    sched.add_seq_group(make_group("long2", prompt_of(2, 40), arrival_time=2))
    sched.add_seq_group(make_group("short", prompt_of(3, 3), arrival_time=3))
    _, out = sched_step(sched, ex)
    assert ids(out)[-1] == "d" and out.num_prefill_groups == 1
    assert ids(out) == ["long1", "d"]  # long1 takes the 15 tokens left
    assert out.num_batched_tokens == 16
    _, out = sched_step(sched, ex)
    # long1 continues (running prefills before new ones); long2 would be a second partial
    # prefill, so it is skipped; nothing else fits.
    assert "long2" not in ids(out)
    while any(g.request_id == "long1" and g.is_prefill() for g in sched.running):
        _, out = sched_step(sched, ex)
    assert all(s.token_chunk_size >= 1 for s in out.scheduled_seq_groups)


def test_long_prefill_threshold_lets_short_prompt_in_and_tops_up():
    cc, sc = configs(
        G=64, S=8, T=32, L=64, CP=True, max_num_partial_prefills=2, long_prefill_token_threshold=8
    )
    sched = Scheduler(sc, cc)
    sched.add_seq_group(make_group("long", prompt_of(1, 60), arrival_time=0))
    sched.add_seq_group(make_group("short", prompt_of(2, 6), arrival_time=1))
    metas, out = sched_step(sched)
    sizes = {s.seq_group.request_id: s.token_chunk_size for s in out.scheduled_seq_groups}
    # long capped at 8, short admitted whole (6), then long topped up with the 18 left.
    assert sizes == {"long": 26, "short": 6} and out.num_batched_tokens == 32
    long_meta = [m for m in metas if m.request_id == "long"][0]
    assert not long_meta.do_sample


def test_lookahead_slots_reserved():
    cc, sc = configs(G=64, BS=4, lookahead=3)
    sched = Scheduler(sc, cc)
    g = make_group("a", prompt_of(1, 8))
    sched.add_seq_group(g)
    sched_step(sched)
    _, out = sched_step(sched)
    assert out.num_lookahead_slots == 3
    seq = g.get_seqs()[0]
    # len 10 after 2 tokens; decode wrote position 8 and reserved 3 more -> 12 slots = 3 blocks
    assert len(sched.block_manager.get_block_table(seq)) == 3


def test_abort_from_every_queue_frees_blocks():
    cc, sc = configs(G=64, C=8)
    sched = Scheduler(sc, cc)
    a, b = make_group("a", prompt_of(1, 8)), make_group("b", prompt_of(2, 8))
    sched.add_seq_group(a)
    sched_step(sched)
    sched.add_seq_group(b)
    aborted = sched.abort_seq_group(["a", "b", "zzz"])
    assert {g.request_id for g in aborted} == {"a", "b"}
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for g in aborted for s in g.get_seqs())
    assert not sched.has_unfinished_seqs()
    assert sched.block_manager.get_num_free_gpu_blocks() == 64
    stats = sched.get_kv_cache_stats()
    for k in (
        "num_gpu_blocks",
        "num_free_gpu_blocks",
        "num_cpu_blocks",
        "num_free_cpu_blocks",
        "gpu_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prefix_cache_hit_rate",
        "num_preemptions",
    ):
        assert k in stats


def test_anti_thrash_margin_blocks_readmission():
    cc, sc = configs(G=12, PM="recompute")
    sched = Scheduler(sc, cc)
    hog = make_group("hog", prompt_of(0, 24))
    sched.add_seq_group(hog)
    sched_step(sched)  # 6 of 12 blocks in use (+ running)
    g = make_group("g", prompt_of(1, 16))
    g.metrics.num_preemptions = 3  # a frequently preempted group
    sched.add_seq_group(g)
    _, out = sched_step(sched)
    # 4 blocks needed, 6 free -> would fit, but margin min(3, 4) * 1 = 3 > 6 - 4.
    assert "g" not in ids(out)
    g.metrics.num_preemptions = 1
    _, out = sched_step(sched)
    assert "g" in ids(out)


def test_schedule_metadata_fields():
    cc, sc = configs(G=64, PC=True)
    sched = Scheduler(sc, cc, clock=lambda: 42.0)
    g = make_group("a", prompt_of(1, 8), n=3)
    sched.add_seq_group(g)
    metas, out = sched.schedule()
    m = metas[0]
    assert m.is_prompt and m.num_samples == 3 and m.do_sample and m.token_chunk_size == 8
    assert list(m.block_tables.values())[0] == sched.block_manager.get_block_table(g.get_seqs()[0])
    assert m.computed_block_nums == []
    assert g.metrics.first_scheduled_time == 42.0
    assert not out.is_empty()


@pytest.mark.parametrize("CP", [False, True])
def test_sliding_window_engine_bounded_blocks_same_tokens(CP):
    def run(G):
        cc, sc = configs(BS=4, G=G, C=0, S=4, T=32, L=64, CP=CP, sliding_window=8)
        h = Harness(cc, sc)
        for i in range(3):
            h.add(f"r{i}", prompt_of(i, 10), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        peak = 0

        def on_step(h, _):
            nonlocal peak
            bm = h.scheduler.block_manager
            peak = max(peak, bm.gpu.get_num_in_use())

        h.run(on_step=on_step)
        h.assert_idle()
        return h, peak

    big, peak = run(64)
    # 3 sequences of up to 50 tokens would hold 13 blocks each without the window.
    assert peak <= 3 * (8 // 4 + 3)
    small, _ = run(12)
    for i in range(3):
        assert small.tokens(f"r{i}") == big.tokens(f"r{i}")


def test_blocks_freed_by_priority_preemption_go_to_the_outranking_group_not_a_lower_one():
    """Chunked prefill, policy priority: H (priority 1) preempts L (5) while the one
    partial-prefill slot is taken by P (0), so H is passed over this step. W (9), waiting
    for blocks since before H came, must not take the blocks freed for H (it used to: it was
    re-prefilled and preempted again a few steps later)."""
    cc, sc = configs(
        BS=4, G=14, S=8, T=20, L=64, CP=True, policy="priority", PM="recompute",
        max_num_partial_prefills=1, long_prefill_token_threshold=8,
    )  # fmt: skip
    h = Harness(cc, sc)
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    h.add("L", prompt_of(1, 12), sp(30), priority=5)
    h.step()
    h.step()
    h.add("P", prompt_of(2, 40), sp(4), priority=0)
    h.step()
    assert [g.request_id for g in h.scheduler.running] == ["L", "P"]
    assert h.scheduler.block_manager.get_num_free_gpu_blocks() == 0
    h.add("W", prompt_of(3, 8), sp(20), priority=9)
    h.add("H", prompt_of(4, 16), sp(4), priority=1)
    first: dict[str, int] = {}

    def on_step(h, k):
        for ssg in h.history[-1].scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, k)

    h.step()
    out = h.history[-1]
    assert out.preempted == 1 and h.engine._groups["L"].metrics.num_preemptions == 1
    assert "W" not in ids(out) and "W" not in {g.request_id for g in h.scheduler.running}
    h.run(on_step=on_step)
    assert first["H"] < first["W"]  # W runs only after the group the blocks were freed for
    h.assert_idle()


def test_running_groups_outranked_by_the_preempting_group_do_not_grow_into_its_blocks():
    """H (priority 1) preempts L (9) for its 4 blocks; M (6), also outranked by H, needs a new
    block for its decode in the same step. It used to take one of the freed blocks, leaving
    H to wait (and preempt again next step); now M yields and H runs this step."""
    cc, sc = configs(BS=4, G=9, S=8, T=32, L=64, CP=True, policy="priority", PM="recompute")
    h = Harness(cc, sc)
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    for rid, i, prio in (("A", 1, 0), ("M", 2, 6), ("L", 3, 9)):
        h.add(rid, prompt_of(i, 7), sp(30), priority=prio)
    h.step()
    h.step()
    bm = h.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 3
    assert all(g.get_seqs()[0].get_len() == 9 for g in h.scheduler.running)  # each needs a 3rd block
    h.add("H", prompt_of(4, 16), sp(4), priority=1)
    h.step()
    out = h.history[-1]
    assert ids(out) == ["H", "A"]
    assert {g.request_id for g in h.scheduler.waiting} == {"M", "L"}
    h.run()
    assert h.finished_order[0] == "H"
    h.assert_idle()


def test_delay_factor_holds_new_prompts_until_the_oldest_waited_a_factor_of_the_last_prompt_step():
    """vLLM V0's delay_factor on the simulator's virtual clock: while A decodes, B and C (one
    step apart) are held until the oldest has waited longer than delay_factor x the latency of
    the last prompt step, then admitted together in one step; 0.0 admits each at once."""

    def run(delay_factor):
        cc, sc = configs(G=64, S=8, T=64, L=64)
        sc.delay_factor = delay_factor
        h = Harness(cc, sc)
        s, clock = h.scheduler, h.executor.clock
        h.add("A", prompt_of(1, 16), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        h.step()  # A's prompt step
        h.step()
        latency = s.last_prompt_latency
        assert latency > 0
        admitted: dict[str, float] = {}
        arrival: dict[str, float] = {}
        starts: list[float] = []
        for k in range(30):
            if k in (0, 1):
                rid = "BC"[k]
                h.add(rid, prompt_of(2 + k, 8), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
                arrival[rid] = clock.now()
            starts.append(clock.now())
            h.step()
            for ssg in h.history[-1].scheduled_seq_groups:
                rid = ssg.seq_group.request_id
                if rid in arrival and rid not in admitted:
                    admitted[rid] = starts[-1]
            if len(admitted) == 2:
                break
        return admitted, arrival, starts, latency

    admitted, arrival, _, _ = run(0.0)
    assert admitted == arrival  # each in the step right after it arrived
    factor = 3.0
    admitted, arrival, starts, latency = run(factor)
    assert admitted["B"] == admitted["C"]  # batched into one prompt step
    k = starts.index(admitted["B"])
    assert k >= 2  # held for a few decode steps of A
    assert admitted["B"] - arrival["B"] > factor * latency
    assert starts[k - 1] - arrival["B"] <= factor * latency  # and not a step longer than that


def test_delay_factor_is_validated_and_wired_to_the_cli():
    from kvserve.config import EngineArgs, SchedulerConfig

    with pytest.raises(ValueError, match="delay_factor"):
        SchedulerConfig(delay_factor=-0.5)
    with pytest.raises(ValueError, match="delay_factor"):
        SchedulerConfig(delay_factor=float("nan"))
    assert SchedulerConfig().delay_factor == 0.0
    _, _, sc = EngineArgs(delay_factor=0.25, device="cpu").create_configs(128)
    assert sc.delay_factor == 0.25
    import argparse

    from kvserve.entrypoints.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--delay-factor", "0.5"])).delay_factor == 0.5
