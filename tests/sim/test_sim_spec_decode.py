"""Speculative decoding in the simulator: the acceptance model, the emitted runs, the step
count it saves, and the KV bookkeeping (shadow cache, block conservation) under every kind of
scheduling pressure."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import EngineArgs, SpeculativeConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sim.acceptance import AcceptanceModel, alpha_for_mean, split_speculative_config
from kvserve.sim.cli import main, simulate
from kvserve.workload.workload import BenchRequest
from tests.core.simutil import Harness, configs, prompt_of

K = 4


def _requests(n, prompt_len=40, output_len=12):
    return [
        BenchRequest(
            prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(prompt_len)],
            output_len=output_len,
            arrival_s=0.0,
            id=i,
        )
        for i in range(n)
    ]


def _sim(spec, reqs, **kw):
    engine_spec, sim_spec = split_speculative_config(spec)
    args = EngineArgs(
        num_gpu_blocks=512, block_size=16, max_model_len=2048, speculative_config=engine_spec, **kw
    )
    return simulate(args, reqs, acceptance=sim_spec)


def spec(**kw):
    cfg = {"method": "ngram", "num_speculative_tokens": K}
    cfg.update(kw)
    return cfg


# -- the acceptance model ---------------------------------------------------------------------


def test_mean_accepted_len_gives_that_mean():
    for mean in (1.0, 1.5, 2.0, 3.0, 4.5, 5.0):
        m = AcceptanceModel.from_config({"mean_accepted_len": mean}, K)
        assert m.mean_accepted_len == pytest.approx(mean, abs=1e-9)
    assert alpha_for_mean(1.0, K) == pytest.approx(0.0, abs=1e-12)
    assert alpha_for_mean(K + 1.0, K) == pytest.approx(1.0, abs=1e-12)


def test_acceptance_rate_forms():
    assert AcceptanceModel.from_config({"acceptance_rate": 0.5}, 3).rates == [0.5, 0.25, 0.125]
    assert AcceptanceModel.from_config({"acceptance_rate": [0.9, 0.5]}, 3).rates == [0.9, 0.5, 0.0]
    m = AcceptanceModel.from_config({"acceptance_rate": [0.8, 0.6, 0.4, 0.2]}, K)
    assert m.mean_accepted_len == pytest.approx(3.0)
    # P(accepted >= i) = rates[i-1], read off a uniform
    assert [m.num_accepted(u, K) for u in (0.0, 0.3, 0.5, 0.7, 0.9)] == [4, 3, 2, 1, 0]
    assert m.num_accepted(0.0, 2) == 2  # never more than the drafts verified


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({}, r"acceptance_rate \(per-position acceptance\) or speculative_config.mean_accepted_len"),
        ({"acceptance_rate": 0.5, "mean_accepted_len": 2.0}, "exactly one"),
        ({"acceptance_rate": [0.5, 0.6]}, r"acceptance_rate must not increase"),
        ({"acceptance_rate": [0.5] * (K + 1)}, r"acceptance_rate must be a number or a list"),
        ({"acceptance_rate": 1.5}, r"acceptance_rate must be a number in \[0, 1\]"),
        ({"acceptance_rate": [0.5, "x"]}, r"acceptance_rate\[1\]"),
        ({"mean_accepted_len": K + 2.0}, r"mean_accepted_len must be a number in \[1, 5\]"),
        ({"mean_accepted_len": 2.0, "draft_step_s": -1}, "draft_step_s"),
    ],
)
def test_bad_acceptance_model_names_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceModel.from_config(cfg, K)


# -- step counts ------------------------------------------------------------------------------


def test_acceptance_zero_takes_as_many_steps_as_no_speculation():
    reqs = _requests(6, output_len=50)
    off = _sim(None, reqs)
    on = _sim(spec(acceptance_rate=0.0), reqs)
    assert on["num_steps"] == off["num_steps"]
    assert on["output_tokens"] == off["output_tokens"] == 6 * 50
    sd = on["spec_decode"]
    assert sd["num_draft_tokens"] > 0 and sd["num_accepted_tokens"] == 0 and sd["mean_accepted_len"] == 1.0


@pytest.mark.parametrize(
    "accept",
    [{"mean_accepted_len": 3.0}, {"acceptance_rate": [0.8, 0.6, 0.4, 0.2]}, {"mean_accepted_len": 2.0}],
)
def test_decode_steps_fall_by_the_mean_accepted_length(accept):
    out = 600
    reqs = _requests(1, output_len=out + 1)  # one prefill step (samples token 1), then decodes
    off = _sim(None, reqs)
    on = _sim(spec(disable_below_acceptance_rate=0.0, **accept), reqs)
    mean = AcceptanceModel.from_config(accept, K).mean_accepted_len
    assert off["num_steps"] == 1 + out
    ratio = out / (on["num_steps"] - 1)
    assert ratio == pytest.approx(mean, rel=0.08)
    assert on["spec_decode"]["mean_accepted_len"] == pytest.approx(mean, rel=0.08)
    assert on["output_tokens"] == off["output_tokens"]
    assert on["tpot_s"]["mean"] < off["tpot_s"]["mean"]


def test_everything_accepted_emits_k_plus_one_per_step():
    out = 100
    on = _sim(spec(mean_accepted_len=K + 1.0), _requests(1, output_len=out + 1))
    assert on["num_steps"] == 1 + -(-out // (K + 1))


def test_verify_tokens_cost_what_they_process():
    from kvserve.sim.cost_model import CostModel

    cm = CostModel()
    plain = cm.step_time(0, 8, 8000)
    verify = cm.step_time(0, 8, 8000, num_verify_tokens=8 * K)
    assert verify - plain == pytest.approx(8 * K * cm.prefill_token_s)
    reqs = _requests(1, output_len=41)
    a = _sim(spec(acceptance_rate=0.0, disable_below_acceptance_rate=0.0), reqs)
    b = _sim(spec(acceptance_rate=0.0, disable_below_acceptance_rate=0.0, draft_step_s=0.01), reqs)
    # 40 decodes at output lengths 1..40; drafts stop where max_tokens (41) would cut them
    drafts = sum(min(K, 41 - o - 1) for o in range(1, 41))
    assert b["duration_s"] - a["duration_s"] == pytest.approx(0.01 * drafts, rel=1e-6)


def test_speculation_without_acceptance_model_is_an_error():
    with pytest.raises(ValueError, match="mean_accepted_len"):
        _sim(spec(), _requests(1))


def test_cli_speculative_config(tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        "".join(
            json.dumps({"prompt_token_ids": list(range(3, 40)), "output_len": 30}) + "\n" for _ in range(4)
        )
    )
    out = tmp_path / "s.json"
    cfg = json.dumps(spec(mean_accepted_len=2.5))
    rc = main(
        [
            "--workload",
            str(wl),
            "--num-gpu-blocks",
            "256",
            "--speculative-config",
            cfg,
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["spec_decode"]["num_draft_tokens"] > 0
    assert "mean accepted length" in capsys.readouterr().out
    rc = main(["--workload", str(wl), "--num-gpu-blocks", "256", "--speculative-config", json.dumps(spec())])
    assert rc == 2
    assert "speculative_config.acceptance_rate" in capsys.readouterr().err


# -- KV bookkeeping under pressure ------------------------------------------------------------


def _run(cc, sc, requests, accept: AcceptanceModel | None, spec_cfg: SpeculativeConfig | None):
    h = Harness(cc, sc, check_kv=True)  # shadow cache, strict: a stale read raises
    h.executor.acceptance = accept
    h.engine.speculative_config = spec_cfg
    for rid, prompt, params in requests:
        h.add(rid, {"prompt_token_ids": prompt}, params)

    def lockstep(h, _step):  # a group's live sequences always have one length
        for g in h.scheduler.running:
            assert len({s.get_len() for s in g.get_unfinished_seqs()}) <= 1, g.request_id

    h.run(on_step=lockstep)
    h.assert_idle()
    return h, {rid: [c.token_ids for c in o.outputs] for rid, o in h.outputs.items()}


def _workload(n, seed, max_tokens=24):
    import random

    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = prompt_of(i % 3, rng.randrange(3, 30))  # shared heads for prefix caching
        n = 2 if rng.random() < 0.25 else 1  # n > 1 speculates in lockstep
        params = SamplingParams(
            n=n, max_tokens=rng.randrange(1, max_tokens), temperature=0.0 if n == 1 else 1.0, ignore_eos=True
        )
        reqs.append((f"r{i}", prompt, params))
    return reqs


@settings(max_examples=40, deadline=None)
@given(
    chunked=st.booleans(),
    prefix=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    blocks=st.integers(14, 40),
    k=st.integers(1, 5),
    alpha=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_property_speculation_changes_no_output_and_conserves_blocks(
    chunked, prefix, mode, blocks, k, alpha, seed
):
    """Any acceptance, any pressure: the same tokens as without speculation (the shadow cache
    never reads a rejected draft's slot), blocks conserved after every step, all freed at the
    end (``Harness`` checks both)."""
    reqs = _workload(6, seed)
    kw = dict(BS=4, G=blocks, C=64, S=4, T=16 if chunked else 64, L=64, CP=chunked, PC=prefix, PM=mode)
    _, off = _run(*configs(**kw), reqs, None, None)
    spec_cfg = SpeculativeConfig(num_speculative_tokens=k, disable_below_acceptance_rate=0.0)
    accept = AcceptanceModel([alpha ** (i + 1) for i in range(k)])
    h, on = _run(*configs(lookahead=k, **kw), reqs, accept, spec_cfg)
    assert on == off
    if any(p.max_tokens > 2 for _, _, p in reqs):
        assert h.engine.stats.spec_num_draft_tokens > 0
    if alpha == 1.0:
        assert h.engine.stats.spec_num_accepted_tokens == h.engine.stats.spec_num_draft_tokens


def test_a_missed_rollback_is_caught_by_the_shadow_cache():
    """The checker itself: after a verification that rejected its drafts, a decode that counts
    the first rejected slot as computed reads the marker, a KV-cache corruption."""
    from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
    from kvserve.sim.executor import KVCacheCorruption, SimulatedExecutor

    ex = SimulatedExecutor(1000, block_size=4, num_gpu_blocks=8, acceptance=AcceptanceModel([0.0] * K))
    params = SamplingParams(max_tokens=50, temperature=0.0)
    data = SequenceData(list(range(10, 16)))

    def md(is_prompt, chunk, spec=0):
        return SequenceGroupMetadata(
            "r", is_prompt, {0: data}, params, {0: [0, 1, 2, 3]}, chunk, num_speculative_tokens=spec
        )

    (out,) = ex.execute_model(ExecuteModelRequest([md(True, 6)]))
    data.update_num_computed_tokens(6)
    data.append_token_id(out.samples[0].output_token)
    (out,) = ex.execute_model(ExecuteModelRequest([md(False, 1, spec=K)]))
    s = out.samples[0]
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.spec_tokens) == (K, 0, [])
    data.update_num_computed_tokens(1)
    data.append_token_id(s.output_token)
    ex.execute_model(ExecuteModelRequest([md(False, 1)]))  # the right count: reads fine
    data.update_num_computed_tokens(1)
    data.append_token_id(5)
    data.append_token_id(6)
    data.update_num_computed_tokens(1)  # wrong: position 8 was a rejected draft's slot
    with pytest.raises(KVCacheCorruption, match="position 8 .* holds -2"):
        ex.execute_model(ExecuteModelRequest([md(False, 1)]))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"dynamic": True}, r"speculative_config\.dynamic does not apply to a simulation"),
        ({"prompt_lookup_min": 1}, r"speculative_config\.prompt_lookup_min does not apply"),
        ({"prompt_lookup_max": 5}, r"speculative_config\.prompt_lookup_max does not apply"),
    ],
)
def test_fields_a_simulation_cannot_use_are_refused_not_ignored(extra, match):
    """The simulator drafts k every step from its acceptance model: the engine's dynamic
    lengths and the n-gram sizes would be silently ignored (the same result either way)."""
    with pytest.raises(ValueError, match=match):
        split_speculative_config({**spec(mean_accepted_len=2.0), **extra})
    engine, _ = split_speculative_config({**spec(mean_accepted_len=2.0), "dynamic": False})
    assert engine["dynamic"] is False
    engine, _ = split_speculative_config(spec(mean_accepted_len=2.0))
    assert engine["dynamic"] is False  # the engine's default (True) would not be what is simulated
