"""The dynamic draft-length policy without a model: the allocator (properties: within the
reserved slots, 0 drafts when rows are expensive, deterministic, optimal for one sequence),
the online step-cost model, the acceptance estimator, and the policy's cut / limit of a step."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.spec_decode.draft_policy import DynamicDraftPolicy, base_rows
from kvserve.spec_decode.goodput import (
    AcceptanceEstimator,
    DraftCandidate,
    StepCostModel,
    allocate_draft_lengths,
    expected_tokens,
)
from kvserve.spec_decode.interfaces import Proposal


def linear(a, b):
    return lambda rows: a + b * rows


candidates_st = st.lists(
    st.tuples(st.integers(0, 8), st.floats(0.0, 1.0, allow_nan=False)), min_size=0, max_size=12
).map(lambda xs: [DraftCandidate(i, m, p) for i, (m, p) in enumerate(xs)])


def goodput(cands, ks, base, cost, depth_cost=0.0):
    tokens = sum(expected_tokens(c.p_accept, ks[c.seq_id]) for c in cands)
    depth = max(ks.values(), default=0)
    return tokens / (cost(base + sum(ks.values())) + depth_cost * depth)


# ------------------------------------------------------------------------------ allocator
@settings(max_examples=200, deadline=None)
@given(candidates_st, st.integers(0, 64), st.floats(1e-4, 1.0), st.floats(0.0, 1.0))
def test_allocator_stays_within_the_reserved_slots(cands, base, a, b):
    ks = allocate_draft_lengths(cands, base, linear(a, b))
    assert set(ks) == {c.seq_id for c in cands}
    for c in cands:
        assert 0 <= ks[c.seq_id] <= c.max_drafts


@settings(max_examples=200, deadline=None)
@given(candidates_st, st.integers(0, 64), st.floats(1e-4, 1.0), st.floats(0.0, 1.0))
def test_allocator_is_deterministic(cands, base, a, b):
    first = allocate_draft_lengths(cands, base, linear(a, b))
    assert all(allocate_draft_lengths(cands, base, linear(a, b)) == first for _ in range(3))


@settings(max_examples=200, deadline=None)
@given(candidates_st, st.integers(1, 64), st.floats(1e-3, 1.0))
def test_allocator_gives_no_drafts_when_a_row_costs_more_than_a_draft_can_return(cands, base, a):
    # Each extra row costs ten times the whole step: n sequences' k drafts return at most
    # n + k tokens for 1 + 10k times the cost, never better than n tokens for 1.
    def cost_heavy(rows):
        return a * base + 10 * a * base * (rows - base)

    assert all(k == 0 for k in allocate_draft_lengths(cands, base, cost_heavy).values())


@settings(max_examples=200, deadline=None)
@given(candidates_st, st.integers(0, 64), st.floats(1e-4, 1.0), st.floats(0.0, 0.2))
def test_allocator_never_does_worse_than_no_drafts(cands, base, a, b):
    cost = linear(a, b)
    ks = allocate_draft_lengths(cands, base, cost)
    none = {c.seq_id: 0 for c in cands}
    if cands:
        assert goodput(cands, ks, base, cost) >= goodput(cands, none, base, cost) * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.floats(0.0, 1.0), st.integers(0, 8), st.floats(1e-3, 1.0), st.floats(0.0, 0.5))
def test_allocator_is_optimal_for_one_sequence(m, p, base, a, b):
    cost = linear(a, b)
    cands = [DraftCandidate(0, m, p)]
    got = goodput(cands, allocate_draft_lengths(cands, base, cost), base, cost)
    best = max(goodput(cands, {0: k}, base, cost) for k in range(m + 1))
    assert got >= best * (1 - 1e-9)


def test_allocator_matches_brute_force_on_small_batches():
    cost = linear(1.0, 0.06)
    for ps in itertools.product([0.1, 0.5, 0.9], repeat=3):
        cands = [DraftCandidate(i, 4, p) for i, p in enumerate(ps)]
        got = goodput(cands, allocate_draft_lengths(cands, 3, cost), 3, cost)
        best = max(
            goodput(cands, dict(enumerate(ks)), 3, cost) for ks in itertools.product(range(5), repeat=3)
        )
        assert got >= best * (1 - 1e-9), ps


def test_cheap_rows_get_full_drafts_and_dear_rows_only_likely_ones():
    # Batch 1, a verify row ~2% of a step (the measured 1.09x for 5 rows): full k.
    one = [DraftCandidate(0, 4, 0.5)]
    assert allocate_draft_lengths(one, 1, linear(1.0, 0.02)) == {0: 4}
    # Batch 8, compute-bound rows: only the sequence whose drafts are likely accepted drafts.
    eight = [DraftCandidate(i, 4, 0.9 if i == 3 else 0.2) for i in range(8)]
    ks = allocate_draft_lengths(eight, 8, linear(0.5, 0.0625))
    assert ks[3] >= 3 and all(ks[i] == 0 for i in range(8) if i != 3)
    # 64 sequences, each row 1/64 of a step, nothing likely: nothing proposed (equals off).
    many = [DraftCandidate(i, 4, 0.3) for i in range(64)]
    assert sum(allocate_draft_lengths(many, 64, linear(0.0, 1 / 64)).values()) == 0


def test_allocator_caps_and_explores():
    cands = [DraftCandidate(i, 4, 0.9) for i in range(4)]
    assert sum(allocate_draft_lengths(cands, 4, linear(1.0, 0.0), max_total=5).values()) == 5
    none = allocate_draft_lengths(cands, 4, linear(0.0, 1.0))
    assert sum(none.values()) == 0
    explored = allocate_draft_lengths(cands, 4, linear(0.0, 1.0), explore_extra=4)
    assert sum(explored.values()) == 4 and all(k <= 4 for k in explored.values())


def test_depth_cost_shortens_a_sequential_proposer():
    cands = [DraftCandidate(0, 4, 0.6)]
    assert allocate_draft_lengths(cands, 1, linear(1.0, 0.0))[0] == 4
    assert allocate_draft_lengths(cands, 1, linear(1.0, 0.0), depth_cost=1.0)[0] == 0


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5.0


# ------------------------------------------------------------------------------ cost model
def test_cost_model_prior_then_observed_buckets():
    cm = StepCostModel(prior_base_s=0.1, prior_row_fraction=0.05)
    assert cm.cost(1) == pytest.approx(0.1) and cm.cost(21) == pytest.approx(0.2)
    cm.observe(8, 0.05)
    assert cm.cost(8) == pytest.approx(0.05)
    # one bucket: the prior slope relative to it
    assert cm.cost(28) == pytest.approx(0.05 + 0.05 * 0.05 * 20)
    cm.observe(40, 0.15)
    assert cm.cost(24) == pytest.approx(0.10)  # interpolated
    assert cm.cost(72) == pytest.approx(0.15 + (0.10 / 32) * 32)  # least-squares slope
    assert cm.num_buckets() == 2 and cm.is_observed(40) and not cm.is_observed(41)


def test_cost_model_ignores_bad_samples_and_is_monotone():
    cm = StepCostModel()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cm.observe(4, bad)
    cm.observe(0, 1.0)
    assert cm.num_buckets() == 0
    cm.observe(4, 0.2)
    cm.observe(6, 0.1)  # a noisy sample cheaper than fewer rows
    assert cm.cost(6) >= cm.cost(4) == pytest.approx(0.2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.floats(1e-4, 10.0)), max_size=30), st.integers(1, 4000))
def test_cost_model_is_positive_and_non_decreasing(samples, rows):
    cm = StepCostModel()
    for r, s in samples:
        cm.observe(r, s)
    assert 0 < cm.cost(rows) <= cm.cost(rows + 1) + 1e-12


def test_cost_model_buckets_large_row_counts():
    cm = StepCostModel()
    cm.observe(1000, 1.0)
    assert cm.is_observed(1001) and cm.num_buckets() == 1


# ------------------------------------------------------------------------------ acceptance
def test_acceptance_prior_prefers_longer_matches_and_learns():
    est = AcceptanceEstimator()
    assert est.estimate(1, 1) < est.estimate(1, 2) < est.estimate(1, 3) <= est.estimate(1, 4)
    for _ in range(10):
        est.observe(1, 2, 4, 4)  # always all accepted
        est.observe(2, 2, 4, 0)  # never
    assert est.estimate(1, 2) > 0.8 and est.estimate(2, 2) < 0.2
    est.free([1])
    assert 0.2 < est.estimate(1, 2) < 0.8  # back to the (pooled) prior


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(0, 8)), max_size=40))
def test_acceptance_estimate_is_a_probability(obs):
    est = AcceptanceEstimator()
    for ml, m, a in obs:
        est.observe(7, ml or None, m, a)
        assert 0.0 <= est.estimate(7, ml or None) <= est.max_p


# ------------------------------------------------------------------------------ policy
def _decode_md(seq_id, out_len=3, slots=4, max_tokens=100):
    data = SequenceData(list(range(10)))
    for t in range(out_len):
        data.append_token_id(t, 0.0)
    data.set_num_computed_tokens(data.get_len() - 1)
    return SequenceGroupMetadata(
        request_id=f"r{seq_id}",
        is_prompt=False,
        seq_data={seq_id: data},
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        block_tables={seq_id: [0, 1, 2, 3]},
        token_chunk_size=1,
        num_speculative_tokens=slots,
    )


def test_policy_cuts_full_proposals_within_slots_and_max_tokens():
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    pol.cost_model.observe(1, 1.0)
    pol.cost_model.observe(2, 1.0)
    pol.cost_model.observe(40, 1.0)  # rows are free: take everything allowed
    metas = [_decode_md(1), _decode_md(2, slots=2), _decode_md(3, out_len=3, max_tokens=5)]
    props = {sid: Proposal([5, 6, 7, 8], match_len=3) for sid in (1, 2, 3)}
    cut = pol.cut_proposals(metas, props)
    assert {sid: len(p.token_ids) for sid, p in cut.items()} == {1: 4, 2: 2, 3: 1}
    assert all(p.match_len == 3 for p in cut.values())
    assert base_rows(metas) == 3 and pol.mean_draft_length == pytest.approx(7 / 3)


def test_policy_drops_drafts_when_rows_are_dear():
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    for r in range(1, 50):
        pol.cost_model.observe(r, 0.01 * r)  # every row a whole decode's cost
    metas = [_decode_md(i) for i in range(8)]
    props = {i: Proposal([1, 2, 3, 4], match_len=4) for i in range(8)}
    assert pol.cut_proposals(metas, props) == {}


def test_policy_limits_a_costly_proposers_request():
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    for r in range(1, 50):
        pol.cost_model.observe(r, 0.01 * r)
    metas = [_decode_md(i) for i in range(3)]
    req = ExecuteModelRequest(seq_group_metadata_list=metas)
    limited = pol.limit_request(req)
    assert [md.num_speculative_tokens for md in limited.seq_group_metadata_list] == [0, 0, 0]
    assert [md.num_speculative_tokens for md in metas] == [4, 4, 4]  # the original untouched
    cheap = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    cheap.cost_model.observe(1, 1.0)
    cheap.cost_model.observe(20, 1.0)
    assert [md.num_speculative_tokens for md in cheap.limit_request(req).seq_group_metadata_list] == [4, 4, 4]


def test_policy_learns_a_sequence_that_never_accepts():
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    pol.cost_model.observe(1, 1.0)
    pol.cost_model.observe(5, 1.1)  # the measured batch-1 shape: 5 rows 1.1x one row
    metas = [_decode_md(1)]
    props = {1: Proposal([1, 2, 3, 4], match_len=2)}
    assert len(pol.cut_proposals(metas, props)[1].token_ids) == 4
    for _ in range(20):
        pol.cut_proposals(metas, props)
        pol.observe_verified({1: 4}, {1: 0})
    # p ~ 0.1 now: at 2.5% per row one draft still pays (1.1 tokens for 1.025x), no more.
    assert len(pol.cut_proposals(metas, props)[1].token_ids) == 1
    pol.cost_model.observe(2, 1.2)  # a dearer row: not even one
    assert pol.cut_proposals(metas, props) == {}
