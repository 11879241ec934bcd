"""The online goodput benchmark's verdict: which rates count as within the SLO, and the two ratios
it reports (no server)."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "online_goodput.py"
_spec = importlib.util.spec_from_file_location("online_goodput", _PATH)
og = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(og)


def run(rate, good_fraction, goodput):
    return {"request_rate": rate, "summary": {"good_fraction": good_fraction, "goodput_req_s": goodput}}


def test_highest_good_rate_takes_the_highest_rate_at_ninety_percent_or_more():
    runs = [run(0.5, 1.0, 0.5), run(1.0, 0.9, 0.9), run(2.0, 0.89, 1.5), run(4.0, 0.95, 3.0)]
    assert og.highest_good_rate(runs) == 4.0  # not monotone: the highest that met it
    assert og.highest_good_rate(runs[:3]) == 1.0
    assert og.highest_good_rate([run(1.0, 0.5, 0.5)]) is None


def test_verdict_compares_goodput_at_vllms_rate_and_the_rates_themselves():
    k = [run(0.5, 1.0, 0.5), run(1.0, 1.0, 1.0), run(2.0, 0.95, 1.9)]
    v = [run(0.5, 1.0, 0.5), run(1.0, 0.92, 0.8), run(2.0, 0.4, 0.7)]
    out = og.verdict({"kvserve": k, "vllm": v})
    assert out["vllm_highest_good_rate"] == 1.0 and out["kvserve_highest_good_rate"] == 2.0
    assert out["goodput_ratio_at_vllm_rate"] == pytest.approx(1.0 / 0.8)
    assert out["good_rate_ratio"] == pytest.approx(2.0)
    assert og.verdict({"kvserve": k}) == {}  # one engine alone: nothing to compare


def test_an_unknown_engine_is_refused_by_name():
    with pytest.raises(ValueError, match="--engines: unknown engine 'sglang'"):
        og.server_command("sglang", "float32", 1)
