"""Multi-LoRA in the scheduler: at most ``max_loras`` distinct adapters per step, groups over
the limit deferred in order (from ``waiting`` and from ``swapped``) and admitted once a slot
frees, and prefix-cache blocks never shared across adapters (vLLM V0's scheduler tests, plus
engine-level runs on the simulator and hypothesis properties)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import LoRAConfig, PreemptionMode
from kvserve.core.block_manager import BlockSpaceManager
from kvserve.core.scheduler import Scheduler, _Step
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import SequenceStatus
from kvserve.sim.executor import KVCacheCorruption, SimulatedExecutor
from tests.core.simutil import Harness, configs, lora, make_group, prompt_of
from tests.core.test_scheduler import ids, sched_step


def waiting_ids(sched):
    return [g.request_id for g in sched.waiting]


def loras_of(out):
    return {r.lora_int_id for r in out.lora_requests}


# ---------------------------------------------------------------- construction and metadata
def test_scheduler_takes_lora_config_positionally_as_the_seed():
    cc, sc = configs()
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=2))
    assert sched.lora_enabled and sched.lora_config.max_loras == 2
    assert not Scheduler(sc, cc).lora_enabled


def test_group_lora_int_id_reaches_its_sequences_forks_and_metadata():
    g = make_group("a", prompt_of(1, 8), lora_request=lora(3))
    assert g.lora_int_id == 3 and all(s.lora_int_id == 3 for s in g.get_seqs())
    assert make_group("b", prompt_of(1, 8)).lora_int_id == 0
    child = g.get_seqs()[0].fork(987_654)
    assert child.lora_int_id == 3
    cc, sc = configs()
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=2))
    sched.add_seq_group(g)
    sched.add_seq_group(make_group("b", prompt_of(2, 8)))
    metas, out = sched.schedule()
    assert [m.lora_request for m in metas] == [lora(3), None]
    assert [m.lora_int_id for m in metas] == [3, 0]
    assert out.lora_requests == {lora(3)} and out.num_loras == 1


def test_lora_stats_name_running_and_waiting_adapters():
    cc, sc = configs(G=64, S=8, T=64)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    for i, lid in enumerate([2, 1, 0, 2]):
        sched.add_seq_group(make_group(f"r{i}", prompt_of(i, 8), arrival_time=i, lora_request=lora(lid)))
    sched_step(sched)
    assert sched.get_lora_stats() == {
        "max_lora": 1,
        "running_lora_adapters": ["adapter2"],
        "waiting_lora_adapters": ["adapter1"],
    }
    assert Scheduler(sc, cc).get_lora_stats()["max_lora"] == 0


# ---------------------------------------------------------------- waiting: defer in order
@pytest.mark.parametrize("CP", [False, True])
def test_prefill_defers_groups_over_max_loras_without_reordering(CP):
    """max_loras=1: the first adapter's groups and the base-model groups are admitted; the
    other adapters' groups wait at the head of ``waiting`` in arrival order."""
    cc, sc = configs(G=64, S=8, T=64, CP=CP)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    spec = [("a1", 1), ("b1", 2), ("base1", 0), ("c1", 3), ("a2", 1), ("b2", 2), ("base2", 0)]
    for i, (rid, lid) in enumerate(spec):
        sched.add_seq_group(
            make_group(rid, prompt_of(i, 8), max_tokens=3, arrival_time=i, lora_request=lora(lid))
        )
    _, out = sched_step(sched)
    assert ids(out) == ["a1", "base1", "a2", "base2"]
    assert loras_of(out) == {1}
    assert waiting_ids(sched) == ["b1", "c1", "b2"]


@pytest.mark.parametrize("CP", [False, True])
def test_deferred_group_is_admitted_in_the_step_after_its_slot_frees(CP):
    cc, sc = configs(G=64, S=8, T=64, CP=CP)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    sched.add_seq_group(make_group("a", prompt_of(0, 8), max_tokens=3, arrival_time=0, lora_request=lora(1)))
    sched.add_seq_group(make_group("b", prompt_of(1, 8), max_tokens=2, arrival_time=1, lora_request=lora(2)))
    history = []
    for _ in range(12):
        _, out = sched_step(sched)
        history.append(ids(out))
        if not sched.has_unfinished_seqs():
            break
    # a: prefill + 2 decodes; b waits through all of them, then runs alone.
    assert history[:3] == [["a"], ["a"], ["a"]]
    assert history[3:] == [["b"], ["b"]]
    assert not sched.has_unfinished_seqs()


