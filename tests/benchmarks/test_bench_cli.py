"""`kvserve bench` dispatch and `bench plot`: missing optional packages and results without plots
are one clear line each, never a traceback or a silent exit."""

import json
import sys

from kvserve.benchmarks import cli, plots


def test_missing_bench_extra_names_the_package_and_the_extra(monkeypatch, capsys, tmp_path):
    result = tmp_path / "cold.json"
    result.write_text(json.dumps({"benchmark": "cold_start", "tries": [{"build_llm_s": 1.0}]}))
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import of it now fails
    assert cli.main(["plot", str(result), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs the optional package 'matplotlib'" in err
    assert "scripts/setup.sh bench" in err


def test_plot_draws_a_cold_start_result(capsys, tmp_path):
    tries = [
        {"interpreter_start_to_import_s": 0.1, "build_llm_s": 2.0, "first_token_after_llm_s": 0.3},
        {"interpreter_start_to_import_s": 0.1, "build_llm_s": 1.0, "first_token_after_llm_s": 0.2},
    ]
    result = tmp_path / "cold.json"
    result.write_text(json.dumps({"benchmark": "cold_start", "tries": tries, "target_s": 10.0}))
    assert plots.main([str(result), "--out-dir", str(tmp_path)]) == 0
    png = tmp_path / "cold_start.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_when_a_result_has_nothing_to_plot(capsys, tmp_path):
    result = tmp_path / "dp.json"
    result.write_text(json.dumps({"benchmark": "data_parallel", "rows": []}))
    assert plots.main([str(result), "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "nothing to plot in a 'data_parallel' result" in err
    assert not list(tmp_path.glob("*.png"))


def test_plot_names_an_unreadable_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert plots.main([str(bad)]) == 2
    assert f"{bad}: cannot read a benchmark JSON" in capsys.readouterr().err


def test_profiler_trace_lines_are_dropped_and_other_stderr_kept(capfd):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvserve.benchmarks.common import without_profiler_trace_lines

    with without_profiler_trace_lines(), profile(activities=[ProfilerActivity.CPU]):
        torch.ones(3).add_(1)
        print("kept line", file=sys.stderr)
    err = capfd.readouterr().err
    assert "kept line" in err
    assert "USDT:" not in err
