"""The noise floor of bench fidelity: two real runs of one cell set against each other."""

import json
from pathlib import Path

import pytest

from kvserve.benchmarks.fidelity import LATENCY_KEYS, STAT_KEYS, TARGETS, real_vs_real

REPO = Path(__file__).resolve().parents[2]


def _result(scale, ids=None, path="/a/trace.csv"):
    real = {k: {q: scale * (i + 1) for i, q in enumerate(STAT_KEYS)} for k in LATENCY_KEYS}
    real.update(num_preemptions=2, output_tok_s=10.0 / scale)
    out = {
        "real": real,
        "trace": {"path": path, "num_requests": 5, "time_scale": 1.0, "clip": {"max_input_len": 64}},
        "duration_s": {"real": 100.0 * scale},
        "num_steps": {"real": 40},
        "system": {"time": "t"},
    }
    if ids is not None:
        out["preempted_ids"] = {"real": ids}
    return out


def test_real_vs_real_gives_each_targets_relative_difference():
    a, b = _result(1.0, [1, 2]), _result(1.5, [2, 3], path="../elsewhere/trace.csv")
    rep = real_vs_real(a, b)
    assert set(rep["targets"]) == {f"{k} {q}" for k, q in TARGETS}
    assert rep["targets"]["ttft_s p50"] == pytest.approx(0.5) and rep["max_abs_target"] == pytest.approx(0.5)
    assert rep["relative_difference"]["output_tok_s"] == pytest.approx(1 / 1.5 - 1)
    assert rep["preempted_requests"]["jaccard"] == pytest.approx(1 / 3)
    assert rep["duration_s"] == [100.0, 150.0]
    assert real_vs_real(_result(1.0), _result(1.0))["max_abs_target"] == 0.0
    assert real_vs_real(_result(1.0), _result(1.0))["preempted_requests"] is None
    other = _result(1.0)
    other["trace"]["time_scale"] = 2.0
    with pytest.raises(ValueError, match="time_scale"):
        real_vs_real(_result(1.0), other)
    with pytest.raises(ValueError, match="no 'real' field"):
        real_vs_real({}, _result(1.0))


def test_fidelity_report_noise_prints_and_writes_the_report(tmp_path, capsys):
    from kvserve.benchmarks.fidelity_report import main

    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "n.json"
    pa.write_text(json.dumps(_result(1.0, [1])))
    pb.write_text(json.dumps(_result(1.2, [1])))
    assert main(["--noise", str(pa), str(pb), "--json-out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "ttft_s p50" in stdout and "+20.0%" in stdout and "largest target difference: 20.0%" in stdout
    assert json.loads(out.read_text())["max_abs_target"] == pytest.approx(0.2)
    assert main(["--noise", str(pa), str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "Error:" in err and "Traceback" not in err
    assert main(["--noise", str(pa)]) == 2
    assert "exactly two result files" in capsys.readouterr().err
