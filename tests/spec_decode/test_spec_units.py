"""Speculative decoding without a model: the config, prompt lookup, and the scheduler's
lookahead slots (both scheduling paths, clipping, switch-off, block conservation with
random acceptance and rollback)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import EngineArgs, SpeculativeConfig
from kvserve.core.scheduler import Scheduler
from kvserve.sequence import SequenceStatus
from kvserve.spec_decode.ngram_proposer import ngram_lookup
from tests.core.simutil import configs, make_group, prompt_of


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "value, field",
    [
        ({"method": "medusa"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 65}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"model": "/x"}, "speculative_config.model"),
        ({"disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({"disable_below_acceptance_rate": 1.5}, "speculative_config.disable_below_acceptance_rate"),
        ({"acceptance_window": 0}, "speculative_config.acceptance_window"),
        ({"num_spec_tokens": 3}, "speculative_config.num_spec_tokens"),
        ("{not json", "speculative_config"),
        ("[1, 2]", "speculative_config"),
        # a field the method ignores is refused, as model with ngram (was silently dropped)
        (
            {"method": "draft_model", "model": "/x", "prompt_lookup_min": 2},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "draft_model", "model": "/x", "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_max",
        ),
        # nested past the JSON parser's depth (was RecursionError)
        ("[" * 100_000 + "]" * 100_000, "speculative_config is not valid JSON"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.from_value(value)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative_config=value)  # refused before any model is loaded


def test_speculative_config_sets_lookahead_slots():
    _, _, sc = EngineArgs(device="cpu", speculative_config='{"num_speculative_tokens": 3}').create_configs(
        256
    )
    assert sc.num_lookahead_slots == 3 and sc.spec_decode_disable_by_batch_size is None
    _, _, sc = EngineArgs(
        device="cpu", speculative_config={"num_speculative_tokens": 5, "disable_by_batch_size": 8}
    ).create_configs(256)
    assert sc.num_lookahead_slots == 5 and sc.spec_decode_disable_by_batch_size == 8
    _, _, sc = EngineArgs(device="cpu").create_configs(256)
    assert sc.num_lookahead_slots == 0
    assert SpeculativeConfig.from_value("") is None and SpeculativeConfig.from_value(None) is None


def test_cli_flag_parses_json():
    import argparse

    from kvserve.entrypoints.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args_from(ns).create_speculative_config().num_speculative_tokens == 2
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "k": 2}'])
    with pytest.raises(ValueError, match=r"speculative_config\.k"):
        engine_args_from(ns)


def test_llm_refuses_a_bad_config_before_loading():
    from kvserve import LLM

    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        LLM(model="/nonexistent/dir", speculative_config={"num_speculative_tokens": -1})


# ------------------------------------------------------------------------------ prompt lookup
def test_ngram_lookup_examples():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 1, 3, 3) == [3, 4, 1]
    assert ngram_lookup([1, 2, 3], 1, 3, 2) == []  # nothing repeats
    assert ngram_lookup([9, 1, 2, 7, 1, 2], 2, 2, 5) == [7, 1, 2]
    # longest n first: the 2-gram (5, 6) wins over the 1-gram (6)
    assert ngram_lookup([6, 0, 5, 6, 8, 5, 6], 1, 2, 1) == [8]
    assert ngram_lookup([1, 1], 1, 1, 4) == [1]
    assert ngram_lookup([4, 4], 1, 1, 0) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=0, max_size=40),
    st.integers(1, 4),
    st.integers(0, 3),
    st.integers(1, 6),
)
def test_ngram_lookup_returns_what_followed_the_earliest_longest_match(tokens, n_min, extra, k):
    n_max = n_min + extra
    drafts = ngram_lookup(tokens, n_min, n_max, k)
    L = len(tokens)
    # the reference: brute force, longest n first, earliest start
    expected = []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if starts:
            expected = tokens[starts[0] + n : starts[0] + n + k]
            break
    assert drafts == expected
    assert len(drafts) <= k


# ------------------------------------------------------------------------------ scheduler
def _step(sched, accept=None, rng=None):
    """One hand-driven step: schedule, mark computed, then per sampled sequence append
    ``1 + a`` tokens (``a`` accepted drafts, at most its lookahead) and roll the computed count
    to the last accepted position, as the engine does. Returns (metas, outputs)."""
    metas, out = sched.schedule()
    sched.mark_computed(out)
    for ssg, m in zip(out.scheduled_seq_groups, metas):
        if not m.do_sample:
            continue
        assert m.num_speculative_tokens == ssg.num_lookahead_slots
        if m.is_prompt:
            assert m.num_speculative_tokens == 0
        g = ssg.seq_group
        for s in g.get_seqs(SequenceStatus.RUNNING):
            la = m.num_speculative_tokens
            a = 0 if not la else (accept if accept is not None else rng.randint(0, la))
            a = min(a, g.sampling_params.max_tokens - s.get_output_len() - 1)
            for _ in range(a + 1):
                s.append_token_id(rng.randrange(1000) if rng else 5)
            if a:
                s.data.update_num_computed_tokens(a)
            if s.get_output_len() >= g.sampling_params.max_tokens:
                s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                sched.free_seq(s)
    sched.free_finished_seq_groups()
    sched.block_manager.check_invariants()
    return metas, out


@pytest.mark.parametrize("CP", [False, True])
def test_decodes_reserve_lookahead_and_prefills_none(CP):
    cc, sc = configs(G=64, BS=4, lookahead=3, CP=CP)
    sched = Scheduler(sc, cc)
    g = make_group("a", prompt_of(1, 8), max_tokens=30)
    sched.add_seq_group(g)
    metas, out = _step(sched, accept=0)
    assert metas[0].is_prompt and metas[0].num_speculative_tokens == 0 and out.num_lookahead_slots == 0
    metas, out = _step(sched, accept=3)
    assert not metas[0].is_prompt and metas[0].num_speculative_tokens == 3 and out.num_lookahead_slots == 3
    seq = g.get_seqs()[0]
    # that decode fed position 8 and reserved slots 9..11: 12 slots = 3 blocks
    assert seq.get_len() == 13 and seq.data.get_num_computed_tokens() == 12
    metas, _ = _step(sched, accept=0)
    # next decode feeds position 12 and reserves 13..15
    assert len(sched.block_manager.get_block_table(seq)) == 4


def test_lookahead_is_clipped_at_max_model_len():
    cc, sc = configs(G=64, BS=4, lookahead=4, L=12)
    sched = Scheduler(sc, cc)
    sched.add_seq_group(make_group("a", prompt_of(1, 8), max_tokens=4))
    _step(sched, accept=0)  # prefill: len 9
    metas, _ = _step(sched, accept=0)
    assert metas[0].num_speculative_tokens == 3  # positions up to 11 = max_model_len - 1
    metas, _ = _step(sched, accept=0)
    assert metas[0].num_speculative_tokens == 2


def test_disable_by_batch_size_and_per_group_switches():
    cc, sc = configs(G=128, BS=4, lookahead=2)
    sc.spec_decode_disable_by_batch_size = 2
    sched = Scheduler(sc, cc)
    groups = [make_group(f"g{i}", prompt_of(i, 5), max_tokens=6) for i in range(3)]
    for g in groups:
        sched.add_seq_group(g)
    _step(sched, accept=0)
    metas, out = _step(sched, accept=0)
    assert len(metas) == 3 and all(m.num_speculative_tokens == 0 for m in metas)
    assert out.num_lookahead_slots == 0
    sched.abort_seq_group("g2")
    metas, _ = _step(sched, accept=0)
    assert [m.num_speculative_tokens for m in metas] == [2, 2]
    groups[1].spec_decode_disabled = True  # the engine's per-request switch
    metas, _ = _step(sched, accept=0)
    assert {m.request_id: m.num_speculative_tokens for m in metas} == {"g0": 2, "g1": 0}


def test_groups_with_several_live_sequences_speculate_together():
    cc, sc = configs(G=128, BS=4, lookahead=2, C=32)
    sched = Scheduler(sc, cc)
    g = make_group("multi", prompt_of(1, 5), n=2, max_tokens=6)
    sched.add_seq_group(g)
    metas, out = sched.schedule()
    sched.mark_computed(out)
    parent = g.get_seqs()[0]
    child = parent.fork(999_001)
    g.add(child)
    sched.fork_seq(parent, child)
    g.forked = True
    for s in g.get_seqs():
        s.append_token_id(3)
    metas, out = sched.schedule()
    assert metas[0].num_speculative_tokens == 2 and len(metas[0].seq_data) == 2
    for s in g.get_seqs():  # both got slots for positions len-1 .. len+1
        assert len(sched.block_manager.get_block_table(s)) * 4 >= s.get_len() + 2


def test_lookahead_is_dropped_before_anyone_is_preempted():
    """When the lookahead does not fit but the plain decode does, the group decodes plainly and
    nobody is preempted."""
    cc, sc = configs(G=6, BS=4, lookahead=4)
    sched = Scheduler(sc, cc)
    a, b = make_group("a", prompt_of(1, 11), max_tokens=3), make_group("b", prompt_of(2, 11), max_tokens=3)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    _step(sched, accept=0)  # 2 x 3 blocks: the pool is full; len 12 each
    metas, out = sched.schedule()
    # each decode writes position 11 (in its 3rd block): no growth; lookahead would need more
    assert [m.num_speculative_tokens for m in metas] == [0, 0]
    assert out.preempted == 0 and sched.num_preemptions == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    CP=st.booleans(),
    PC=st.booleans(),
    PM=st.sampled_from(["recompute", "swap"]),
    G=st.integers(12, 40),
    k=st.integers(1, 5),
)
def test_random_acceptance_conserves_blocks_and_drains(seed, CP, PC, PM, G, k):
    """Random arrivals and random acceptance with rollback, tiny caches, every mode: blocks are
    conserved after every step, prefix-cache registration never covers an uncomputed token, and
    everything drains with no block in use."""
    rng = random.Random(seed)
    cc, sc = configs(G=G, C=64, BS=4, lookahead=k, CP=CP, PC=PC, PM=PM, T=32, L=64)
    sched = Scheduler(sc, cc)
    shared = prompt_of(99, 8)
    pending = [
        make_group(
            f"r{i}",
            (shared if rng.random() < 0.5 else []) + prompt_of(i, rng.randint(1, 12)),
            max_tokens=rng.randint(1, 20),
        )
        for i in range(8)
    ]
    bm = sched.block_manager
    for _ in range(600):
        if pending and rng.random() < 0.4:
            sched.add_seq_group(pending.pop())
        if not pending and not sched.has_unfinished_seqs():
            break
        _step(sched, rng=rng)
        for g in sched.running:
            for s in g.get_unfinished_seqs():
                assert s.data.get_num_computed_tokens() <= s.get_len()
                assert bm._num_marked.get(s.seq_id, 0) * 4 <= s.data.get_num_computed_tokens()
    else:
        raise AssertionError("did not drain")
    stats = bm.get_stats()
    assert stats["num_free_gpu_blocks"] == G
    assert stats["num_free_cpu_blocks"] == 64


def test_lookahead_counts_against_the_token_budget():
    """A speculative decode feeds 1 + lookahead tokens: the step budget counts them, and a
    decode gets only the lookahead that fits."""
    cc, sc = configs(G=128, BS=4, lookahead=4, T=12)
    sched = Scheduler(sc, cc)
    for i in range(3):
        sched.add_seq_group(make_group(f"g{i}", prompt_of(i, 4), max_tokens=8))
    _step(sched, accept=0)
    metas, out = sched.schedule()
    # 12 tokens: the first two decodes take 5 each, the third what is left (2: 1 + 1 slot)
    assert [m.num_speculative_tokens for m in metas] == [4, 4, 1]
    assert out.num_batched_tokens == 12


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.integers(1, 6))
def test_suffix_matches_counts_each_earlier_match_length(tokens, n_max):
    import numpy as np

    from kvserve.spec_decode.ngram_proposer import suffix_matches

    ends, lengths = suffix_matches(np.asarray(tokens, dtype=np.int64), n_max)
    L = len(tokens)
    expected = {}
    for i in range(L - 1):
        n = 0
        while n < min(n_max, L - 1) and i - n >= 0 and tokens[i - n] == tokens[L - 1 - n]:
            n += 1
        if n:
            expected[i] = n
    assert dict(zip(ends.tolist(), lengths.tolist())) == expected


def test_generate_cli_reports_the_draft_counts(tiny_llama_dir, capsys):
    """``kvserve generate --speculative-config`` prints the run's draft and accepted tokens
    (the requests' own counts summed). The target as its own greedy draft model: every draft
    is accepted."""
    import json
    import re

    from kvserve.entrypoints import cli

    argv = ["generate", "--prompt", "Hello there", "--max-tokens", "16", "--ignore-eos"]
    argv += ["--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32"]
    spec = {
        "method": "draft_model",
        "model": str(tiny_llama_dir),
        "num_speculative_tokens": 3,
        "dynamic": False,
    }
    assert cli.main([*argv, "--speculative-config", json.dumps(spec)]) == 0
    m = re.search(
        r"speculative decoding: (\d+) draft tokens proposed, (\d+) accepted \(100% accepted\)",
        capsys.readouterr().out,
    )
    assert m is not None and int(m[1]) == int(m[2]) > 0
    assert cli.main(argv) == 0  # without speculation: no such line
    assert "speculative decoding:" not in capsys.readouterr().out
