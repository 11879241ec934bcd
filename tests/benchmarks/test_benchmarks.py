"""Fast tests of the benchmark statistics, arrivals, trace loading and the load generator's
stream parsing (no model, no sockets: httpx.MockTransport stands in for a server)."""

import asyncio
import json
import math
import statistics

import pytest

from kvserve.benchmarks.serve import LoadGenerator, parse_prometheus, plan_runs
from kvserve.workload import workload as wl
from kvserve.workload.stats import SLO, RequestResult, goodput, percentile, summarize, summarize_results


# ----------------------------------------------------------------------------- statistics
def test_percentile_linear_interpolation():
    xs = [4, 1, 3, 2]
    assert percentile(xs, 0) == 1
    assert percentile(xs, 100) == 4
    assert percentile(xs, 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    xs = rng.exponential(size=257).tolist()
    for q in (1, 25, 50, 90, 99, 99.9):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summarize_scales_and_skips_none():
    s = summarize([0.1, None, 0.3, float("nan"), 0.2], scale=1000)
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(200.0)
    assert s["p50"] == pytest.approx(200.0)
    assert s["min"] == pytest.approx(100.0) and s["max"] == pytest.approx(300.0)
    empty = summarize([])
    assert empty["n"] == 0 and empty["p99"] is None and empty["mean"] is None


def _res(i, ttft, e2e, n_out, success=True, prompt_len=10):
    return RequestResult(
        request_id=i,
        prompt_len=prompt_len,
        expected_output_len=n_out,
        success=success,
        ttft=ttft,
        e2e=e2e,
        output_tokens=n_out if success else 0,
    )


def test_tpot_definition():
    r = _res(0, ttft=1.0, e2e=3.0, n_out=5)
    assert r.tpot == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    assert _res(1, 1.0, 1.0, 1).tpot is None  # one token: no TPOT
    assert _res(2, None, None, 0, success=False).tpot is None


def test_slo_and_goodput():
    results = [
        _res(0, ttft=0.5, e2e=2.5, n_out=11),  # tpot 0.2
        _res(1, ttft=2.0, e2e=3.0, n_out=11),  # ttft violates
        _res(2, ttft=0.5, e2e=5.5, n_out=11),  # tpot 0.5 violates
        _res(3, ttft=0.5, e2e=0.5, n_out=1),  # no tpot: that bound counts as met
        _res(4, None, None, 0, success=False),  # failed: never good
    ]
    slo = SLO(ttft_ms=1000, tpot_ms=300)
    g = goodput(results, slo, duration_s=10.0)
    assert g["good_requests"] == 2
    assert g["good_fraction"] == pytest.approx(0.4)
    assert g["goodput_req_s"] == pytest.approx(0.2)
    assert g["goodput_output_tok_s"] == pytest.approx((11 + 1) / 10)
    # No SLO: every successful request is good.
    assert goodput(results, SLO(), 10.0)["good_requests"] == 4
    assert SLO(e2e_ms=2000).met(0.1, None, 2.5) is False


def test_summarize_results_throughput():
    results = [
        _res(0, 0.5, 2.5, 11, prompt_len=100),
        _res(1, 1.5, 3.5, 21, prompt_len=50),
        _res(2, None, None, 0, success=False),
    ]
    results[2].error = "HTTP 500"
    s = summarize_results(results, duration_s=4.0, slo=SLO(ttft_ms=1000))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_output_tokens"] == 32
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["total_token_throughput"] == pytest.approx((150 + 32) / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0)
    assert s["good_requests"] == 1
    assert s["first_errors"] == ["HTTP 500"]


# ----------------------------------------------------------------------------- arrivals
def test_arrivals_infinite_rate_all_at_once():
    assert wl.generate_arrivals(5, math.inf) == [0.0] * 5


def test_poisson_arrivals_seeded_rate_and_cv():
    a = wl.generate_arrivals(20001, rate=4.0, burstiness=1.0, seed=7)
    assert a == wl.generate_arrivals(20001, rate=4.0, burstiness=1.0, seed=7)  # reproducible
    assert a != wl.generate_arrivals(20001, rate=4.0, burstiness=1.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_burstiness_sets_cv(burstiness):
    a = wl.generate_arrivals(20001, rate=2.0, burstiness=burstiness, seed=3)
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)


def test_arrivals_reject_bad_arguments():
    with pytest.raises(ValueError):
        wl.generate_arrivals(3, 0.0)
    with pytest.raises(ValueError):
        wl.generate_arrivals(3, 1.0, burstiness=0)


# ----------------------------------------------------------------------------- traces
def test_azure_trace_parsing_and_scaling(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:06.4799600,100,200"
    )  # no trailing newline, like the real file
    assert wl.detect_trace_format(p) == "azure"
    recs = wl.load_trace(p)
    assert [r.input_len for r in recs] == [4808, 3180, 100]
    assert [r.output_len for r in recs] == [10, 8, 200]
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 0.052, 2.5])
    scaled = wl.scale_arrivals(recs, 0.5)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.026, 1.25])
    assert recs[2].arrival_s == pytest.approx(2.5)  # the input is not modified
    window = wl.select_trace(recs, start_s=0.05, duration_s=10)
    assert [r.input_len for r in window] == [3180, 100]
    assert window[0].arrival_s == 0.0 and window[1].arrival_s == pytest.approx(2.448)
    assert len(wl.select_trace(recs, num_requests=2)) == 2