def test_two_slots_hold_two_adapters_and_base_groups_never_count():
    cc, sc = configs(G=64, S=8, T=128)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=2))
    for i, lid in enumerate([1, 2, 3, 0, 2, 1, 0, 3]):
        sched.add_seq_group(make_group(f"r{i}", prompt_of(i, 8), arrival_time=i, lora_request=lora(lid)))
    _, out = sched_step(sched)
    assert ids(out) == ["r0", "r1", "r3", "r4", "r5", "r6"]
    assert loras_of(out) == {1, 2}
    assert waiting_ids(sched) == ["r2", "r7"]


def test_without_lora_config_adapters_are_not_counted():
    cc, sc = configs(G=64, S=8, T=128)
    sched = Scheduler(sc, cc)
    for i in range(4):
        sched.add_seq_group(make_group(f"r{i}", prompt_of(i, 8), arrival_time=i, lora_request=lora(i + 1)))
    _, out = sched_step(sched)
    assert len(out.scheduled_seq_groups) == 4 and out.lora_requests == set()


def test_running_adapters_count_before_new_prompts_chunked():
    """Chunked prefill: a running group's adapter takes the slot before any new prompt."""
    cc, sc = configs(G=64, S=8, T=64, CP=True)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    sched.add_seq_group(make_group("run", prompt_of(0, 8), max_tokens=4, lora_request=lora(5)))
    sched_step(sched)
    sched.add_seq_group(make_group("new2", prompt_of(1, 8), arrival_time=1, lora_request=lora(2)))
    sched.add_seq_group(make_group("new5", prompt_of(2, 8), arrival_time=2, lora_request=lora(5)))
    _, out = sched_step(sched)
    assert set(ids(out)) == {"run", "new5"} and loras_of(out) == {5}
    assert waiting_ids(sched) == ["new2"]


# ---------------------------------------------------------------- swapped: defer in order
def _swap_out(sched, g):
    st = _Step(0.0)
    sched.running.remove(g)
    assert sched._preempt(g, st) == PreemptionMode.SWAP


@pytest.mark.parametrize("CP", [False, True])
def test_swapped_groups_over_max_loras_wait_in_order(CP):
    """Running ``a`` (adapter 1); swapped [b (2), d (1), c (3)]: ``d`` swaps in at once, ``b``
    and ``c`` stay swapped in their order, and each returns only once a slot is free."""
    cc, sc = configs(G=64, C=64, S=8, T=64, CP=CP, PM="swap")
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=4))  # all four adapters run at first
    spec = [("a", 1), ("b", 2), ("d", 1), ("c", 3)]
    groups = {}
    for i, (rid, lid) in enumerate(spec):
        groups[rid] = make_group(
            rid, prompt_of(i, 8), max_tokens=3 if rid != "a" else 2, arrival_time=i, lora_request=lora(lid)
        )
        sched.add_seq_group(groups[rid])
    sched_step(sched)  # every prompt is prefilled
    for rid in ("b", "d", "c"):
        _swap_out(sched, groups[rid])
    assert [g.request_id for g in sched.swapped] == ["b", "d", "c"]
    sched.lora_config = LoRAConfig(max_loras=1)  # now only one adapter per step
    _, out = sched_step(sched)
    assert set(ids(out)) == {"a", "d"} and loras_of(out) == {1}
    assert [g.request_id for g in sched.swapped] == ["b", "c"]
    assert out.blocks_to_swap_in  # d came back
    seen = [ids(out)]
    for _ in range(12):
        if not sched.has_unfinished_seqs():
            break
        _, out = sched_step(sched)
        assert len(loras_of(out)) <= 1
        seen.append(ids(out))
    assert not sched.has_unfinished_seqs()
    order = [rid for step in seen for rid in step]
    # b resumes before c (order kept), and neither while adapter 1 still runs.
    first = {rid: order.index(rid) for rid in "abcd"}
    last = {rid: len(order) - 1 - order[::-1].index(rid) for rid in "abcd"}
    assert last["a"] < first["b"] and last["d"] < first["b"] and last["b"] < first["c"]


