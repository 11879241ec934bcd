"""Steps past a cost model's profiled range: a bounded prediction, and a loud report of them."""

import json
import math
from types import SimpleNamespace

import pytest

from kvserve.sim.cli import main as simulate_main
from kvserve.sim.cost_model import PAIRS_PER_CHUNK, CostModel, profile_ranges
from kvserve.sim.cost_model_file import save_cost_model
from kvserve.sim.extrapolation import TRUST_SHARE, extrapolation_report, warning_block
from kvserve.sim.step_shape import StepShape
from tests.sim.test_cost_model_file import profile_data


def _chunk(q: int, computed: int = 0, n: int = 1) -> StepShape:
    """``n`` prompt chunks of ``q`` tokens after ``computed`` cached ones each."""
    pairs = n * (q * computed + q * (q + 1) / 2) / 1000.0
    return StepShape(prefill_tokens=n * q, prefill_seqs=n, prefill_attn_pairs=pairs, sampled_rows=n)


def _attention_only(ranges=None) -> CostModel:
    return CostModel(
        base_s=0.01,
        prefill_token_s=0.0,
        decode_seq_s=0.0,
        context_token_s=0.0,
        prefill_attn_s=0.2,
        ranges=ranges,
    )


def test_attention_past_the_profiled_chunks_grows_linearly_from_the_edge():
    profiled = [_chunk(q) for q in (8, 32, 96)] + [_chunk(96, n=2)]
    ranges = profile_ranges(profiled)
    assert ranges[PAIRS_PER_CHUNK] == pytest.approx(_chunk(96).prefill_attn_pairs)
    assert ranges["prefill_attn_pairs"] == pytest.approx(2 * ranges[PAIRS_PER_CHUNK])
    bounded, fitted = _attention_only(ranges), _attention_only()
    # inside the range both are the fitted quadratic
    for s in profiled:
        assert bounded.step_cost(s) == pytest.approx(fitted.step_cost(s))
    edge = _chunk(96)
    e = edge.prefill_attn_pairs
    costs = [bounded.step_cost(_chunk(96 * m)) for m in range(1, 86)]  # up to 8,160 tokens
    steps = [b - a for a, b in zip(costs, costs[1:])]
    # each further 96 tokens costs the same: the quadratic's slope at the edge (d pairs / dq = q),
    # 96 tokens of it: 2 * E pairs (up to the +1 of q(q+1)/2)
    slope = 0.2 * 2 * e
    for d in steps:
        assert d == pytest.approx(slope, rel=0.02)
    far = _chunk(96 * 85)
    assert bounded.step_cost(far) < fitted.step_cost(far) / 40  # not the ~85**2 blow-up
    assert bounded.step_cost(far) == pytest.approx(0.01 + 0.2 * e * (2 * 85 - 1), rel=0.02)
    # a long prompt's late chunk (context past the range too) stays below the quadratic
    late = _chunk(2048, computed=6144)
    assert bounded.step_cost(edge) < bounded.step_cost(late) < fitted.step_cost(late)


def test_many_chunks_each_within_the_profiled_size_are_not_damped():
    ranges = profile_ranges([_chunk(96)])
    bounded = _attention_only(ranges)
    many = _chunk(96, n=20)  # 20x the profiled pairs per step, but each chunk within the edge
    assert bounded.attention_pairs(many) == pytest.approx(many.prefill_attn_pairs)
    assert bounded.outside_range(many)  # still flagged: no step this large was measured
    assert _attention_only().attention_pairs(_chunk(9000)) == pytest.approx(_chunk(9000).prefill_attn_pairs)


def test_old_files_without_pairs_per_chunk_use_the_step_maximum():
    ranges = {"prefill_tokens": 192, "prefill_attn_pairs": 9.312}
    s = _chunk(2048)
    r = math.sqrt(s.prefill_attn_pairs / 9.312)
    assert _attention_only(ranges).attention_pairs(s) == pytest.approx(9.312 * (2 * r - 1))


