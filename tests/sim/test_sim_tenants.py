"""The simulator with tenants: the ``tenant`` column / key of traces and workload files, the
summary's ``tenants`` section, and the ``fair`` policy on the virtual clock (a flooding tenant
against a light one)."""

import pytest

from kvserve.config import EngineArgs
from kvserve.sim.cli import simulate
from kvserve.workload.workload import BenchRequest, load_trace, load_workload


def test_trace_and_workload_tenant_column(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens,tenant\n0.0,10,2,a\n0.5,12,3,\n1.0,8,1,b\n"
    )
    assert [r.tenant for r in load_trace(csv)] == ["a", None, "b"]
    bad = tmp_path / "b.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,tenant\n0.0,10,2," + "x" * 257 + "\n")
    with pytest.raises(
        ValueError, match=r"b.csv:2: tenant must be a string of at most 256 characters, got 257"
    ):
        load_trace(bad)
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        '{"prompt_token_ids": [1, 2], "output_len": 2, "tenant": "a"}\n{"prompt_token_ids": [3], "output_len": 1}\n'
    )
    assert [r.tenant for r in load_workload(wl)] == ["a", None]
    wl.write_text('{"prompt_token_ids": [1, 2], "output_len": 2, "tenant": 5}\n')
    with pytest.raises(ValueError, match="w.jsonl:1: tenant must be a string"):
        load_workload(wl)
    mc = tmp_path / "m.jsonl"
    mc.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "tenant": "c"}\n')
    assert [r.tenant for r in load_trace(mc)] == ["c"]


def _flood():
    """Tenant ``heavy`` sends 60 requests at t=0; ``light`` sends 6, one every 0.5 s from t=0.1."""
    reqs = [
        BenchRequest([(7 * i + j) % 900 + 3 for j in range(64)], 32, arrival_s=0.0, id=i, tenant="heavy")
        for i in range(60)
    ]
    reqs += [
        BenchRequest(
            [(5 * i + j) % 900 + 3 for j in range(64)],
            32,
            arrival_s=0.1 + 0.5 * k,
            id=100 + k,
            tenant="light",
        )
        for k, i in enumerate(range(6))
    ]
    return reqs


@pytest.mark.parametrize("chunked", [False, True])
def test_fair_cuts_the_light_tenants_queue_time_under_a_flood(chunked):
    args = dict(
        num_gpu_blocks=64, block_size=16, max_model_len=512, max_num_seqs=8, enable_chunked_prefill=chunked
    )
    fcfs = simulate(EngineArgs(**args), _flood())
    fair = simulate(EngineArgs(policy="fair", **args), _flood())
    for s in (fcfs, fair):
        assert s["finished"] == 66
        assert s["tenants"]["light"]["finished"] == 6 and s["tenants"]["heavy"]["finished"] == 60
        assert s["tenants"]["light"]["served_tokens"] == 6 * (64 + 32)
    light_fcfs = fcfs["tenants"]["light"]["queue_s"]["mean"]
    light_fair = fair["tenants"]["light"]["queue_s"]["mean"]
    # fcfs: light waits behind heavy's backlog; fair: behind at most what is running
    assert light_fair < 0.25 * light_fcfs, (light_fair, light_fcfs)
    # the same work is done either way
    assert fair["output_tokens"] == fcfs["output_tokens"]


def test_simulate_prints_a_line_per_tenant(tmp_path, capsys):
    """``kvserve simulate`` prints the ``tenants`` section (what the fair-scheduling table
    reads), not only the aggregate quantiles, which the two policies share on this flood."""
    import json

    from kvserve.sim.cli import main

    wl = tmp_path / "flood.jsonl"
    wl.write_text(
        "".join(
            json.dumps(
                {
                    "prompt_token_ids": r.prompt_token_ids,
                    "output_len": r.output_len,
                    "arrival_s": r.arrival_s,
                    "id": r.id,
                    "tenant": r.tenant,
                }
            )
            + "\n"
            for r in _flood()
        )
    )
    out_json = tmp_path / "fair.json"
    argv = ["--workload", str(wl), "--num-gpu-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "8"]
    assert main(argv + ["--scheduling-policy", "fair", "--json-out", str(out_json)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tenant")]
    t = json.loads(out_json.read_text())["tenants"]
    light = t["light"]
    assert light["queue_s"]["mean"] < 1.0 < t["heavy"]["queue_s"]["mean"]
    assert lines == [
        f"tenant heavy: 60 finished, 5760 served tokens, queue s mean {t['heavy']['queue_s']['mean']:.3f} "
        f"max {t['heavy']['queue_s']['max']:.3f}, ttft s p90 {t['heavy']['ttft_s']['p90']:.3f}",
        f"tenant light: 6 finished, 576 served tokens, queue s mean {light['queue_s']['mean']:.3f} "
        f"max {light['queue_s']['max']:.3f}, ttft s p90 {light['ttft_s']['p90']:.3f}",
    ]


def test_tenant_lines_cap_the_count():
    from kvserve.sim.cli import MAX_TENANT_LINES, tenant_lines

    stats = {"mean": 1.0, "max": 2.0, "p90": None}
    tenants = {
        f"t{i:02d}": {"finished": 1, "served_tokens": i, "queue_s": stats, "ttft_s": stats} for i in range(20)
    }
    lines = tenant_lines(tenants)
    assert len(lines) == MAX_TENANT_LINES + 1
    assert lines[0] == "tenant t19: 1 finished, 19 served tokens, queue s mean 1.000 max 2.000, ttft s p90 -"
    assert lines[-1] == f"tenants: {20 - MAX_TENANT_LINES} more (--json-out lists them)"
