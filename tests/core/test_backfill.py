"""Backfill past a blocked head: short requests behind a long prompt that must wait for KV
blocks are admitted while it waits, the long prompt is admitted no later than without backfill
(chunked prefill) or within the stated bound (one step per backfilling step, without it), the
bypass bound holds, and random workloads keep every invariant with no group passed more than
``BACKFILL_MAX_BYPASSES`` times."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineArgs, SchedulerConfig, default_scheduling_backfill
from kvserve.core import scheduler as scheduler_mod
from kvserve.entrypoints.cli import add_engine_args, engine_args_from
from kvserve.sampling_params import SamplingParams
from tests.core.simutil import Harness, configs, prompt_of

NUM_SHORTS = 8


def first_steps(h: Harness) -> dict[str, int]:
    """request id -> index of the first step that scheduled it."""
    first: dict[str, int] = {}
    for i, out in enumerate(h.history):
        for ssg in out.scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, i)
    return first


def head_of_line(backfill: bool | None, chunked: bool, policy: str = "fcfs") -> Harness:
    """A running request that grows to 17 of the 32 blocks, then a 20-block prompt (``long``,
    must wait for the running one to end) and 8 one-block prompts behind it."""
    cc, sc = configs(BS=4, G=32, S=16, T=128, L=128, CP=chunked, policy=policy)
    sc.scheduling_backfill = backfill
    h = Harness(cc, sc)
    h.add("run", prompt_of(0, 60), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    h.step()
    h.add("long", prompt_of(1, 80), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for i in range(NUM_SHORTS):
        h.add(f"s{i}", prompt_of(2 + i, 4), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    h.run()
    h.assert_idle()
    return h


@pytest.mark.parametrize("chunked", [False, True])
def test_shorts_pass_a_head_waiting_for_blocks_without_delaying_it(chunked):
    off = head_of_line(False, chunked)
    on = head_of_line(True, chunked)
    f_off, f_on = first_steps(off), first_steps(on)
    shorts = [f"s{i}" for i in range(NUM_SHORTS)]
    # without backfill every short waits behind the long prompt
    assert all(f_off[s] >= f_off["long"] for s in shorts)
    # with it they all start while it waits, and it starts no later (chunked) or within
    # one step per step that admitted a group past it (without chunking)
    assert all(f_on[s] < f_on["long"] for s in shorts)
    backfill_steps = {f_on[s] for s in shorts}
    if chunked:
        assert f_on["long"] <= f_off["long"]
    else:
        assert f_on["long"] <= f_off["long"] + len(backfill_steps)
    assert len(backfill_steps) <= scheduler_mod.BACKFILL_MAX_BYPASSES
    assert on.scheduler.num_backfilled == NUM_SHORTS and off.scheduler.num_backfilled == 0
    # the schedule never changes an answer
    assert {r: on.tokens(r) for r in f_on} == {r: off.tokens(r) for r in f_off}


def test_head_reclaims_the_blocks_of_groups_that_passed_it():
    """Shorts that would still be running when the long prompt could start are preempted
    (recompute) to admit it in that step; they finish later with the same answers."""
    cc, sc = configs(BS=4, G=32, S=16, T=128, L=128, CP=True)
    runs = {}
    for backfill in (False, True):
        sc.scheduling_backfill = backfill
        h = Harness(cc, SchedulerConfig(**{**sc.__dict__}))
        h.add("run", prompt_of(0, 60), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        h.step()
        h.add("long", prompt_of(1, 80), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        for i in range(NUM_SHORTS):  # long-lived shorts: still decoding when "run" ends
            h.add(f"s{i}", prompt_of(2 + i, 4), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        h.run()
        h.assert_idle()
        runs[backfill] = h
    f_off, f_on = first_steps(runs[False]), first_steps(runs[True])
    assert f_on["long"] <= f_off["long"]
    assert runs[True].scheduler.num_backfill_reclaims > 0
    assert {r: runs[True].tokens(r) for r in f_on} == {r: runs[False].tokens(r) for r in f_off}


def test_bypass_bound(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "BACKFILL_MAX_BYPASSES", 3)
    h = head_of_line(True, chunked=True)
    f = first_steps(h)
    before = [s for s in (f"s{i}" for i in range(NUM_SHORTS)) if f[s] < f["long"]]
    assert len(before) == 3, before


def test_budget_blocked_head_keeps_its_blocks():
    """Without chunking, a prompt that fits the cache but not the rest of the step's budget is
    passed by a smaller one, and starts in the very next step."""
    cc, sc = configs(BS=4, G=64, S=8, T=64, L=64, CP=False)
    for backfill in (False, True):
        sc.scheduling_backfill = backfill
        h = Harness(cc, SchedulerConfig(**{**sc.__dict__}))
        p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        h.add("a", prompt_of(0, 40), p)
        h.add("b", prompt_of(1, 40), p)  # 40 + 40 > 64: waits for the next step
        h.add("c", prompt_of(2, 8), p)
        h.run()
        h.assert_idle()
        f = first_steps(h)
        assert f["a"] == 0 and f["b"] == 1
        assert f["c"] == (0 if backfill else 1)


def test_defaults_follow_the_policy_and_flags():
    assert default_scheduling_backfill("fair")
    assert not default_scheduling_backfill("fcfs") and not default_scheduling_backfill("priority")
    assert SchedulerConfig(policy="fcfs").backfill_enabled is False
    assert SchedulerConfig(policy="priority", scheduling_backfill=True).backfill_enabled is True
    with pytest.raises(ValueError, match="scheduling_backfill"):
        SchedulerConfig(scheduling_backfill="yes")  # type: ignore[arg-type]
    import argparse

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_args_from(ap.parse_args([])).scheduling_backfill is None
    assert engine_args_from(ap.parse_args(["--scheduling-backfill"])).scheduling_backfill is True
    assert engine_args_from(ap.parse_args(["--no-scheduling-backfill"])).scheduling_backfill is False
    _, _, sc = EngineArgs(scheduling_backfill=True, num_gpu_blocks=8).create_configs(64)
    assert sc.backfill_enabled


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    chunked=st.booleans(),
    prefix=st.booleans(),
    mode=st.sampled_from([None, "recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    G=st.integers(10, 30),
    S=st.integers(2, 8),
    T=st.integers(24, 64),
    reqs=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 36), st.integers(1, 10), st.integers(0, 2)),
        min_size=1,
        max_size=20,
    ),
)
def test_random_workloads_with_backfill(chunked, prefix, mode, policy, G, S, T, reqs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_mod, "BACKFILL_MAX_BYPASSES", 2)  # a bound the workloads reach
        _random_workload(chunked, prefix, mode, policy, G, S, T, reqs)


def _random_workload(chunked, prefix, mode, policy, G, S, T, reqs):
    """Random arrivals (each ``delay`` steps after the one before), prompt and output lengths, priorities and cache
    sizes, backfill on: invariants after every step (``Harness``), every request finishes with
    the answer of the same workload without backfill, nothing leaks, and no group still waiting
    after a step has seen more than ``BACKFILL_MAX_BYPASSES`` groups ranked behind it admitted
    in one wait (from entering ``waiting``, new or preempted, to its admission)."""
    runs = {}
    for backfill in (False, True):
        cc, sc = configs(
            BS=4,
            G=G,
            C=16,
            S=S,
            T=T,
            L=48,
            CP=chunked,
            PC=prefix,
            PM=mode,
            policy=policy,
            max_num_partial_prefills=S + 1,  # no skip for the partial-prefill limit: only backfill passes
        )
        sc.scheduling_backfill = backfill
        h = Harness(cc, sc)
        sched = h.scheduler
        passed: dict[str, int] = {}  # groups admitted past it since it last entered waiting
        peak: dict[str, int] = {}
        orig = sched.schedule

        def schedule(sched=sched, orig=orig, passed=passed, peak=peak):
            ranked = list(sched.policy.sort_by_priority(sched.clock(), sched.waiting))
            metas, out = orig()
            still = {g.request_id for g in sched.waiting}
            admitted = {ssg.seq_group.request_id for ssg in out.scheduled_seq_groups}
            for i, g in enumerate(ranked):
                if g.request_id in still:
                    behind = sum(1 for b in ranked[i + 1 :] if b.request_id in admitted)
                    passed[g.request_id] = passed.get(g.request_id, 0) + behind
                    peak[g.request_id] = max(peak.get(g.request_id, 0), passed[g.request_id])
                elif g.request_id in admitted:
                    passed.pop(g.request_id, None)  # the bound is per wait: admitted, it starts over
            return metas, out

        sched.schedule = schedule
        arrivals, t = [], 0
        for i, (delay, plen, mt, prio) in enumerate(reqs):
            t += delay
            arrivals.append((t, i, plen, mt, prio))
        step = 0
        while arrivals or h.engine.has_unfinished_requests():
            while arrivals and arrivals[0][0] <= step:
                _, i, plen, mt, prio = arrivals.pop(0)
                h.add(
                    f"r{i}",
                    prompt_of(i % 3, plen),  # shared prefixes: prefix-cache hits
                    SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True),
                    priority=prio if policy == "priority" else 0,
                )
            if h.engine.has_unfinished_requests():
                h.step()
            step += 1
            assert step < 3000, "engine did not drain"
        h.assert_idle()
        assert all(h.outputs[f"r{i}"].outcome in ("finished", "rejected") for i in range(len(reqs)))
        if backfill:
            assert max(peak.values(), default=0) <= scheduler_mod.BACKFILL_MAX_BYPASSES, peak
        runs[backfill] = {r: (o.outcome, h.tokens(r)) for r, o in h.outputs.items()}
    assert runs[True] == runs[False]