# ---------------------------------------------------------------- starvation guard
def _stream_run(monkeypatch, limit):
    """max_loras=1; a new adapter-1 request every step for 120 steps; one adapter-2 request
    arrives at step 1. Returns (step b was first scheduled or None, the scheduler)."""
    from kvserve.core import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "LORA_MAX_DEFERRALS", limit)
    cc, sc = configs(G=256, S=8, T=64, CP=True)  # decodes and new prompts share every step
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    b_step = None
    for step in range(400):
        if step < 120:
            sched.add_seq_group(
                make_group(
                    f"a{step}", prompt_of(step, 4), max_tokens=3, arrival_time=step, lora_request=lora(1)
                )
            )
        if step == 1:
            sched.add_seq_group(
                make_group("b", prompt_of(999, 4), max_tokens=3, arrival_time=1.5, lora_request=lora(2))
            )
        _, out = sched_step(sched)
        assert len(loras_of(out)) <= 1
        if b_step is None and "b" in ids(out):
            b_step = step
        if step >= 120 and not sched.has_unfinished_seqs():
            break
    assert not sched.has_unfinished_seqs()
    return b_step, sched


def test_a_deferred_group_is_not_starved_by_a_stream_of_the_running_adapter(monkeypatch):
    from kvserve.core.scheduler import LORA_MAX_DEFERRALS

    b_step, sched = _stream_run(monkeypatch, LORA_MAX_DEFERRALS)
    # 121 requests went through; the add-order of ended ones is dropped as new ones come
    assert len(sched._lora_order) <= 2 * 8 + 64 + 1, len(sched._lora_order)
    # deferred LORA_MAX_DEFERRALS times (once per step), then the running adapter-1 groups
    # drain (at most 5 steps each)
    assert b_step is not None and b_step <= 1 + LORA_MAX_DEFERRALS + 1 + 5, b_step
    assert not sched._lora_deferrals
    # Without the guard (vLLM's rule alone) it waits for the whole stream to end.
    b_step_unguarded, _ = _stream_run(monkeypatch, 10**9)
    assert b_step_unguarded > 120


def test_starvation_guard_lets_groups_without_an_adapter_pass(monkeypatch):
    from kvserve.core import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "LORA_MAX_DEFERRALS", 0)
    cc, sc = configs(G=64, S=8, T=64, CP=True)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    sched.add_seq_group(make_group("a", prompt_of(0, 4), max_tokens=4, lora_request=lora(1)))
    sched_step(sched)
    sched.add_seq_group(make_group("b", prompt_of(1, 4), arrival_time=1, lora_request=lora(2)))
    sched_step(sched)  # b is deferred, and starved at once (limit 0)
    for i, (rid, lid) in enumerate([("a2", 1), ("base", 0)]):
        sched.add_seq_group(make_group(rid, prompt_of(i + 2, 4), arrival_time=i + 2, lora_request=lora(lid)))
    _, out = sched_step(sched)
    # a2 (adapter 1, queued after b's first deferral) waits; the base group passes.
    assert set(ids(out)) == {"a", "base"} and waiting_ids(sched) == ["b", "a2"]


def test_starvation_guard_still_lets_groups_queued_before_it_join_their_running_adapter(monkeypatch):
    """Groups queued before the starved group's first deferral are finitely many: they still
    join an adapter the step holds (the batch of a burst stays full); later ones wait."""
    from kvserve.core import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "LORA_MAX_DEFERRALS", 0)
    cc, sc = configs(G=64, S=8, T=64, CP=True)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    for i, (rid, lid) in enumerate([("a", 1), ("b", 2), ("a2", 1)]):
        sched.add_seq_group(
            make_group(rid, prompt_of(i, 4), max_tokens=4, arrival_time=i, lora_request=lora(lid))
        )
    _, out = sched_step(sched)
    assert set(ids(out)) == {"a", "a2"} and waiting_ids(sched) == ["b"]
    sched.add_seq_group(make_group("a3", prompt_of(3, 4), arrival_time=3, lora_request=lora(1)))
    _, out = sched_step(sched)
    assert set(ids(out)) == {"a", "a2"} and waiting_ids(sched) == ["b", "a3"]


