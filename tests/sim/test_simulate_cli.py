"""`kvserve simulate`: the production engine + scheduler on the simulated executor."""

import json
import logging
import re

import pytest

from kvserve.config import EngineArgs
from kvserve.sim.cli import main, simulate
from kvserve.workload.workload import BenchRequest, default_workload_path, generate_arrivals


def _requests(n, prompt_len=40, output_len=12, rate=5.0):
    arrivals = generate_arrivals(n, rate, seed=0)
    return [
        BenchRequest(
            prompt_token_ids=[(7 * i + j) % 1000 + 3 for j in range(prompt_len)],
            output_len=output_len,
            arrival_s=t,
            id=i,
        )
        for i, t in enumerate(arrivals)
    ]


def test_simulate_finishes_everything_and_reports_latency():
    s = simulate(EngineArgs(num_gpu_blocks=64, block_size=16, max_model_len=512), _requests(30))
    assert s["finished"] == 30 and s["ignored"] == 0
    assert s["output_tokens"] == 30 * 12
    assert s["ttft_s"]["n"] == 30 and 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
    assert s["duration_s"] > 0


def test_smaller_cache_preempts_and_is_slower():
    reqs = _requests(40, prompt_len=100, output_len=40, rate=50.0)
    roomy = simulate(EngineArgs(num_gpu_blocks=512, max_model_len=512), reqs)
    tight = simulate(EngineArgs(num_gpu_blocks=24, max_model_len=512), reqs)
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert tight["finished"] == roomy["finished"] == 40
    assert tight["e2e_s"]["mean"] > roomy["e2e_s"]["mean"]


@pytest.mark.skipif(not default_workload_path().exists(), reason="../shared/workloads not present")
def test_cli_runs_on_workload(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["--num-requests", "16", "--num-gpu-blocks", "256", "--json-out", str(out)]) == 0
    assert "simulated 16 requests" in capsys.readouterr().out
    assert out.exists()


def test_missing_trace_file_is_a_one_line_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_SHARED_DIR", str(tmp_path / "data"))
    assert main(["--trace", "/nonexistent/trace.csv"]) == 2
    err = capsys.readouterr().err
    assert "--trace /nonexistent/trace.csv: no such file" in err and "Traceback" not in err
    # the hint names the folders themselves, not the variable's name
    assert str(tmp_path / "data" / "traces") in err and "$KVSERVE_SHARED_DIR" not in err


def test_step_budget_does_not_depend_on_the_host(monkeypatch):
    """The simulated device is not this machine: unset chunked prefill is off (V0) and an
    explicit one without a budget gets SchedulerConfig's 512, not the CPU engine's 2,048
    (regression: it depended on whether the host running the simulation had a GPU)."""
    from kvserve.sim import cli

    seen = []
    real = cli.LLMEngine

    def spy(model_config, cache_config, scheduler_config, **kw):
        seen.append((scheduler_config.chunked_prefill_enabled, scheduler_config.max_num_batched_tokens))
        return real(model_config, cache_config, scheduler_config, **kw)

    monkeypatch.setattr(cli, "LLMEngine", spy)
    reqs = _requests(3)
    simulate(EngineArgs(num_gpu_blocks=64, max_model_len=1024, device="cpu"), reqs)
    simulate(
        EngineArgs(num_gpu_blocks=64, max_model_len=1024, device="cpu", enable_chunked_prefill=True), reqs
    )
    simulate(
        EngineArgs(
            num_gpu_blocks=64,
            max_model_len=1024,
            device="cpu",
            enable_chunked_prefill=True,
            max_num_batched_tokens=300,
        ),
        reqs,
    )
    assert seen == [(False, 1024), (True, 512), (True, 300)]


# ----------------------------------------------------------------------------- bad input
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


