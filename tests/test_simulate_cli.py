"""`kvserve simulate`: the production engine + scheduler on the simulated executor."""

import pytest

from kvserve.benchmarks.workload import BenchRequest, default_workload_path, generate_arrivals
from kvserve.config import EngineArgs
from kvserve.sim.cli import main, simulate


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


def test_missing_trace_file_is_a_one_line_error(capsys):
    assert main(["--trace", "/nonexistent/trace.csv"]) == 2
    err = capsys.readouterr().err
    assert "--trace /nonexistent/trace.csv: no such file" in err and "Traceback" not in err


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