def _burst_run(n_adapters, max_loras=4, n=64, max_tokens=(24, 40, 8, 56)):
    """``n`` requests at once, round-robin over ``n_adapters`` adapters (0: none), output
    lengths cycling through ``max_tokens``, on the simulator. Returns the harness after it ran."""
    cc, sc = configs(BS=4, G=2048, S=64, T=512, L=256, CP=True)
    lc = LoRAConfig(max_loras=max_loras) if n_adapters else None
    h = Harness(cc, sc, check_kv=False, lora_config=lc)
    for i in range(n):
        params = SamplingParams(max_tokens=max_tokens[i % len(max_tokens)], temperature=0.0, ignore_eos=True)
        h.add(
            f"r{i}",
            {"prompt_token_ids": prompt_of(i, 12)},
            params,
            lora_request=lora(i % n_adapters + 1) if n_adapters else None,
        )
    h.run()
    h.assert_idle()
    return h


def test_a_burst_over_more_adapters_than_slots_fills_each_slot_with_all_its_adapters_requests():
    """64 requests over 16 adapters at once, 4 slots, past the guard's deferral limit: an
    adapter's first step runs all 4 of its requests, no step holds fewer than 4 adapters while
    a request still waits (a slot left by an adapter is taken in the very next step), and the
    run takes about the steps the slot limit implies."""
    h = _burst_run(16)
    first: dict[str, int] = {}
    for k, out in enumerate(h.history):
        for ssg in out.scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, k)
    assert len(first) == 64
    for k, out in enumerate(h.history):
        if any(f > k for f in first.values()):  # some request still waits in step k
            assert len(loras_of(out)) == 4, (k, loras_of(out))
    for lid in range(1, 17):
        rids = [f"r{i}" for i in range(64) if i % 16 + 1 == lid]
        assert len({first[r] for r in rids}) == 1, (lid, [first[r] for r in rids])
    # 4 rounds of 4 adapters, each held for its longest request (56 tokens) plus its prefill
    # step; holding the queued requests back one per adapter took about 4x as many steps.
    assert len(h.history) <= 4 * (56 + 2), len(h.history)


def test_a_burst_over_as_many_adapters_as_slots_runs_like_no_adapters():
    assert len(_burst_run(4).history) == len(_burst_run(0).history)


# ---------------------------------------------------------------- priority policy
@pytest.mark.parametrize("high_adapter,preempts", [(2, False), (1, True), (0, True)])
def test_priority_preemption_is_not_triggered_for_a_group_whose_adapter_must_wait(high_adapter, preempts):
    """``high`` outranks ``low`` and would fit in its blocks; with another adapter it has no
    slot while adapter 1 runs, so it preempts nobody and waits (slots are counted before
    blocks); with adapter 1 or none it preempts ``low`` as without LoRA."""
    cc, sc = configs(G=5, S=8, T=64, policy="priority", PM="recompute")
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1))
    sched.add_seq_group(make_group("low", prompt_of(0, 16), max_tokens=4, priority=5, lora_request=lora(1)))
    sched_step(sched)  # low holds 4 of the 5 blocks
    high = make_group(
        "high", prompt_of(1, 8), max_tokens=2, priority=0, arrival_time=1, lora_request=lora(high_adapter)
    )
    sched.add_seq_group(high)
    _, out = sched_step(sched)
    if preempts:
        assert out.preempted == 1 and ids(out) == ["high"]
    else:
        assert out.preempted == 0 and ids(out) == ["low"]
        assert waiting_ids(sched) == ["high"]


