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