def _fake_executor(**kw):
    base = dict(
        busy_time_s=100.0,
        extrapolated_time_s=2.0,
        num_extrapolated_steps=3,
        num_steps=400,
        largest={"prefill_tokens": 8192, "prefill_attn_pairs": 50.0, "decode_seqs": 4, "context_tokens": 10},
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_report_names_counts_share_and_how_far_past():
    cm = CostModel(ranges={"prefill_tokens": 512, "prefill_attn_pairs": 20.0, "decode_seqs": 8})
    rep = extrapolation_report(cm, _fake_executor())
    assert (rep["steps"], rep["of_steps"]) == (3, 400)
    assert rep["share"] == pytest.approx(0.02) and rep["trustworthy"]
    assert [p["count"] for p in rep["past"]] == ["prefill_tokens", "prefill_attn_pairs"]
    text = warning_block(rep)
    assert text.startswith("=") and text.endswith("=")
    assert "3 of 400 steps (2.0% of the simulated busy time" in text
    assert "prompt tokens per step up to 8,192, profiled up to 512" in text
    assert "prompt attention pairs per step up to 50,000, profiled up to 20,000" in text
    assert "NOT TRUSTWORTHY" not in text and f"within {TRUST_SHARE:.0%}" in text
    bad = extrapolation_report(cm, _fake_executor(extrapolated_time_s=60.0))
    assert not bad["trustworthy"] and "NOT TRUSTWORTHY" in warning_block(bad)
    assert warning_block(extrapolation_report(cm, _fake_executor(num_extrapolated_steps=0))) == ""


def _small_profile(tmp_path):
    small = profile_data(
        profile={
            "ranges": {
                "prefill_tokens": 16,
                "prefill_attn_pairs": 0.136,
                "decode_seqs": 2,
                "context_tokens": 40,
            }
        }
    )
    path = tmp_path / "small.json"
    save_cost_model(path, small)
    return path


def test_simulate_prints_the_warning_above_and_below_the_figures(tmp_path, capsys):
    path = _small_profile(tmp_path)
    out_json = tmp_path / "s.json"
    assert simulate_main(["--cost-model", str(path), "--num-requests", "6", "--json-out", str(out_json)]) == 0
    out = capsys.readouterr().out
    s = json.loads(out_json.read_text())
    ex = s["extrapolation"]
    assert ex["steps"] == s["num_extrapolated_steps"] > 0 and ex["of_steps"] == s["num_steps"]
    assert ex["share"] == pytest.approx(ex["time_s"] / ex["busy_time_s"]) and ex["share"] > TRUST_SHARE
    head = f"WARNING: EXTRAPOLATED FIGURES: {ex['steps']:,} of {ex['of_steps']:,} steps ({ex['share']:.1%}"
    assert out.count(head) == 2
    lines = out.splitlines()
    first, last = (i for i, ln in enumerate(lines) if ln.startswith("WARNING: EXTRAPOLATED"))
    table = next(i for i, ln in enumerate(lines) if ln.startswith("ttft_s"))
    assert first < table < last
    tokens = next(p for p in ex["past"] if p["count"] == "prefill_tokens")
    assert f"prompt tokens per step up to {tokens['largest']:,.0f}, profiled up to 16" in out
    assert "NOT TRUSTWORTHY" in out


def test_refuse_extrapolation_exits_2_with_the_warning_and_no_figures(tmp_path, capsys):
    path = _small_profile(tmp_path)
    out_json = tmp_path / "s.json"
    argv = ["--cost-model", str(path), "--num-requests", "6", "--refuse-extrapolation"]
    assert simulate_main([*argv, "--json-out", str(out_json)]) == 2
    cap = capsys.readouterr()
    assert "Error: --refuse-extrapolation" in cap.err and "NOT TRUSTWORTHY" in cap.err
    assert "WARNING: EXTRAPOLATED FIGURES" in cap.err
    assert "ttft_s" not in cap.out and not out_json.exists()
    roomy = tmp_path / "roomy.json"
    save_cost_model(roomy, profile_data())
    assert simulate_main(["--cost-model", str(roomy), "--num-requests", "6", "--refuse-extrapolation"]) == 0
    out = capsys.readouterr().out
    assert "ttft_s" in out and "WARNING" not in out
