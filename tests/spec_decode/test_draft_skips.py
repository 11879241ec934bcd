"""Skipped draft opportunities: the dynamic policy says when and why it drafts nothing (one log
line per request, a counter by reason, the per-request count), and dynamic=false forces drafts."""

from __future__ import annotations

import logging
import random

import pytest

from kvserve.engine.prometheus import EngineCollector
from kvserve.sequence import ExecuteModelRequest
from kvserve.spec_decode import draft_policy
from kvserve.spec_decode.draft_policy import SKIP_GOODPUT, DynamicDraftPolicy
from tests.spec_decode.test_draft_model_engine import draft, drain, make_engine
from tests.spec_decode.test_goodput_policy import _decode_md
from tests.spec_decode.test_spec_decode_engine import _FixedCost

LOGGER = "kvserve.spec_decode"


def _dear_policy() -> DynamicDraftPolicy:
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    for r in range(1, 50):
        pol.cost_model.observe(r, 0.01 * r)  # every row a whole decode's cost: no draft pays
    return pol


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if "drafting off" in r.getMessage()]


def test_policy_names_each_skipped_request_once_with_its_figures(caplog):
    pol = _dear_policy()
    req = ExecuteModelRequest(seq_group_metadata_list=[_decode_md(1), _decode_md(2)])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pol.limit_request(req)
    assert pol.skip_reasons == {1: SKIP_GOODPUT, 2: SKIP_GOODPUT}
    (line,) = _lines(caplog)  # one request named; the other waits for the rate limit
    assert line.startswith("draft model: drafting off for request r1:")
    assert "expected to give" in line and "x the tokens/s of a plain step, not above 1.0" in line
    assert "2 decodes in the batch" in line and "speculative_config.dynamic=false" in line
    ratio = float(line.split("expected to give ")[1].split("x")[0])
    assert 0 < ratio <= 1.0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        pol.limit_request(req)  # within the interval: nothing
        assert _lines(caplog) == []
        pol._last_log -= draft_policy.LOG_INTERVAL_S  # the interval has passed
        pol.limit_request(req)
        pol._last_log -= draft_policy.LOG_INTERVAL_S
        pol.limit_request(req)  # both named now: no third line
    lines = _lines(caplog)
    assert len(lines) == 1 and "request r2:" in lines[0]


def test_policy_records_no_skip_when_it_drafts():
    pol = DynamicDraftPolicy(4, explore_interval=0, warmup_steps=0)
    pol.cost_model.observe(1, 1.0)
    pol.cost_model.observe(20, 1.0)  # rows are free
    req = ExecuteModelRequest(seq_group_metadata_list=[_decode_md(1)])
    assert pol.limit_request(req).seq_group_metadata_list[0].num_speculative_tokens == 4
    assert pol.skip_reasons == {}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 13, 9)]


def _skip_counter(engine) -> dict[str, float]:
    fam = next(
        m
        for m in EngineCollector(engine, "tiny").collect()
        if m.name == "kvserve:spec_decode_num_skipped_draft_opportunities"
    )
    return {s.labels["reason"]: s.value for s in fam.samples if s.name.endswith("_total")}


def test_a_draft_model_the_policy_finds_too_dear_is_logged_counted_and_forced_by_dynamic_off(
    tiny_llama_dir, prompts, caplog
):
    engine = make_engine(tiny_llama_dir, draft(tiny_llama_dir, dynamic=True))
    pol = engine.executor.policy
    pol.cost_model = _FixedCost(1.0, None)  # every extra row multiplies the step's cost: no draft pays
    with caplog.at_level(logging.INFO, logger=LOGGER):
        finals = drain(engine, prompts)
    lines = _lines(caplog)
    assert lines and lines[0].startswith("draft model: drafting off for request r")
    st = engine.stats
    assert st.spec_num_draft_tokens == 0 and st.spec_num_draft_opportunities > 0
    skipped = dict(st.spec_skipped_by_reason)
    # every opportunity skipped: by the policy, or (a request's last token) for max_tokens
    assert set(skipped) == {SKIP_GOODPUT, "max_tokens"} and skipped["max_tokens"] <= len(prompts)
    assert sum(skipped.values()) == st.spec_num_draft_opportunities
    assert _skip_counter(engine) == {k: float(v) for k, v in skipped.items()}
    per_request = [o.spec_num_skipped_steps for o in finals.values()]
    assert all(n > 0 for n in per_request) and sum(per_request) == st.spec_num_draft_opportunities
    assert all(o.spec_num_draft_tokens == 0 for o in finals.values())

    forced = make_engine(tiny_llama_dir, draft(tiny_llama_dir, dynamic=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        finals = drain(forced, prompts)
    assert _lines(caplog) == []
    st = forced.stats
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    assert SKIP_GOODPUT not in st.spec_skipped_by_reason
    # the only skips left: a request's last token (no draft could be emitted after it)
    assert set(st.spec_skipped_by_reason) <= {"max_tokens"}
    assert all(o.spec_num_draft_tokens > 0 for o in finals.values())


def test_the_draft_models_first_calls_do_not_price_its_positions():
    """A cold first drafting call (one-time costs, prompt catch-up) is not taken as the draft's
    per-position cost: learned from, it priced drafts out for good (none, so no new sample)."""
    pol = DynamicDraftPolicy(4, warmup_steps=2)
    pol.observe_proposer(4, 2.0)
    pol.observe_proposer(4, 1.0)
    assert pol.depth_cost_s == 0.0
    pol.observe_proposer(4, 0.08)
    pol.observe_proposer(0, 5.0)  # no drafts: nothing learned
    assert pol.depth_cost_s == pytest.approx(0.02)
    pol.observe_proposer(2, 0.08)
    assert pol.depth_cost_s == pytest.approx(0.02 + 0.2 * (0.04 - 0.02))