def _err(capsys) -> str:
    """stderr of a run that failed: one line, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("empty.csv", "", "empty trace file"),
        ("header.csv", VIDUR, "the trace has no rows"),
        (
            "cols.csv",
            "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.1,100\n",
            "lacks column(s) GeneratedTokens",
        ),
        (
            "nonnum.csv",
            VIDUR + "0.0,100,20\n1.0,abc,20\n",
            ":3: num_prefill_tokens must be an integer >= 0, got 'abc'",
        ),
        ("neglen.csv", VIDUR + "0.0,100,-20\n", ":2: num_decode_tokens must be an integer >= 0, got '-20'"),
        ("negtime.csv", VIDUR + "-1.5,100,20\n", ":2: arrived_at must be a finite number >= 0, got '-1.5'"),
        ("nan.csv", VIDUR + "0.0,nan,20\n", ":2: num_prefill_tokens must be an integer >= 0, got 'nan'"),
        ("inf.csv", VIDUR + "inf,1,20\n", ":2: arrived_at must be a finite number >= 0, got 'inf'"),
        ("short.csv", VIDUR + "0.0,100\n", ":2: missing value for num_decode_tokens"),
        ("long.csv", VIDUR + "0.0,100,20,4\n", ":2: 4 cells, the header has 3"),
        ("azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnoon,1,2\n", ":2: TIMESTAMP must be a time"),
        (
            "m.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1}\n',
            ":2: missing field 'input_length'",
        ),
        (
            "bad.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{oops\n',
            ":2: not valid JSON",
        ),
        ("list.jsonl", "[1, 2]\n", ":1: a JSONL trace line must be a JSON object, got list"),
        (
            "neg.jsonl",
            '{"timestamp": -5, "input_length": 5, "output_length": 2}\n',
            ":1: timestamp must be a finite number >= 0",
        ),
        (
            "hash.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": "x"}\n',
            ":1: hash_ids must be",
        ),
    ],
)
def test_malformed_trace_is_a_one_line_error_naming_file_line_and_field(tmp_path, capsys, name, text, match):
    p = tmp_path / name
    p.write_text(text)
    assert main(["--trace", str(p), "--num-gpu-blocks", "64"]) == 2
    err = _err(capsys)
    assert f"Error: --trace {p}" in err and match in err, err


def test_unreadable_trace_and_workload_files(tmp_path, capsys):
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["--trace", str(binary)]) == 2
    assert "not a UTF-8 text trace file" in _err(capsys)
    assert main(["--trace", str(tmp_path)]) == 2
    assert "is a folder, not a trace file" in _err(capsys)
    assert main(["--workload", str(tmp_path / "none.jsonl")]) == 2
    assert "--workload" in (err := _err(capsys)) and "no such workload file" in err
    wl = tmp_path / "w.jsonl"
    for text, match in [
        ("[1]\n", ":1: a workload line must be a JSON object"),
        ('{"prompt_token_ids": [1], "output_len": 0}\n', ":1: output_len must be an integer >= 1"),
        (
            '{"prompt_token_ids": [1, -2], "output_len": 3}\n',
            ":1: prompt_token_ids must be a list of integers",
        ),
        ('{"prompt_token_ids": [1], "output_len": 3, "arrival_s": "soon"}\n', ":1: arrival_s must be"),
        ("\n", "no requests in the file"),
    ]:
        wl.write_text(text)
        assert main(["--workload", str(wl)]) == 2
        err = _err(capsys)
        assert "--workload" in err and match in err, err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--time-scale", "nan"], "--time-scale must be a finite number >= 0"),
        (["--time-scale", "inf"], "--time-scale must be a finite number >= 0"),
        (["--time-scale", "-1"], "--time-scale must be a finite number >= 0"),
        (["--request-rate", "nan"], "--request-rate must be a finite number > 0 or inf"),
        (["--request-rate", "0"], "--request-rate must be a finite number > 0 or inf"),
        (["--request-rate=-inf"], "--request-rate must be a finite number > 0 or inf"),
        (["--num-loras", "2", "--lora-dist", "zipf", "--lora-zipf-alpha", "nan"], "--lora-zipf-alpha"),
        (["--num-requests", "0"], "--num-requests must be an integer >= 1, got 0"),
        (["--num-requests", "-1"], "--num-requests must be an integer >= 1, got -1"),
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be an integer >= 1"),
        (["--num-gpu-blocks", "100000000000"], "--num-gpu-blocks must be an integer >= 1 and <= 4,194,304"),
        (["--num-cpu-blocks", "-1"], "--num-cpu-blocks must be an integer >= 0"),
        (["--num-cpu-blocks", "5000000"], "--num-cpu-blocks must be an integer >= 0 and <= 4,194,304"),
        (["--max-model-len", "0"], "--max-model-len must be an integer >= 2"),
        (["--num-loras", "0"], "--num-loras must be an integer >= 1"),
        (["--num-loras", "100000000"], "--num-loras must be an integer >= 1 and <= 1,048,576"),
        # flags the mode would ignore
        (["--time-scale", "2"], "--time-scale applies to --trace only"),
        (["--lora-dist", "zipf"], "--lora-dist goes with --num-loras"),
        (["--num-loras", "3", "--lora-zipf-alpha", "2"], "--lora-zipf-alpha goes with --lora-dist zipf"),
        (["--kv-cache-memory-gib", "4"], "--kv-cache-memory-gib does not apply to a simulation"),
        (["--swap-space-gib", "nan"], "--swap-space-gib does not apply to a simulation"),
        (["--device", "cuda"], "--device does not apply to a simulation"),
        (["--data-parallel-size", "2"], "--data-parallel-size is not simulated"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is not simulated"),
        (["--model", "x", "--dtype", "float32"], "--model, --dtype applies with --cost-model FILE only"),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(argv, match, capsys, monkeypatch):
    from kvserve.sim import cli

    monkeypatch.setattr(cli, "simulate", lambda *a, **kw: pytest.fail("ran despite a bad flag"))
    assert main(["--num-requests", "4", *argv]) == 2
    err = _err(capsys)
    assert match in err, err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
        (["--block-size", "0"], "--block-size must be an integer >= 1"),
        (["--watermark", "nan"], "--watermark must be in [0, 1)"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be an integer >= 1"),
    ],
)
def test_bad_engine_flags_are_named_as_flags(argv, match, capsys):
    """The engine's own checks (``EngineArgs`` and its configs) word errors by field name;
    the simulator names the flag typed."""
    assert main(["--num-requests", "2", *argv]) == 2
    err = _err(capsys)
    assert match in err, err


def _timed_and_untimed_traces(tmp_path):
    timed = tmp_path / "timed.csv"
    timed.write_text(VIDUR + "".join(f"{i * 0.5},{20 + i},{4}\n" for i in range(6)))
    untimed = tmp_path / "lengths.csv"
    untimed.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{20 + i},4\n" for i in range(6)))
    return timed, untimed


def test_a_rate_with_timed_trace_or_a_time_scale_without_times_is_an_error(tmp_path, capsys):
    timed, untimed = _timed_and_untimed_traces(tmp_path)
    assert main(["--trace", str(timed), "--request-rate", "3"]) == 2
    assert "--request-rate does not apply to --trace" in _err(capsys)
    assert main(["--trace", str(untimed), "--time-scale", "3"]) == 2
    assert "--time-scale does not apply to --trace" in _err(capsys)


def test_length_only_trace_takes_its_arrivals_from_the_request_rate(tmp_path, capsys):
    """Before, a length-only trace ran every request at t=0 whatever --request-rate said."""
    _, untimed = _timed_and_untimed_traces(tmp_path)
    out = tmp_path / "s.json"
    argv = [
        "--trace",
        str(untimed),
        "--num-gpu-blocks",
        "64",
        "--max-model-len",
        "256",
        "--json-out",
        str(out),
    ]
    assert main(argv) == 0
    burst = json.loads(out.read_text())["duration_s"]
    assert main([*argv, "--request-rate", "0.5"]) == 0
    assert json.loads(out.read_text())["duration_s"] > burst + 2  # 6 arrivals, ~2 s apart (seeded)


def test_output_path_is_checked_before_the_run_and_written_whole(tmp_path, capsys, monkeypatch):
    from kvserve.sim import cli

    a_file = tmp_path / "f"
    a_file.write_text("x")
    monkeypatch.setattr(cli, "simulate", lambda *a, **kw: pytest.fail("ran despite a bad --json-out"))
    assert main(["--num-requests", "2", "--json-out", str(a_file / "s.json")]) == 2
    assert f"--json-out {a_file / 's.json'}: {a_file} is not a folder" in _err(capsys)
    assert main(["--num-requests", "2", "--json-out", str(tmp_path)]) == 2
    assert "is a folder, not a file path" in _err(capsys)
    monkeypatch.undo()
    out = tmp_path / "new" / "s.json"  # missing folders are created
    assert main(["--num-requests", "2", "--num-gpu-blocks", "64", "--json-out", str(out)]) == 0
    assert json.loads(out.read_text())["num_requests"] == 2
    assert [p.name for p in out.parent.iterdir()] == ["s.json"]  # no temporary file left


def test_atomic_write_never_leaves_half_a_file(tmp_path):
    from kvserve.workload.io import atomic_write, write_json

    p = tmp_path / "r.json"
    write_json(p, {"a": 1})

    def crash(tmp):
        with open(tmp, "w") as f:
            f.write('{"a": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(p, crash)
    assert json.loads(p.read_text()) == {"a": 1}  # the old file, whole
    assert [q.name for q in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(TypeError):
        write_json(tmp_path / "s.json", {"a": object.__new__(type("X", (), {"__str__": None}))})
    assert [q.name for q in tmp_path.iterdir()] == ["r.json"]


_VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n"


@pytest.mark.parametrize(
    "name, text, match",
    [
        # rows out of order were re-based on the first row: negative arrival times, silently
        (
            "unsorted.csv",
            _VIDUR + "10,20,3\n5,20,3\n20,20,3\n",
            r"unsorted.csv:3: arrives before the row above",
        ),
        # arrays / objects nested past the JSON parser's depth: RecursionError traceback
        ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", r"deep.jsonl:1: not valid JSON"),
        # an integer past Python's digit limit: an error naming neither file nor line
        (
            "big.jsonl",
            '{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "output_length": 3}\n',
            r"big.jsonl:1: not valid JSON",
        ),
        # lora_id 1e999 is inf in JSON: OverflowError traceback
        (
            "inf.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 3, "lora_id": 1e999}\n',
            r"inf.jsonl:1: lora_id must be an integer >= 0",
        ),
    ],
)
def test_malformed_trace_is_a_one_line_error_naming_the_line(tmp_path, capsys, name, text, match):
    p = tmp_path / name
    p.write_text(text)
    assert main(["--trace", str(p), "--num-gpu-blocks", "64"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.startswith("Error: --trace ") and "Traceback" not in err


def test_deeply_nested_workload_line_is_a_one_line_error(tmp_path, capsys):
    p = tmp_path / "w.jsonl"
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["--workload", str(p), "--num-gpu-blocks", "64"]) == 2
    assert "w.jsonl:1: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt_token_ids": [], "output_len": 3}',  # an empty prompt
        '{"prompt_token_ids": [1, 2, 99999999999], "output_len": 3}',  # a token past the vocabulary
    ],
)
def test_last_requests_rejected_at_admission_end_the_run(tmp_path, capsys, line):
    """Requests the engine refuses at admission are counted as rejected; when the last arrivals
    were all refused the run ends (was IndexError: the idle engine jumped to a next arrival past
    the end)."""
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt_token_ids": [5, 6, 7], "output_len": 2}\n' + line + "\n")
    out = tmp_path / "s.json"
    assert main(["--workload", str(p), "--num-gpu-blocks", "64", "--json-out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["finished"] == 1 and s["rejected_at_admission"] == 1
    # and says why (the engine's own error, once per distinct reason)
    ((reason, n),) = s["rejection_reasons"].items()
    assert n == 1 and ("prompt" in reason or "token" in reason)
    assert f"rejected at admission (1): {reason}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["timed", "untimed", "workload"])
def test_arrivals_stretched_past_float_resolution_are_an_error(tmp_path, capsys, kind):
    """A --time-scale or --request-rate that puts the arrivals past 1e9 virtual seconds named,
    not run: there the clock's float rounding swallows a step's milliseconds (TTFT came out 0)."""
    timed, untimed = _timed_and_untimed_traces(tmp_path)
    argv, flag = {
        "timed": (["--trace", str(timed), "--time-scale", "1e300"], "--time-scale"),
        "untimed": (["--trace", str(untimed), "--request-rate", "1e-300"], "--request-rate"),
        "workload": (["--num-requests", "4", "--request-rate", "1e-300"], "--request-rate"),
    }[kind]
    assert main(argv) == 2
    err = _err(capsys)
    assert err.startswith(f"Error: {flag}: the last request would arrive at") and "at most 1e+09 s" in err, (
        err
    )
    # a long but representable span still runs
    ok = {"timed": ["--trace", str(timed), "--time-scale", "1e8"]}.get(kind)
    if ok:
        assert main([*ok, "--num-gpu-blocks", "256"]) == 0


def test_requests_the_cache_can_never_hold_count_as_ignored_not_in_latencies(tmp_path, capsys):
    """A request needing more blocks than the cache has is ignored: counted, its reason printed
    once, and left out of every latency (its refusal is no end-to-end latency: e2e p50 was below
    TTFT p50)."""
    p = tmp_path / "w.jsonl"
    rows = [{"prompt_token_ids": [5 + i] * 40, "output_len": 8, "arrival_s": 0.1 * i} for i in range(6)]
    rows += [{"prompt_token_ids": [9] * 400, "output_len": 8, "arrival_s": 0.05 + 0.1 * i} for i in range(6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "s.json"
    engine_log = logging.getLogger("kvserve.engine")
    level = engine_log.level
    argv = ["--workload", str(p), "--num-gpu-blocks", "8", "--block-size", "16", "--json-out", str(out)]
    assert main(argv) == 0
    assert engine_log.level == level  # quieted for the run only
    s = json.loads(out.read_text())
    assert s["finished"] == 6 and s["ignored"] == 6
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        assert s[key]["n"] == 6, key
    assert s["e2e_s"]["p50"] >= s["ttft_s"]["p50"]
    ((reason, n),) = s["ignored_reasons"].items()
    assert n == 6 and "KV blocks" in reason
    printed = capsys.readouterr().out
    assert printed.count(reason) == 1 and f"ignored by the scheduler (6): {reason}" in printed
    assert "requests/s simulated" in printed


def test_folders_and_refit_files_are_named_by_their_flag(tmp_path, capsys):
    from kvserve.sim.profile import main as profile_main

    assert main(["--cost-model", str(tmp_path)]) == 2
    assert f"--cost-model {tmp_path}: is a folder" in capsys.readouterr().err
    assert profile_main(["--refit", str(tmp_path / "none.json"), "--out", str(tmp_path / "p.json")]) == 2
    assert f"--refit {tmp_path / 'none.json'}: no such file" in capsys.readouterr().err


def test_profile_refuses_a_context_too_short_and_speculation(tiny_llama_dir, tmp_path, capsys):
    from kvserve.sim.profile import main as profile_main

    base = ["--model", str(tiny_llama_dir), "--grid", "small", "--out", str(tmp_path / "p.json")]
    assert profile_main([*base, "--max-model-len", "8", "--no-progress"]) == 2
    assert "--max-model-len 8 is too short to profile: at least 32 tokens" in capsys.readouterr().err
    assert profile_main([*base, "--speculative-config", '{"method": "ngram"}']) == 2
    assert "--speculative-config does not apply" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