# ---------------------------------------------------------------- engine level, preemption
def _run_three_adapters(CP, PM, max_loras, C):
    cc, sc = configs(BS=4, G=12, C=C, S=4, T=32, L=64, CP=CP, PM=PM, max_num_partial_prefills=4)
    h = Harness(cc, sc, lora_config=LoRAConfig(max_loras=max_loras))
    order = []
    for i in range(12):
        lid = [1, 2, 3][i % 3] if i % 4 else [3, 1, 2][i % 3]
        params = SamplingParams(max_tokens=8 + i % 5, temperature=0, ignore_eos=True)
        h.add(
            f"r{i}",
            {"prompt_token_ids": prompt_of(i, 6 + (i * 5) % 11)},
            params,
            arrival_time=float(i),
            lora_request=lora(lid),
        )
        order.append((f"r{i}", lid))
    h.run(max_steps=4000)
    h.assert_idle()
    return h, order


@pytest.mark.parametrize("CP", [False, True])
@pytest.mark.parametrize("PM,C", [("recompute", 0), ("swap", 64)])
def test_max_loras_1_three_adapters_all_finish_fcfs_within_each_under_preemption(CP, PM, C):
    h, order = _run_three_adapters(CP, PM, 1, C)
    assert all(h.outputs[rid].outcome == "finished" for rid, _ in order)
    assert all(len(s) <= 1 for s in h.lora_steps) and {1, 2, 3} == set().union(*h.lora_steps)
    stats = h.scheduler.get_kv_cache_stats()
    key = "num_swap_preemptions" if PM == "swap" else "num_recompute_preemptions"
    assert stats[key] > 0, stats  # the cache is small enough that preemption really happens
    for lid in (1, 2, 3):
        mine = [rid for rid, x in order if x == lid]
        firsts = [h.outputs[rid].metrics.first_scheduled_time for rid in mine]
        assert firsts == sorted(firsts), (lid, list(zip(mine, firsts)))
    # Scheduling never changes the answer: the same tokens as with a slot per adapter.
    h3, _ = _run_three_adapters(CP, PM, 3, C)
    assert {rid: h.tokens(rid) for rid, _ in order} == {rid: h3.tokens(rid) for rid, _ in order}
    assert any(len(s) > 1 for s in h3.lora_steps)


def test_engine_refuses_a_lora_request_without_lora_enabled():
    cc, sc = configs()
    h = Harness(cc, sc)
    with pytest.raises(ValueError, match="enable_lora"):
        h.add("x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), lora_request=lora(1))
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        Harness(cc, sc, lora_config=LoRAConfig()).add(
            "y", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), lora_request=1
        )
    assert not h.scheduler.waiting


# ---------------------------------------------------------------- prefix caching
def _bm():
    return BlockSpaceManager(
        block_size=4, num_gpu_blocks=32, num_cpu_blocks=0, watermark=0.0, enable_caching=True
    )


def _prefill(bm, g):
    bm.allocate(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
        s.data.update_num_computed_tokens(s.data.get_num_uncomputed_tokens())
    bm.mark_blocks_as_computed(g)


@pytest.mark.parametrize(
    "first,second,shared",
    [(1, 2, False), (1, 0, False), (0, 1, False), (2, 2, True), (0, 0, True)],
)
def test_prefix_cache_shares_blocks_only_within_one_adapter(first, second, shared):
    bm = _bm()
    p = prompt_of(7, 13)  # 3 full blocks + 1 token
    a = make_group("a", p, lora_request=lora(first))
    _prefill(bm, a)
    b = make_group("b", p, lora_request=lora(second))
    plan = bm.plan_allocation(b)
    assert plan.num_cached_tokens == (12 if shared else 0)
    bm.allocate(b, plan)
    ta = bm.get_block_table(a.get_seqs()[0])
    tb = bm.get_block_table(b.get_seqs()[0])
    if shared:
        assert ta[:3] == tb[:3]
    else:
        assert not set(ta) & set(tb)
    bm.check_invariants()


def test_same_prompt_under_two_adapters_on_the_engine_never_shares_a_block():
    cc, sc = configs(BS=4, G=32, PC=True)
    h = Harness(cc, sc, lora_config=LoRAConfig(max_loras=2))
    p = prompt_of(3, 13)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    h.add("a1", {"prompt_token_ids": p}, params, arrival_time=0.0, lora_request=lora(1))
    h.step()
    h.step()  # a1's prompt blocks are cached now
    h.add("b", {"prompt_token_ids": p}, params, arrival_time=1.0, lora_request=lora(2))
    h.add("a2", {"prompt_token_ids": p}, params, arrival_time=2.0, lora_request=lora(1))
    h.add("base", {"prompt_token_ids": p}, params, arrival_time=3.0)
    h.run()
    h.assert_idle()
    assert h.outputs["b"].num_cached_tokens == 0 and h.outputs["base"].num_cached_tokens == 0
    assert h.outputs["a2"].num_cached_tokens == 12
    # The simulated model depends on the adapter: same prompt, other adapter, other tokens.
    assert h.tokens("a1") == h.tokens("a2") != h.tokens("b")


def test_simulator_catches_kv_read_under_another_adapter():
    """The shadow cache tags each slot with the adapter that wrote it: a block table that
    hands adapter 1's blocks to adapter 2 is a KVCacheCorruption."""
    cc, sc = configs(BS=4, G=32)
    ex = SimulatedExecutor(1000, cache_config=cc)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=2))
    a = make_group("a", prompt_of(1, 8), max_tokens=4, lora_request=lora(1))
    sched.add_seq_group(a)
    sched_step(sched, ex)
    metas, out = sched.schedule()
    metas[0].lora_request = lora(2)  # as if the blocks were shared across adapters
    from kvserve.sequence import ExecuteModelRequest

    with pytest.raises(KVCacheCorruption, match="adapter 2"):
        ex.execute_model(ExecuteModelRequest(metas, {}, {}, {}))


