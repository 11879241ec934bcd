"""The speculative-decoding benchmark runs end to end on the tiny model (a smoke size), builds
its input-grounded workload from real text and reports what it promises."""

from __future__ import annotations

import json

import pytest

from kvserve.benchmarks.spec_decode import TASKS, build_workload, main


def test_workload_is_input_grounded_and_fixed_length(default_tokenizer_dir):
    from kvserve.transformers_utils.tokenizer import load_tokenizer

    tok = load_tokenizer(default_tokenizer_dir)
    reqs = build_workload(tok, 6, prompt_len=40, output_len=9)
    assert len(reqs) == 6 and all(r.output_len == 9 for r in reqs)
    for i, r in enumerate(reqs):
        task = TASKS[i % len(TASKS)][0]
        assert {"repeat": "Repeat", "summarise": "Summarise", "edit": "renamed"}[task] in r.prompt
        # the chat template wraps a passage of at most 40 tokens plus the instruction
        assert 40 < r.prompt_len < 40 + 80
    assert "def " in reqs[2].prompt  # the edit task quotes real code
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 6


def test_bench_smoke_on_tiny_model(tiny_llama_dir, tmp_path, capsys):
    out, wl = tmp_path / "r.json", tmp_path / "w.jsonl"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--scenarios", "single,concurrent"]
    argv += ["--num-requests", "2", "--concurrency", "2", "--prompt-len", "24", "--output-len", "6"]
    argv += ["--json-out", str(out), "--write-workload", str(wl)]
    # the dynamic policy may rightly draft nothing on a host where a verify step costs too much
    # (it did on CI), so the accepted-draft checks use the fixed-k draft method
    argv += ["--methods", "off,ngram,draft,draft-fixed"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "mean acc len" in table and "ngram" in table and "draft" in table
    saved = json.loads(out.read_text())
    res = saved["results"]
    assert set(res) == {"single", "concurrent"}
    for scen in res.values():
        assert set(scen) == {"off", "ngram", "draft", "draft-fixed"}
        assert scen["off"]["num_draft_tokens"] == 0 and scen["off"]["speedup"] == 1.0
        for r in scen.values():
            assert r["output_tokens"] == 2 * 6 and r["output_tok_s"] > 0
            assert r["same_tokens_as_off"] is True
        # the target as its own draft: every greedy draft accepted
        if scen["draft"]["num_draft_tokens"]:
            assert scen["draft"]["acceptance_rate"] == 1.0
        d = scen["draft-fixed"]
        assert d["num_draft_tokens"] > 0 and d["acceptance_rate"] == 1.0
        assert 1.0 < d["mean_accepted_len"] <= 5.0
        assert d["draft_ms_per_proposed_token"] > 0 and scen["ngram"]["draft_ms_per_proposed_token"] is None
    lines = [json.loads(x) for x in wl.read_text().splitlines()]
    assert len(lines) == 2 and all(x["output_len"] == 6 and x["prompt_token_ids"] for x in lines)
    meta = json.loads((tmp_path / "w.jsonl.meta.json").read_text())
    assert meta["n"] == 2 and len(meta["sha256"]) == 64

    # the saved result redraws as the speedup plot
    from kvserve.benchmarks.plots import plots_from_result

    (png,) = plots_from_result(saved, tmp_path / "plots")
    assert png.endswith("spec_decode.png") and (tmp_path / "plots" / "spec_decode.png").stat().st_size > 1000


def test_bench_rounds_alternate_and_report_the_best(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--scenarios", "single"]
    argv += ["--num-requests", "2", "--prompt-len", "24", "--output-len", "5", "--methods", "off,ngram-fixed"]
    argv += ["--rounds", "2", "--num-speculative-tokens", "3", "--json-out", str(out)]
    assert main(argv) == 0
    assert "each of the 2 rounds" in capsys.readouterr().out
    res = json.loads(out.read_text())["results"]["single"]
    for r in res.values():
        rounds = r["rounds_output_tok_s"]
        assert len(rounds) == 2 and r["output_tok_s"] == max(rounds) > 0
        assert r["output_tokens"] == 2 * 5 and r["same_tokens_as_off"] is True
    assert res["ngram-fixed"]["speedup"] == res["ngram-fixed"]["output_tok_s"] / res["off"]["output_tok_s"]
    assert main(argv[:-2] + ["--rounds", "0"]) == 2


def test_bench_plot_draws_several_spec_decode_runs_as_panels(tmp_path, capsys):
    from kvserve.benchmarks.plots import main as plot_main

    paths = []
    for dtype, ngram in (("float32", 2.0), ("bfloat16", 2.5)):
        by_method = {"off": {"output_tok_s": 10.0}, "ngram": {"output_tok_s": 10.0 * ngram}}
        res = {"benchmark": "spec_decode", "args": {"dtype": dtype}, "results": {"single": by_method}}
        paths.append(tmp_path / f"{dtype}.json")
        paths[-1].write_text(json.dumps(res))
    assert plot_main([str(p) for p in paths] + ["--out-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "out" / "spec_decode_compared.png") in printed
    assert (tmp_path / "out" / "spec_decode_compared.png").stat().st_size > 1000
    # each run also gets its own figure, in a folder per run
    assert sum(p.endswith("spec_decode.png") for p in printed) == 2


def test_bench_speculative_config_applies_to_every_speculating_method(tiny_llama_dir, tmp_path):
    """``--speculative-config`` reaches the engines (here: speculation off above batch 1, so
    the 2-request batch drafts nothing while one at a time does) and the saved args."""
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--scenarios", "single,concurrent"]
    argv += ["--num-requests", "2", "--concurrency", "2", "--prompt-len", "24", "--output-len", "6"]
    argv += ["--methods", "off,draft-fixed", "--json-out", str(out)]
    argv += ["--speculative-config", json.dumps({"disable_by_batch_size": 1, "prompt_lookup_min": 1})]
    assert main(argv) == 0
    res = json.loads(out.read_text())["results"]
    assert res["single"]["draft-fixed"]["num_draft_tokens"] > 0
    assert res["concurrent"]["draft-fixed"]["num_draft_tokens"] == 0
    assert res["concurrent"]["draft-fixed"]["same_tokens_as_off"] is True


def test_bench_bad_speculative_config_or_w64_file_is_an_error_before_loading(tmp_path, capsys):
    argv = ["--model", str(tmp_path / "no-model"), "--methods", "off,ngram"]
    assert main([*argv, "--speculative-config", '{"acceptance_window": 0}']) == 2
    assert "speculative_config.acceptance_window" in capsys.readouterr().err
    assert main([*argv, "--speculative-config", '{"method": "draft_model"}']) == 2
    assert "--methods" in capsys.readouterr().err
    assert main([*argv, "--speculative-config", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    assert main([*argv, "--w64-workload", str(tmp_path / "none.jsonl")]) == 2
    assert "--w64-workload" in capsys.readouterr().err
    assert main([*argv, "--scenarios", "single"]) == 2
    assert "error: --model: model path" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--output-len", "0"], "--output-len must be >= 1, got 0"),
        (["--num-requests", "-1"], "--num-requests must be >= 1, got -1"),
        (["--w64-max-output", "0"], "--w64-max-output must be >= 1, got 0"),
        (["--methods", ","], "--methods and --scenarios must each name at least one"),
        (["--methods", "draft", "--draft-model", "/nonexistent/draft"], "speculative_config.model"),
        (["--prompt-len", "400"], "leaves no room"),  # past the tiny model's 256-token context
    ],
)
def test_bench_bad_flags_are_error_lines(tiny_llama_dir, extra, match, capsys):
    argv = [
        "--model",
        str(tiny_llama_dir),
        "--scenarios",
        "single",
        "--num-requests",
        "1",
        "--output-len",
        "2",
    ]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