def test_vidur_mooncake_and_length_only_traces(tmp_path):
    v = tmp_path / "v.csv"
    v.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,4808,10\n0.052,3180,8\n")
    assert wl.detect_trace_format(v) == "vidur"
    assert [(r.arrival_s, r.input_len, r.output_len) for r in wl.load_trace(v)] == [
        (0.0, 4808, 10),
        (0.052, 3180, 8),
    ]
    m = tmp_path / "m.jsonl"
    m.write_text(
        json.dumps({"timestamp": 1000, "input_length": 600, "output_length": 6, "hash_ids": [0, 1]})
        + "\n"
        + json.dumps({"timestamp": 3500, "input_length": 700, "output_length": 9, "hash_ids": [0, 2]})
        + "\n"
    )
    recs = wl.load_trace(m)
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 2.5])  # ms -> s, re-based
    assert recs[1].hash_ids == [0, 2]
    lo = tmp_path / "l.csv"
    lo.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n")
    assert wl.detect_trace_format(lo) == "lengths"
    assert wl.load_trace(lo)[0].arrival_s is None
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        wl.load_trace(bad)


def test_clip_lengths_fits_context():
    assert wl.clip_lengths(100, 50, 2048) == (100, 50)
    assert wl.clip_lengths(5000, 10, 2048) == (2038, 10)
    assert wl.clip_lengths(5000, 4000, 2048) == (1, 2047)
    assert wl.clip_lengths(5000, 4000, 2048, max_output_len=512) == (1536, 512)
    assert wl.clip_lengths(5000, 10, 2048, max_input_len=1000) == (1000, 10)
    for i, o in [(1, 1), (9000, 9000), (2047, 1), (0, 0)]:
        a, b = wl.clip_lengths(i, o, 2048)
        assert a >= 1 and b >= 1 and a + b <= 2048


def test_trace_to_requests_clips_and_shares_prefixes():
    corpus = list(range(3000))
    recs = [
        wl.TraceRecord(0.0, 1200, 10, [5, 6, 7]),
        wl.TraceRecord(1.0, 1100, 20, [5, 6, 9]),
        wl.TraceRecord(2.0, 100, 5000, None),
    ]
    reqs, rep = wl.trace_to_requests(recs, corpus, max_model_len=1024, seed=0)
    assert [r.prompt_len for r in reqs] == [1014, 1004, 1]
    assert [r.output_len for r in reqs] == [10, 20, 1023]
    assert rep.input_clipped == 3 and rep.output_clipped == 1 and rep.num_requests == 3
    assert rep.input_tokens_before == 2400 and rep.input_tokens_after == 2019
    # Equal hash ids -> equal 512-token blocks; different ids -> different blocks.
    assert reqs[0].prompt_token_ids[:1004] == reqs[1].prompt_token_ids[:1004]
    recs2 = [wl.TraceRecord(0.0, 1024, 1, [1, 2]), wl.TraceRecord(0.0, 1024, 1, [3, 2])]
    r2, _ = wl.trace_to_requests(recs2, corpus, max_model_len=4096)
    assert r2[0].prompt_token_ids[:512] != r2[1].prompt_token_ids[:512]
    assert r2[0].prompt_token_ids[512:] == r2[1].prompt_token_ids[512:]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]


def test_corpus_window_wraps():
    assert wl.corpus_window([1, 2, 3], 2, 5) == [3, 1, 2, 3, 1]


def test_real_shared_traces_if_present():
    root = wl.shared_dir() / "traces"
    azure = root / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
    if not azure.is_file():
        pytest.skip("shared traces not present")
    recs = wl.load_trace(azure)
    assert len(recs) == 8819
    assert recs[-1].arrival_s == pytest.approx(3436, abs=1)
    assert max(r.input_len for r in recs) == 7437
    vid = wl.load_trace(root / "vidur" / "splitwise_code.csv")
    assert len(vid) == 8819 and vid[1].arrival_s == pytest.approx(recs[1].arrival_s, abs=1e-3)