# ---------------------------------------------------------------- property
@st.composite
def lora_workloads(draw):
    n = draw(st.integers(1, 10))
    bs = draw(st.sampled_from([2, 4]))
    reqs = [
        (
            draw(st.integers(0, 6)),  # arrival step
            draw(st.integers(0, 3)),  # adapter (0 = base)
            draw(st.integers(0, 3)),  # prompt family (shared prefixes across requests)
            draw(st.integers(1, 14)),  # prompt length
            draw(st.integers(1, 8)),  # max_tokens
        )
        for _ in range(n)
    ]
    return dict(
        reqs=reqs,
        BS=bs,
        G=draw(st.integers(24 // bs + 1, 24 // bs + 8)),  # any one request fits alone
        CP=draw(st.booleans()),
        PC=draw(st.booleans()),
        PM=draw(st.sampled_from(["recompute", "swap"])),
        max_loras=draw(st.integers(1, 2)),
    )


def run_lora_workload(w, lora_config, on_step=None):
    """Drive workload ``w`` (``lora_workloads``' layout) through a ``Harness`` on its tiny
    cache until it drains (bounded), calling ``on_step(h)`` after every step; asserts every
    group finished and admission was FCFS within each adapter. Returns ``(h, added)``, the
    harness and ``[(request_id, adapter id)]`` in arrival order."""
    cc, sc = configs(
        BS=w["BS"],
        G=w["G"],
        C=64 if w["PM"] == "swap" else 0,
        S=4,
        T=32,
        L=24,
        CP=w["CP"],
        PC=w["PC"],
        PM=w["PM"],
        max_num_partial_prefills=4,
    )
    h = Harness(cc, sc, lora_config=lora_config)
    pending = sorted(enumerate(w["reqs"]), key=lambda x: (x[1][0], x[0]))
    added = []
    steps = 0
    while pending or h.engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, lid, fam, plen, mt) = pending.pop(0)
            mt = min(mt, sc.max_model_len - plen)
            params = SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True)
            h.add(
                f"r{i}",
                {"prompt_token_ids": prompt_of(fam, plen)},
                params,
                arrival_time=float(len(added)),
                lora_request=lora(lid),
            )
            added.append((f"r{i}", lid))
        h.step()
        if on_step is not None:
            on_step(h)
        steps += 1
        assert steps < 2000, "did not drain"
    h.assert_idle()
    assert all(h.outputs[rid].outcome == "finished" for rid, _ in added), {
        rid: (h.outputs[rid].outcome, h.outputs[rid].error) for rid, _ in added
    }
    for lid in {x for _, x in added}:
        firsts = [h.outputs[rid].metrics.first_scheduled_time for rid, x in added if x == lid]
        assert firsts == sorted(firsts), (lid, firsts)
    return h, added


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lora_workloads())
def test_property_random_adapters_tiny_caches_invariants(w):
    """Random arrivals of groups with random adapters on random tiny caches: every step holds
    <= max_loras adapters (Harness.check_loras), every group finishes, admission is FCFS
    within an adapter, blocks are conserved (checked every step) and all freed at the end,
    and the simulator's adapter-tagged shadow cache sees no cross-adapter block."""
    run_lora_workload(w, LoRAConfig(max_loras=w["max_loras"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lora_workloads(),
    st.lists(st.integers(0, 4), min_size=10, max_size=10),  # priorities
    st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=10, max_size=10),  # abort steps
)
def test_property_priority_policy_and_aborts_with_adapters(w, prios, aborts):
    """Under the priority policy, with some requests aborted at random steps (waiting,
    deferred, running or swapped): every step holds <= max_loras adapters, every request ends
    exactly once (finished or aborted), blocks are conserved and all freed at the end, and no
    deferral count outlives its request."""
    cc, sc = configs(
        BS=w["BS"],
        G=w["G"],
        C=64 if w["PM"] == "swap" else 0,
        S=4,
        T=32,
        L=24,
        CP=w["CP"],
        PC=w["PC"],
        PM=w["PM"],
        policy="priority",
        max_num_partial_prefills=4,
    )
    h = Harness(cc, sc, lora_config=LoRAConfig(max_loras=w["max_loras"]))
    pending = sorted(enumerate(w["reqs"]), key=lambda x: (x[1][0], x[0]))
    added = []
    steps = 0
    while pending or h.engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, lid, fam, plen, mt) = pending.pop(0)
            params = SamplingParams(
                max_tokens=min(mt, sc.max_model_len - plen), temperature=0, ignore_eos=True
            )
            h.add(
                f"r{i}",
                {"prompt_token_ids": prompt_of(fam, plen)},
                params,
                priority=prios[i],
                lora_request=lora(lid),
            )
            added.append(f"r{i}")
        for rid in added:
            i = int(rid[1:])
            if aborts[i] == steps and rid not in h.num_final:
                h.engine.abort_request(rid)
        h.step()
        steps += 1
        assert steps < 2000, "did not drain"
    h.assert_idle()
    assert not h.scheduler._lora_deferrals
    assert all(h.num_final.get(rid) == 1 for rid in added), h.num_final
    for rid in added:
        o = h.outputs[rid]
        assert o.outcome in ("finished", "aborted"), (rid, o.outcome, o.error)
        if o.outcome == "aborted":
            assert aborts[int(rid[1:])] is not None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_adapters=st.integers(1, 10),
    max_loras=st.integers(1, 4),
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    n=st.integers(1, 32),
    limit=st.sampled_from([0, 2, 16]),
)
def test_property_a_burst_never_idles_a_slot_or_holds_back_a_held_adapters_requests(
    n_adapters, max_loras, lens, n, limit
):
    """Any burst (all requests queued at once, room for all in the budget): every request
    finishes, no step holds fewer than ``max_loras`` adapters while one still waits, and none
    waits whose adapter the step holds (the starvation guard never thins a burst's slots)."""
    from kvserve.core import scheduler as scheduler_mod

    old = scheduler_mod.LORA_MAX_DEFERRALS
    scheduler_mod.LORA_MAX_DEFERRALS = limit
    try:
        h = _burst_run(n_adapters, max_loras=max_loras, n=n, max_tokens=tuple(lens))
    finally:
        scheduler_mod.LORA_MAX_DEFERRALS = old
    assert all(h.outputs[f"r{i}"].outcome == "finished" for i in range(n))
    first: dict[str, int] = {}
    for k, out in enumerate(h.history):
        for ssg in out.scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, k)
    for k, out in enumerate(h.history):
        if any(f > k for f in first.values()):
            assert len(loras_of(out)) == max_loras, (k, loras_of(out))
        waiting_adapters = {i % n_adapters + 1 for i in range(n) if first[f"r{i}"] > k}
        assert not waiting_adapters & loras_of(out), (k, waiting_adapters, loras_of(out))
