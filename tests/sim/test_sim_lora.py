"""The simulator with LoRA requests: adapter ids from a trace column or a distribution, the
per-adapter cost term, the summary's ``lora`` section and ``kvserve simulate``'s flags."""

import json
from collections import Counter

import pytest

from kvserve.config import EngineArgs
from kvserve.sim.cli import main, simulate
from kvserve.sim.cost_model import CostModel
from kvserve.sim.lora import draw_lora_ids, sim_lora_request
from kvserve.workload.workload import BenchRequest, generate_arrivals, load_trace, load_workload


def _requests(lora_ids, prompt_len=48, output_len=16, rate=40.0):
    arrivals = generate_arrivals(len(lora_ids), rate, seed=1)
    return [
        BenchRequest(
            prompt_token_ids=[(11 * i + j) % 1000 + 3 for j in range(prompt_len)],
            output_len=output_len,
            arrival_s=t,
            id=i,
            lora_id=lid,
        )
        for i, (t, lid) in enumerate(zip(arrivals, lora_ids))
    ]


def test_draw_lora_ids_uniform_and_zipf_are_seeded_and_skewed_as_named():
    u = draw_lora_ids(3000, 4, "uniform", seed=3)
    assert u == draw_lora_ids(3000, 4, "uniform", seed=3) and set(u) == {1, 2, 3, 4}
    assert max(Counter(u).values()) < 1.2 * min(Counter(u).values())
    z = Counter(draw_lora_ids(3000, 4, "zipf", alpha=1.0, seed=3))
    # weights 1, 1/2, 1/3, 1/4 -> shares .48, .24, .16, .12
    assert z[1] > z[2] > z[3] > z[4] and 0.42 < z[1] / 3000 < 0.54


@pytest.mark.parametrize(
    "args,flag",
    [((5, 0), "--num-loras"), ((5, 2, "pareto"), "--lora-dist"), ((5, 2, "zipf", 0.0), "--lora-zipf-alpha")],
)
def test_draw_lora_ids_bad_values_name_the_flag(args, flag):
    with pytest.raises(ValueError, match=flag):
        draw_lora_ids(*args)


def test_sim_lora_request_zero_is_the_base_model():
    assert sim_lora_request(0) is None
    r = sim_lora_request(7)
    assert r.lora_int_id == 7 and r.lora_name == "sim-lora-7"


def test_trace_and_workload_lora_id_column(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens,lora_id\n0.0,10,2,3\n0.5,12,3,\n1.0,8,1,0\n"
    )
    assert [r.lora_id for r in load_trace(csv)] == [3, 0, 0]
    plain = tmp_path / "p.csv"
    plain.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,2\n")
    assert [r.lora_id for r in load_trace(plain)] == [0]
    bad = tmp_path / "b.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,lora_id\n0.0,10,2,-1\n")
    with pytest.raises(ValueError, match=r"b.csv:2: lora_id must be an integer >= 0"):
        load_trace(bad)
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        '{"prompt_token_ids": [1, 2], "output_len": 2, "lora_id": 2}\n{"prompt_token_ids": [3], "output_len": 1}\n'
    )
    assert [r.lora_id for r in load_workload(wl)] == [2, 0]
    wl.write_text('{"prompt_token_ids": [1, 2], "output_len": 2, "lora_id": "x"}\n')
    with pytest.raises(ValueError, match="w.jsonl:1: lora_id"):
        load_workload(wl)


def test_simulated_executor_has_the_executor_lora_interface():
    from kvserve.sim.executor import SimulatedExecutor

    ex = SimulatedExecutor(100)
    a = sim_lora_request(3)
    assert ex.add_lora(a) and not ex.add_lora(a) and ex.list_loras() == {3}
    assert ex.remove_lora(3) and not ex.remove_lora(3) and ex.list_loras() == set()


def test_cost_model_adds_the_per_adapter_term():
    cm = CostModel()
    base = cm.step_time(100, 4, 400)
    assert cm.step_time(100, 4, 400, num_loras=3) == pytest.approx(base + 3 * cm.lora_adapter_s)
    assert cm.step_time(0, 0, 0, num_loras=2) == 0.0  # an empty step costs nothing


def test_simulate_max_loras_limits_adapters_per_step_and_costs_latency():
    reqs = _requests([1 + i % 4 for i in range(40)])
    args = dict(num_gpu_blocks=256, block_size=16, max_model_len=512)
    one = simulate(EngineArgs(max_loras=1, **args), reqs)
    four = simulate(EngineArgs(max_loras=4, **args), reqs)
    base = simulate(EngineArgs(**args), _requests([0] * 40))
    for s in (one, four):
        assert s["finished"] == 40 and s["output_tokens"] == 40 * 16
    assert one["lora"]["max_loras"] == 1 and one["lora"]["num_adapters"] == 4
    assert one["lora"]["mean_adapters_per_step"] <= 1.0
    assert four["lora"]["mean_adapters_per_step"] > 1.5
    assert set(one["lora"]["ttft_s_by_adapter"]) == {1, 2, 3, 4}
    # One slot serialises the adapters: requests wait for theirs.
    assert one["e2e_s"]["mean"] > four["e2e_s"]["mean"]
    # Adapters cost time even with a slot for each (the placeholder per-adapter term).
    assert four["duration_s"] > base["duration_s"] and "lora" not in base


def test_cli_num_loras_and_trace_column(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rows = "".join(f"{i * 0.05},{32 + i % 7},{4 + i % 3},{i % 3}\n" for i in range(24))
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,lora_id\n" + rows)
    out = tmp_path / "s.json"
    common = [
        "--trace",
        str(trace),
        "--num-gpu-blocks",
        "256",
        "--max-model-len",
        "512",
        "--json-out",
        str(out),
    ]
    assert main(common + ["--max-loras", "2"]) == 0
    text = capsys.readouterr().out
    assert "LoRA: 2 adapters, max_loras 2" in text
    assert main(common + ["--num-loras", "5", "--lora-dist", "zipf", "--max-loras", "3"]) == 0
    assert "max_loras 3" in capsys.readouterr().out
    s = json.loads(out.read_text())
    assert s["finished"] == 24 and s["lora"]["num_adapters"] <= 5
    assert main(common + ["--num-loras", "0"]) == 2
    assert "--num-loras must be an integer >= 1" in capsys.readouterr().err