def test_workload_loading_and_synthetic(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": i,
                    "prompt_token_ids": [1, 2, 3 + i],
                    "prompt": "x",
                    "prompt_len": 3,
                    "output_len": 4 + i,
                    "arrival_s": 0.0,
                }
            )
            for i in range(3)
        )
        + "\n"
    )
    reqs = wl.load_workload(p, num_prompts=2)
    assert len(reqs) == 2 and reqs[1].prompt_token_ids == [1, 2, 4] and reqs[1].output_len == 5
    syn = wl.synthetic_requests(4, 7, 9, corpus=list(range(100)), seed=1)
    assert all(r.prompt_len == 7 and r.output_len == 9 for r in syn)
    assert (
        syn[0].prompt_token_ids
        == wl.synthetic_requests(1, 7, 9, corpus=list(range(100)), seed=1)[0].prompt_token_ids
    )


# ----------------------------------------------------------------------------- serve helpers
def test_parse_prometheus_gauges():
    text = """# HELP kvserve:num_requests_running Number of requests running.
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="default"} 3.0
kvserve:num_requests_waiting{model_name="default"} 61.0
kvserve:num_requests_swapped{model_name="default"} 0.0
kvserve:gpu_cache_usage_perc{model_name="default"} 0.42
kvserve:request_success_total{model_name="default",finished_reason="length"} 5.0
"""
    assert parse_prometheus(text) == {
        "running": 3.0,
        "waiting": 61.0,
        "swapped": 0.0,
        "gpu_cache_usage": 0.42,
    }
    vllm = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="x"} 12.5\nvllm:num_requests_running{engine="0"} 2\n'
    )
    assert parse_prometheus(vllm) == {"gpu_cache_usage": 0.125, "running": 2.0}


def test_parse_prometheus_counts_a_gauge_exported_under_two_prefixes_once():
    both = (
        'kvserve:num_requests_running{model_name="m"} 3\nkvserve:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:num_requests_running{model_name="m"} 3\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    assert parse_prometheus(both) == {"running": 3.0, "gpu_cache_usage": 0.5}


class _NS:
    sweep_rates = "1,inf"
    request_rate = math.inf
    burstiness = 1.0
    workload_seed = 0
    sweep_time_scales = None
    time_scale = 2.0


def test_plan_runs_rates_and_time_scale():
    reqs = [wl.BenchRequest([1, 2], 3, arrival_s=float(i)) for i in range(4)]
    runs = plan_runs(_NS(), reqs, has_times=False)
    assert [r["label"] for r in runs] == ["rate=1", "rate=inf"]
    assert [q.arrival_s for q in runs[1]["reqs"]] == [0.0] * 4
    assert runs[0]["reqs"][0].arrival_s == 0.0 and runs[0]["reqs"][3].arrival_s > 0
    trace_runs = plan_runs(_NS(), reqs, has_times=True)
    assert [q.arrival_s for q in trace_runs[0]["reqs"]] == [0.0, 2.0, 4.0, 6.0]
    assert trace_runs[0]["request_rate"] == pytest.approx(3 / 6)  # gaps / span


def _sse(chunks):
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_load_generator_against_mock_server():
    httpx = pytest.importorskip("httpx")
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(
                200, text="kvserve:num_requests_running 1\nkvserve:gpu_cache_usage_perc 0.5\n"
            )
        body = json.loads(request.content)
        seen.append(body)
        if isinstance(body["prompt"], list):  # this server refuses token ids: the client falls back to text
            return httpx.Response(400, json={"error": {"message": "prompt must be a string"}})
        n = body["max_tokens"]
        chunks = [
            {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None if i < n - 1 else "length"}]}
            for i in range(n)
        ]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        return httpx.Response(200, text=_sse(chunks), headers={"content-type": "text/event-stream"})

    async def go():
        gen = LoadGenerator("http://test/v1", "m", use_tqdm=False, metrics_interval_s=0.01)
        reqs = [
            wl.BenchRequest([1, 2, 3], 4, prompt="abc", id=0),
            wl.BenchRequest([4, 5], 2, prompt="de", id=1, arrival_s=0.02),
        ]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return gen, await gen.run(client, reqs, "t")

    gen, out = asyncio.run(go())
    res = sorted(out["results"], key=lambda r: r.request_id)
    assert all(r.success for r in res), [r.error for r in res]
    assert [r.output_tokens for r in res] == [4, 2]
    assert len(res[0].itl) == 3 and len(res[1].itl) == 1
    assert res[0].ttft is not None and res[0].e2e >= res[0].ttft
    assert gen.prompt_mode == "text"
    assert seen[0]["ignore_eos"] is True and seen[0]["stream"] is True
    assert seen[0]["stream_options"] == {"include_usage": True} and seen[0]["prompt"] == [1, 2, 3]
    assert any(b["prompt"] == "abc" for b in seen)
    assert out["timeline"]["running"] and out["timeline"]["gpu_cache_usage"][0] == 0.5


