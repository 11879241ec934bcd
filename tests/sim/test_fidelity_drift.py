"""The simulator's defences against the host's drift and its decode residuals: the step records'
decode extent and thread count, the quick profile grid (a re-profile right before each cell),
the noise column of the fidelity report, and the decode residual report."""

import argparse
import json
from pathlib import Path

from kvserve.benchmarks.fidelity import relative_error
from kvserve.sim.cost_model import CostModel
from kvserve.sim.profile import ProfileGrid, add_grid_args, grid_from_args
from kvserve.sim.replay import sim_replay
from kvserve.sim.step_record import load_steps, save_steps

from .test_fidelity_noise import _result
from .test_replay import _burst, _configs

REPO = Path(__file__).resolve().parents[2]


def test_records_keep_the_longest_decode_its_blocks_and_the_thread_count(tmp_path):
    res = sim_replay(_configs(64), CostModel(), 1000, _burst(4, output_len=5), record_steps=True)
    decodes = [r for r in res.steps if r.shape.shape_class == "decode"]
    assert decodes
    for r in decodes:
        b = r.shape.decode_seqs
        # the longest is at least the mean and at most the sum; one block holds <= 16 positions
        assert r.shape.context_tokens / b <= r.max_context_len <= r.shape.context_tokens
        assert r.context_blocks * 16 >= r.shape.context_tokens and r.context_blocks >= b
        assert isinstance(r.num_threads, int) and r.num_threads >= 1
    p = tmp_path / "steps.json"
    save_steps(p, res.steps)
    back, _ = load_steps(p)
    assert back == res.steps
    # records written before these fields existed still load (None)
    data = json.loads(p.read_text())
    for d in data["steps"]:
        for k in ("max_context_len", "context_blocks", "num_threads"):
            d.pop(k)
    p.write_text(json.dumps(data))
    old, _ = load_steps(p)
    assert all(r.max_context_len is None and r.num_threads is None for r in old)


def test_quick_grid_is_the_default_shapes_once():
    ap = argparse.ArgumentParser()
    add_grid_args(ap, prefix="profile-")
    quick = grid_from_args(ap.parse_args(["--profile-grid", "quick"]), prefix="profile-")
    default = ProfileGrid()
    assert quick.repeats == 1 < default.repeats
    assert quick.override(repeats=default.repeats) == default
    assert (
        grid_from_args(
            ap.parse_args(["--profile-grid", "quick", "--profile-repeats", "3"]), "profile-"
        ).repeats
        == 3
    )


def _fidelity_result(scale_sim: float) -> dict:
    r = _result(1.0)
    sim = json.loads(json.dumps(r["real"]))
    for k, v in sim.items():
        if isinstance(v, dict):
            sim[k] = {q: x * scale_sim for q, x in v.items()}
    r.update(
        simulated=sim,
        relative_error=relative_error(r["real"], sim),
        preempted_requests={"real": 2, "simulated": 2, "both": 2, "jaccard": 1.0},
    )
    return r


def test_report_shows_each_cells_noise_floor_when_it_was_measured(tmp_path, capsys):
    a, b = tmp_path / "azure_default_float32.json", tmp_path / "mooncake_default_float32.json"
    a.write_text(json.dumps(_fidelity_result(1.05)))
    b.write_text(json.dumps(_fidelity_result(0.8)))
    (tmp_path / "azure_default_float32_noise.json").write_text(json.dumps({"max_abs_target": 0.23}))
    run = _report(capsys, a, b)
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("| ")]
    assert "noise: real vs real" in lines[0]
    assert lines[1].endswith("| 23% |") and "(+5%)" in lines[1]
    assert lines[2].endswith("| - |") and "(-20% !)" in lines[2]


def _report(capsys, *paths):
    """``kvserve bench fidelity-report PATHS``: its exit status and what it printed."""
    from kvserve.benchmarks.fidelity_report import main

    rc = main([str(p) for p in paths])
    out, err = capsys.readouterr()
    return argparse.Namespace(returncode=rc, stdout=out, stderr=err)


def test_report_refuses_a_file_of_another_shape_in_one_line(tmp_path, capsys):
    """A profile (or any other JSON) given by mistake: a one-line error saying which file and
    what shape was expected, exit status 2, never a traceback."""
    from kvserve.sim.cost_model_file import SCHEMA

    good = tmp_path / "cell.json"
    good.write_text(json.dumps(_fidelity_result(1.05)))
    broken_oracle = _fidelity_result(1.0)
    broken_oracle["oracle"] = {"relative_error": {}}
    no_number = _fidelity_result(1.0)
    no_number["real"]["ttft_s"]["p50"] = "fast"
    cases = [
        (
            {"schema": SCHEMA, "coefficients": {}},
            "a cost-model profile (`kvserve profile`), expected a `kvserve bench fidelity --json-out` result",
        ),
        ({"schema": "kvserve-steps", "steps": []}, "a step-record file (--steps-out)"),
        ([1, 2, 3], "expected a `kvserve bench fidelity --json-out` result"),
        ({"real": {}}, "it lacks simulated, relative_error, preempted_requests"),
        (no_number, "real.ttft_s.p50 is not a number"),
        (broken_oracle, "its oracle lacks relative_error / steps"),
    ]
    for data, match in cases:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        run = _report(capsys, good, bad)
        assert run.returncode == 2, run.stdout
        assert run.stderr.startswith(f"Error: {bad}: ") and match in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""
    (tmp_path / "bad.json").write_text("{not json")
    run = _report(capsys, tmp_path / "bad.json")
    assert run.returncode == 2 and "not JSON" in run.stderr and "Traceback" not in run.stderr
    run = _report(capsys, tmp_path / "missing.json")
    assert run.returncode == 2 and "missing.json: no such file" in run.stderr
    (tmp_path / "cell_noise.json").write_text("[]")
    run = _report(capsys, good)
    assert (
        run.returncode == 2 and "cell_noise.json: expected a `fidelity-report --noise` report" in run.stderr
    )


def test_report_marks_preemption_counts_more_than_10_percent_apart(tmp_path, capsys):
    from kvserve.benchmarks.fidelity_report import preemption_miss

    assert not preemption_miss(10, 11) and not preemption_miss(41, 38) and not preemption_miss(0, 0)
    assert preemption_miss(8, 10) and preemption_miss(0, 1) and preemption_miss(10, 8)
    r = _fidelity_result(1.0)
    r["real"]["num_preemptions"], r["simulated"]["num_preemptions"] = 8, 10
    path = tmp_path / "azure_small_kv_bfloat16.json"
    path.write_text(json.dumps(r))
    run = _report(capsys, path)
    assert run.returncode == 0, run.stderr
    assert "| 8 / 10 ! |" in run.stdout
