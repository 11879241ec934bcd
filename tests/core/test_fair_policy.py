"""The ``fair`` policy (virtual token counter, Sheng et al., OSDI 2024): its counter rules as a
unit, its orders, and the scheduler under it (a flooding tenant against a late one, random
workloads on tiny caches with the invariants checked every step)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineArgs, SchedulerConfig, parse_tenant_weights
from kvserve.core import policy as policy_module
from kvserve.core.policy import MAX_IDLE_TENANTS, FairPolicy, PolicyFactory
from kvserve.sampling_params import SamplingParams
from tests.core.simutil import Harness, configs, make_group, prompt_of


def group(rid, tenant, length=8, arrival=0.0, priority=0):
    g = make_group(rid, prompt_of(hash(rid) % 997, length), arrival_time=arrival, priority=priority)
    g.tenant = tenant
    return g


# ---------------------------------------------------------------- counters
def test_counters_grow_by_weighted_tokens_over_the_tenant_weight():
    p = FairPolicy(input_weight=1.0, output_weight=2.0, tenant_weights={"a": 2.0})
    ga, gb = group("x", "a"), group("y", "b")
    p.on_add(ga)
    p.on_add(gb)
    p.on_served(ga, 10, 0)
    p.on_served(ga, 0, 3)
    p.on_served(gb, 10, 3)
    assert p.counters == {"a": (10 * 1.0 + 3 * 2.0) / 2.0, "b": 10 * 1.0 + 3 * 2.0}


def test_a_tenant_back_from_idle_is_lifted_to_the_least_backlogged_counter():
    p = FairPolicy()
    a1, b1 = group("a1", "a"), group("b1", "b")
    p.on_add(a1)
    p.on_add(b1)
    p.on_served(a1, 100, 0)
    p.on_served(b1, 40, 0)
    p.on_finish(b1)  # b idle at 40 while a runs on
    c = group("c1", "c")
    p.on_add(c)  # a new tenant starts at the least backlogged counter, not at 0
    assert p.counters["c"] == 100.0
    p.on_served(a1, 50, 0)
    p.on_served(c, 80, 0)
    b2 = group("b2", "b")
    p.on_add(b2)  # idling earned b nothing: lifted from 40 to min(a=150, c=180)
    assert p.counters["b"] == 150.0
    # a tenant above the floor keeps its own counter when it comes back
    p.on_finish(c)
    assert p.counters["c"] == 180.0
    p.on_add(group("c2", "c"))
    assert p.counters["c"] == 180.0


def test_the_floor_survives_an_empty_scheduler_and_idle_entries_are_dropped():
    p = FairPolicy()
    a, b = group("a1", "a"), group("b1", "b")
    p.on_add(a)
    p.on_add(b)
    p.on_served(a, 30, 0)
    p.on_served(b, 70, 0)
    p.on_finish(a)  # a (30) <= floor (b's 70): dropped, it would be lifted to 70 anyway
    assert "a" not in p.counters
    p.on_finish(b)  # the last backlogged tenant leaves: the floor stays at 70
    assert p.floor() == 70.0 and p.counters == {}
    p.on_add(group("a2", "a"))
    assert p.counters == {"a": 70.0}


def test_burst_credit_lifts_a_tenant_joining_a_busy_engine_below_the_floor():
    p = FairPolicy(burst_tokens=60.0, tenant_weights={"w": 2.0})
    a, a2 = group("a1", "a"), group("a2", "a")
    p.on_add(a)
    p.on_add(group("z1", "z"))  # a and z arrive together, before any step: both start level
    assert p.counters == {"a": 0.0, "z": 0.0}
    p.begin_step([])  # a step starts with a and z backlogged: the engine is busy
    p.on_served(a, 260, 0)
    p.on_served(group("z1", "z"), 200, 0)  # the floor ratchets up to the least: 200
    assert p.floor() == 200.0
    b = group("b1", "b")
    p.on_add(b)  # b joins 60 weighted tokens behind the floor, ahead of a and z in every order
    assert p.counters["b"] == 140.0 and p.floor() == 200.0  # the dip does not lower the floor
    assert [g.request_id for g in p.admission_order(0.0, [a2, group("b2", "b")])][0] == "b2"
    c = group("c1", "c")
    p.on_add(c)  # lifted against the ratcheted 200, not b's 140: credits do not chain
    assert p.counters["c"] == 140.0
    p.on_add(group("w1", "w"))  # weight 2: the same 60 on its counter (120 weighted tokens)
    assert p.counters["w"] == 140.0  # never behind a lighter tenant joining with it
    # an idle tenant at or below floor - credit is dropped (exact: the floor only grows) ...
    p.on_served(c, 50, 0)
    p.on_finish(c)  # c at 190 > 140: kept
    assert p.counters["c"] == 190.0
    p.on_finish(b)  # b at 140: dropped
    assert "b" not in p.counters and p.counter("b") == 140.0


def test_a_tenant_alone_gets_no_burst_credit():
    p = FairPolicy(burst_tokens=60.0)
    a = group("a1", "a")
    p.on_add(a)
    p.begin_step([])  # only a was backlogged: nobody to run ahead of
    p.on_served(a, 100, 0)
    p.on_finish(a)
    p.begin_step([])  # an idle step
    p.on_add(group("a2", "a"))
    assert p.counters["a"] == 100.0


def test_a_tenant_joining_an_engine_that_went_idle_gets_no_burst_credit():
    """An idle engine runs no step, so the tenants backlogged when the last step began may all
    have left: the next tenant to arrive joins an idle engine and starts level with the floor."""
    p = FairPolicy(burst_tokens=60.0)
    b = group("b1", "b")
    p.on_add(b)
    p.begin_step([])  # b alone is backlogged; no step begins after it finishes
    p.on_served(b, 100, 0)
    p.on_finish(b)
    p.on_add(group("a1", "a"))
    assert p.counters["a"] == 100.0  # not 40: nobody was left to run ahead of
    p.begin_step([])
    p.on_add(group("b2", "b"))  # b returns to a busy engine: its credit is against a
    assert p.counters["b"] == 100.0  # its own (above floor - credit), level with a


def test_state_stays_bounded_under_many_short_lived_tenants():
    p = FairPolicy()
    keeper = group("keep", "keeper")  # stays backlogged at counter 0: nobody is at the floor
    p.on_add(keeper)
    for i in range(3 * MAX_IDLE_TENANTS):
        g = group(f"r{i}", f"t{i}")
        p.on_add(g)
        p.on_served(g, 1 + i % 7, 0)
        p.on_finish(g)
    assert len(p.counters) <= 2 * MAX_IDLE_TENANTS + 1
    assert len(p._members) == 1 and set(p._backlog) == {"keeper"}
    p.on_finish(keeper)
    assert p._members == {} and p._backlog == {}


def test_unknown_groups_are_no_ops():
    p = FairPolicy()
    g = group("x", "a")
    p.on_served(g, 10, 10)
    p.on_finish(g)
    assert p.counters == {} and p.floor() == 0.0


# ---------------------------------------------------------------- orders
def test_admission_interleaves_tenants_by_projected_counter():
    p = FairPolicy()
    waiting = [group(f"a{i}", "a", arrival=i) for i in range(4)] + [
        group(f"b{i}", "b", arrival=10 + i) for i in range(4)
    ]
    for g in waiting:
        p.on_add(g)
    order = [g.request_id for g in p.admission_order(20.0, waiting)]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    # a tenant of weight 2 is charged half as much per token: about two turns per turn of b
    p2 = FairPolicy(tenant_weights={"a": 2.0})
    for g in waiting:
        p2.on_add(g)
    order = [g.request_id for g in p2.admission_order(20.0, waiting)]
    assert order[:6] == ["a0", "b0", "a1", "a2", "b1", "a3"]


def test_admission_serves_the_least_served_tenant_first_and_priority_within_a_tenant():
    p = FairPolicy()
    a = [group("a0", "a", arrival=0), group("a1", "a", arrival=1)]
    b = [group("b0", "b", arrival=2), group("b1", "b", arrival=3, priority=-1)]
    for g in a + b:
        p.on_add(g)
    p.on_served(a[0], 100, 0)
    order = [g.request_id for g in p.admission_order(5.0, a + b)]
    # b is 100 weighted tokens behind: both of its groups (the more urgent one first) go before a's
    assert order == ["b1", "b0", "a0", "a1"]


def test_running_order_puts_the_most_served_tenant_last():
    p = FairPolicy()
    gs = [group(f"{t}{i}", t, arrival=i) for i in range(3) for t in "abc"]
    for g in gs:
        p.on_add(g)
    p.on_served(gs[0], 50, 0)  # a0
    p.on_served(gs[2], 20, 0)  # c0
    order = [g.request_id for g in p.sort_by_priority(9.0, gs)]
    assert order == ["b0", "b1", "b2", "c0", "c1", "c2", "a0", "a1", "a2"]


# ---------------------------------------------------------------- configuration
def test_the_burst_credit_comes_from_the_config():
    assert PolicyFactory.from_config(SchedulerConfig(policy="fair")).burst_tokens == 2048.0
    assert PolicyFactory.from_config(SchedulerConfig(policy="fair", fair_burst_tokens=0)).burst_tokens == 0.0


def test_factory_builds_fair_from_the_scheduler_config():
    sc = SchedulerConfig(
        policy="fair", fair_input_weight=0.5, fair_output_weight=4.0, tenant_weights={"gold": 3.0}
    )
    p = PolicyFactory.from_config(sc)
    assert isinstance(p, FairPolicy) and p.tracks_service and p.preempts_by_rank
    assert (p.input_weight, p.output_weight, p.tenant_weights) == (0.5, 4.0, {"gold": 3.0})
    assert SchedulerConfig().fair_output_weight == 2.0 and SchedulerConfig().fair_input_weight == 1.0
    with pytest.raises(ValueError, match=r"policy must be one of \['fair', 'fcfs', 'priority'\]"):
        PolicyFactory.from_config(SchedulerConfig(policy="lottery"))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize(
    "kwargs,names",
    [
        (dict(tenant_weights={"a": 2.0}), "tenant_weights only applies"),
        (
            dict(fair_input_weight=0.5, fair_output_weight=3.0),
            "fair_input_weight, fair_output_weight only apply",
        ),
        (dict(fair_burst_tokens=0), "fair_burst_tokens only applies"),
    ],
)
def test_fair_settings_under_another_policy_are_refused_naming_them(policy, kwargs, names):
    """The other policies would ignore them: an error, not a weight that silently does nothing."""
    with pytest.raises(ValueError, match=rf"^{names} to the 'fair' scheduling policy, not '{policy}'"):
        PolicyFactory.from_config(SchedulerConfig(policy=policy, **kwargs))
    assert not PolicyFactory.from_config(SchedulerConfig(policy=policy)).tracks_service


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fair_input_weight=0.0), r"fair_input_weight must be a finite number > 0, got 0.0"),
        (dict(fair_output_weight=-1), r"fair_output_weight must be a finite number > 0, got -1"),
        (dict(fair_output_weight=float("inf")), r"fair_output_weight must be a finite number > 0"),
        (dict(tenant_weights={"a": 0}), r"tenant_weights\['a'\] must be a finite number > 0, got 0"),
        (dict(fair_burst_tokens=-1), r"fair_burst_tokens must be a finite number >= 0, got -1"),
        (dict(fair_burst_tokens=float("nan")), r"fair_burst_tokens must be a finite number >= 0"),
        (dict(fair_burst_tokens="8"), r"fair_burst_tokens must be a finite number >= 0, got '8'"),
        (dict(tenant_weights="a=2,b"), r"tenant_weights entry 'b' is not NAME=WEIGHT"),
        (dict(tenant_weights="a=x"), r"tenant_weights entry 'a=x' is not NAME=WEIGHT"),
        (dict(tenant_weights="a=1,a=2"), r"tenant_weights names 'a' twice"),
    ],
)
def test_bad_fair_settings_are_value_errors_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_tenant_weights_parse_the_flag_form():
    assert parse_tenant_weights("a=2, b=0.5") == {"a": 2.0, "b": 0.5}
    assert parse_tenant_weights(None) == {} and parse_tenant_weights(" ") == {}


# ---------------------------------------------------------------- the scheduler under fair
def _flood(policy, b_served_before=False, **kw):
    """Tenant A queues 40 requests; two steps later tenant B sends 4. Returns the harness and
    the step index at which each request was first scheduled (counted from A's arrival).
    ``b_served_before``: B first runs 4 requests alone to the end, and the engine goes idle."""
    cc, sc = configs(BS=4, G=64, S=4, T=64, L=64, policy=policy, **kw)
    h = Harness(cc, sc)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    if b_served_before:
        for i in range(4):
            h.add(f"early{i}", {"prompt_token_ids": prompt_of(200 + i, 8)}, p, tenant="B")
        h.run()
        h.history.clear()
        h.outputs.clear()
    for i in range(40):
        h.add(f"a{i}", {"prompt_token_ids": prompt_of(i, 8)}, p, tenant="A")
    h.step()
    h.step()
    for i in range(4):
        h.add(f"b{i}", {"prompt_token_ids": prompt_of(100 + i, 8)}, p, tenant="B")
    h.run()
    h.assert_idle()
    first: dict[str, int] = {}
    for step, out in enumerate(h.history):
        for ssg in out.scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, step)
    assert len(first) == 44 and all(o.outcome == "finished" for o in h.outputs.values())
    return h, first


@pytest.mark.parametrize("chunked", [False, True])
def test_a_late_tenant_is_served_before_a_flooding_tenants_backlog(chunked):
    _, fair = _flood("fair", CP=chunked)
    _, vtc = _flood("fair", CP=chunked, fair_burst_tokens=0)
    _, fcfs = _flood("fcfs", CP=chunked)
    b_fcfs = min(fcfs[f"b{i}"] for i in range(4))
    # fcfs: B waits for all 40 of A's requests to be admitted
    assert all(fcfs[f"a{i}"] <= b_fcfs for i in range(40))
    for first in (fair, vtc):
        b_last = max(first[f"b{i}"] for i in range(4))
        # fair: all of B's requests are admitted while most of A's backlog still waits
        a_after = sum(1 for i in range(40) if first[f"a{i}"] > b_last)
        assert a_after >= 30, (a_after, first)
        # B holds no running sequence and A all of them: B's share (half) starts the step it
        # arrives, preempting A's
        assert sorted(first[f"b{i}"] for i in range(4))[:2] == [2, 2]
    # with the burst credit (one step's 64 tokens) B's four 8-token prompts all go ahead of
    # A's backlog; with VTC's exact lift (B level with A) A's requests interleave with B's
    b_last = max(fair[f"b{i}"] for i in range(4))
    assert not any(2 <= fair[f"a{i}"] < b_last for i in range(40)), fair
    b_last = max(vtc[f"b{i}"] for i in range(4))
    assert sum(1 for i in range(40) if 2 <= vtc[f"a{i}"] <= b_last) >= 1


@pytest.mark.parametrize("chunked", [False, True])
def test_a_tenant_served_before_the_flood_is_served_as_soon_as_a_new_one(chunked):
    """B ran alone and left, the engine went idle, A floods: A joined an idle engine (no
    burst credit), so B coming back is admitted the step it arrives and ahead of A's backlog,
    exactly as a B never served before."""
    _, fresh = _flood("fair", CP=chunked)
    _, back = _flood("fair", b_served_before=True, CP=chunked)
    b_back = sorted(back[f"b{i}"] for i in range(4))
    assert b_back == sorted(fresh[f"b{i}"] for i in range(4)), (b_back, back)
    assert b_back[:2] == [2, 2]
    assert not any(2 <= back[f"a{i}"] < b_back[-1] for i in range(40)), back


def _churn(steps=60, num_a=12, a_len=(8, 4), **cfg):
    """Tenant A queues ``num_a`` requests (prompt, output lengths ``a_len``); from step 2 on,
    every step two requests of a brand-new tenant arrive (a new ``user`` each), more than the
    engine serves. Returns the arrival order, the step each request was first scheduled and
    the step each last ran."""
    cc, sc = configs(**{"BS": 4, "G": 64, "S": 4, "T": 64, "L": 64, "policy": "fair", **cfg})
    h = Harness(cc, sc)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    pa = SamplingParams(max_tokens=a_len[1], temperature=0, ignore_eos=True)
    order = []
    for i in range(num_a):
        order.append(f"a{i}")
        h.add(order[-1], {"prompt_token_ids": prompt_of(i, a_len[0])}, pa, tenant="A")
    for k in range(steps):
        for j in range(2 if k >= 2 else 0):
            order.append(f"n{k}.{j}")
            h.add(order[-1], {"prompt_token_ids": prompt_of(1000 + 2 * k + j, 8)}, p, tenant=f"new{k}")
        h.step()
    h.run()
    h.assert_idle()
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for step, out in enumerate(h.history):
        for ssg in out.scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, step)
            last[ssg.seq_group.request_id] = step
    return order, first, last


@pytest.mark.parametrize("aging", [4, 16])
def test_a_stream_of_new_tenants_does_not_starve_a_served_one(monkeypatch, aging):
    """Every newcomer is lifted to the least counter, below A's once A has been served, so on
    counters alone A's queue would wait while the stream lasts. With aging, at most the groups
    that arrived before a request plus ``FAIR_AGING_ARRIVALS`` later ones are first scheduled
    ahead of it (the bound the docs state)."""
    monkeypatch.setattr(policy_module, "FAIR_AGING_ARRIVALS", aging)
    order, first, _ = _churn()
    for i, rid in enumerate(order):
        ahead = sum(1 for r in order if first[r] < first[rid])
        assert ahead <= i + aging, (rid, ahead, first)
    assert max(first[f"a{i}"] for i in range(12)) < 30
    monkeypatch.setattr(policy_module, "FAIR_AGING_ARRIVALS", 10**9)  # counters alone
    _, unaged, _ = _churn()
    assert sorted(unaged[f"a{i}"] for i in range(12))[4] >= 60  # A waits out the whole stream


@pytest.mark.parametrize("mode", ["swap", "recompute", None])
def test_aging_holds_when_the_served_tenant_is_preempted(monkeypatch, mode):
    """A tiny cache under churn: A's requests are preempted for newcomers. An aged group is
    preempted by rank for nobody, and one swapped out comes back before any newcomer (else it
    waited for the stream to end, and held its own tenant's aged requests behind it)."""
    monkeypatch.setattr(policy_module, "FAIR_AGING_ARRIVALS", 8)
    kw = dict(steps=150, num_a=6, a_len=(12, 12), G=12, C=64, PM=mode)
    order, first, last = _churn(**kw)
    for i, rid in enumerate(order):
        ahead = sum(1 for r in order if first[r] < first[rid])
        assert ahead <= i + 8, (rid, ahead)
    assert max(last[f"a{i}"] for i in range(6)) < 100  # A finished while the stream went on


def _chunks_after_a_newcomer(policy, **add_kw):
    """A 40-token prompt mid-prefill (16-token step budget), then an 8-token newcomer: the
    chunk each gets in the step after it arrives."""
    cc, sc = configs(BS=4, G=64, S=4, T=16, L=64, CP=True, policy=policy)
    h = Harness(cc, sc)
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    h.add("long", {"prompt_token_ids": prompt_of(1, 40)}, p, tenant="A", priority=1)
    h.step()
    h.add("new", {"prompt_token_ids": prompt_of(2, 8)}, p, **add_kw)
    h.step()
    chunks = {ssg.seq_group.request_id: ssg.token_chunk_size for ssg in h.history[-1].scheduled_seq_groups}
    h.run()
    h.assert_idle()
    return chunks


@pytest.mark.parametrize(
    "policy,add_kw",
    [("fair", dict(tenant="B")), ("priority", dict(tenant="A", priority=0))],
    ids=["fair-new-tenant", "priority-more-urgent"],
)
def test_a_running_prefill_yields_the_budget_to_a_waiting_group_ranked_ahead(policy, add_kw):
    # the newcomer's whole prompt first, the running prompt's chunk from what is left
    assert _chunks_after_a_newcomer(policy, **add_kw) == {"new": 8, "long": 8}
    # fcfs: the prompt admitted first keeps the budget; the newcomer waits for its prefill
    assert _chunks_after_a_newcomer("fcfs", **add_kw) == {"long": 16}


def test_same_tokens_under_fcfs_and_fair_on_the_simulator():
    """The policy orders work, never changes it: every request's tokens are the same."""
    h_fair, _ = _flood("fair")
    h_fcfs, _ = _flood("fcfs")
    assert {r: h_fair.tokens(r) for r in h_fair.outputs} == {r: h_fcfs.tokens(r) for r in h_fcfs.outputs}


@pytest.mark.parametrize("chunked", [False, True])
def test_share_preemption_swaps_when_the_host_pool_has_room(chunked):
    """Unset preemption mode: a share preemption is priced like ``auto`` (the default price
    makes a swap far cheaper than a re-prefill), so with host blocks free the victims are
    swapped, not recomputed; B still starts the step it arrives, the pools are conserved
    every step (Harness) and every request's tokens are those of ``fcfs``."""
    h, first = _flood("fair", CP=chunked, C=64)
    stats = h.scheduler.get_kv_cache_stats()
    assert stats["num_rank_preemptions"] >= 2
    assert stats["num_rank_swap_preemptions"] == stats["num_rank_preemptions"]
    assert stats["num_rank_recomputed_tokens"] == 0
    assert sorted(first[f"b{i}"] for i in range(4))[:2] == [2, 2]
    h_fcfs, _ = _flood("fcfs", CP=chunked, C=64)
    assert {r: h.tokens(r) for r in h.outputs} == {r: h_fcfs.tokens(r) for r in h_fcfs.outputs}


@pytest.mark.parametrize("kw", [dict(C=0), dict(C=64, PM="recompute")], ids=["no-host-pool", "recompute"])
def test_share_preemption_recomputes_without_host_room_or_when_told(kw):
    h, first = _flood("fair", **kw)
    stats = h.scheduler.get_kv_cache_stats()
    assert stats["num_rank_preemptions"] >= 2 and stats["num_rank_swap_preemptions"] == 0
    assert stats["num_rank_recomputed_tokens"] > 0
    assert sorted(first[f"b{i}"] for i in range(4))[:2] == [2, 2]


@st.composite
def fair_workloads(draw):
    n = draw(st.integers(1, 12))
    bs = draw(st.sampled_from([2, 4]))
    reqs = [
        (
            draw(st.integers(0, 8)),  # arrival step
            draw(st.sampled_from([None, "a", "b", "c"])),  # tenant
            draw(st.integers(0, 3)),  # prompt family (shared prefixes)
            draw(st.integers(1, 14)),  # prompt length
            draw(st.integers(1, 8)),  # max_tokens
            draw(st.integers(0, 2)),  # priority
        )
        for _ in range(n)
    ]
    weights = draw(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 3.0])))
    return dict(
        reqs=reqs,
        BS=bs,
        G=draw(st.integers(24 // bs + 1, 24 // bs + 8)),  # any one request fits alone
        CP=draw(st.booleans()),
        PC=draw(st.booleans()),
        PM=draw(st.sampled_from([None, "recompute", "swap"])),
        weights=weights,
        in_w=draw(st.sampled_from([0.5, 1.0])),
        out_w=draw(st.sampled_from([1.0, 2.0, 8.0])),
        burst=draw(st.sampled_from([0.0, 8.0, 2048.0])),
        partial=draw(st.sampled_from([1, 2])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fair_workloads())
def test_property_fair_random_tenants_tiny_caches(w):
    """Random arrivals, tenants, weights and tiny caches under ``fair``: the invariants hold every
    step (Harness), every request finishes, all blocks come back, the policy forgets every
    request, and no request starves: each is first scheduled within ``bound`` steps of its
    arrival, ``bound`` = the tokens of the whole workload (prompt + max_tokens, summed) -- every
    step feeds at least one token, and a waiting tenant's counter falls behind the others' until
    it is the least, so only a finite amount of work can go ahead of it."""
    cc, sc = configs(
        BS=w["BS"],
        G=w["G"],
        C=0 if w["PM"] == "recompute" else 64,
        S=4,
        T=32,
        L=24,
        CP=w["CP"],
        PC=w["PC"],
        PM=w["PM"],
        policy="fair",
        max_num_partial_prefills=w["partial"],
        fair_input_weight=w["in_w"],
        fair_output_weight=w["out_w"],
        tenant_weights=w["weights"],
        fair_burst_tokens=w["burst"],
    )
    h = Harness(cc, sc)
    pending = sorted(enumerate(w["reqs"]), key=lambda x: (x[1][0], x[0]))
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    steps = 0
    while pending or h.engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, tenant, fam, plen, mt, prio) = pending.pop(0)
            params = SamplingParams(
                max_tokens=min(mt, sc.max_model_len - plen), temperature=0, ignore_eos=True
            )
            h.add(f"r{i}", {"prompt_token_ids": prompt_of(fam, plen)}, params, priority=prio, tenant=tenant)
            arrived[f"r{i}"] = steps
        h.step()
        for ssg in h.history[-1].scheduled_seq_groups:
            first.setdefault(ssg.seq_group.request_id, steps)
        steps += 1
        assert steps < 2000, "did not drain"
    h.assert_idle()
    assert all(h.outputs[r].outcome == "finished" for r in arrived)
    bound = sum(plen + mt for _, _, _, plen, mt, _ in w["reqs"])
    waits = {r: first[r] - arrived[r] for r in arrived}
    assert max(waits.values()) <= bound, (waits, bound)
    pol = h.scheduler.policy
    assert isinstance(pol, FairPolicy)
    assert pol._members == {} and pol._backlog == {}
    # idle tenants keep an entry only while above the floor when they left (swept lazily)
    assert set(pol.counters) <= {r[1] for r in w["reqs"]}