def test_write_json_is_strict(tmp_path):
    from kvserve.workload.io import write_json

    p = tmp_path / "sub" / "r.json"
    write_json(p, {"rate": math.inf, "xs": [1.0, float("nan")], "n": 3})
    assert json.loads(p.read_text()) == {"rate": "inf", "xs": [1.0, "nan"], "n": 3}


def test_bench_cli_usage_and_unknown_command(capsys):
    from kvserve.benchmarks.cli import main

    assert main(["--help"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert main(["nope"]) == 2


def test_top_level_help_lists_every_bench_command(capsys):
    from kvserve.benchmarks.cli import COMMANDS
    from kvserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps (and may hyphen-break) the line
    bench_line = out.split("bench benchmarks (", 1)[1].split(")", 1)[0].replace("- ", "-")
    assert [c.strip() for c in bench_line.split(",")] == list(COMMANDS)


@pytest.mark.parametrize(
    "command",
    [
        ["throughput", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"],
        ["cold-start"],
        ["data-parallel", "--trace", "/nonexistent/trace.jsonl"],
    ],
)
def test_bench_commands_reject_a_bad_engine_setting_before_loading(command, capsys):
    """A bad engine flag is an ``error:`` line and exit 2, not a traceback (nor a model load)."""
    from kvserve.benchmarks.cli import main

    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    assert main([*command, "--speculative-config", bad]) == 2
    err = capsys.readouterr().err
    assert "error: speculative_config.num_speculative_tokens must be an integer in [1, 64], got 0." in err
    assert "Traceback" not in err


def test_bench_data_parallel_missing_trace_is_an_error_naming_the_flag(capsys):
    from kvserve.benchmarks.cli import main

    assert main(["data-parallel", "--trace", "/nonexistent/trace.jsonl"]) == 2
    assert "error: --trace /nonexistent/trace.jsonl: [Errno 2]" in capsys.readouterr().err


def test_bench_throughput_reports_speculation_counts(tiny_llama_dir, tmp_path, capsys):
    from kvserve.benchmarks.cli import main

    out, workload = tmp_path / "t.json", tmp_path / "w.jsonl"
    # a workload of its own (the synthetic one takes its token ids from the shared data folder)
    rows = [{"id": i, "prompt_token_ids": list(range(100 + i, 116 + i)), "output_len": 9} for i in range(2)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the target as its own draft, fixed k: every step drafts and every greedy draft is accepted
    spec = {
        "method": "draft_model",
        "model": str(tiny_llama_dir),
        "num_speculative_tokens": 3,
        "dynamic": False,
    }
    argv = ["throughput", "--model", str(tiny_llama_dir), "--workload", str(workload)]
    argv += ["--no-baseline", "--no-tqdm", "--no-roof", "--speculative-config", json.dumps(spec)]
    assert main([*argv, "--json-out", str(out)]) == 0
    sd = json.loads(out.read_text())["kvserve"]["spec_decode"]
    assert sd["num_draft_tokens"] > 0 and sd["num_accepted_tokens"] == sd["num_draft_tokens"]
    assert sd["acceptance_rate"] == 1.0
    printed = capsys.readouterr().out
    assert f"speculative decoding: {sd['num_draft_tokens']} draft tokens proposed" in printed


@pytest.mark.parametrize("impl, ran", [("native", "native"), ("transformers", "transformers")])
def test_bench_throughput_runs_the_model_impl_asked_for(tiny_llama_dir, tmp_path, capsys, impl, ran):
    """``--model-impl`` reaches the engine: the JSON and the printed line say which ran."""
    from kvserve.benchmarks.cli import main

    out, workload = tmp_path / "t.json", tmp_path / "w.jsonl"
    rows = [{"id": i, "prompt_token_ids": list(range(100 + i, 116 + i)), "output_len": 4} for i in range(2)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["throughput", "--model", str(tiny_llama_dir), "--workload", str(workload), "--model-impl", impl]
    assert main([*argv, "--no-baseline", "--no-tqdm", "--no-roof", "--json-out", str(out)]) == 0
    kv = json.loads(out.read_text())["kvserve"]
    assert kv["model_impl"] == ran and kv["output_tokens"] == 8
    assert f"kvserve ({ran} model):" in capsys.readouterr().out
