"""The scheduling workloads, Jain's index, the ranking logic and both commands on the simulator."""

from __future__ import annotations

import json

import pytest

from kvserve.benchmarks import fairness, preemption
from kvserve.benchmarks import scheduling as sb
from kvserve.workload import scheduling as ws

CORPUS = [3 + (i * 7919) % 40000 for i in range(1 << 14)]
ROWS = [(100 + 37 * i, 5 + i % 30) for i in range(60)]


def test_scale_lengths_rule():
    # 8192 -> 512, 4096 -> 256, tiny prompts and outputs clamped up, long outputs down
    assert ws.scale_lengths([(8192, 10), (4096, 100), (10, 1), (7437, 48)], 512, 48) == [
        (512, 10),
        (256, 48),
        (16, 4),
        (465, 48),
    ]
    with pytest.raises(ValueError, match="max_prompt_len"):
        ws.scale_lengths([(1, 1)], 8, 48)


def test_tenant_rule_is_deterministic_and_skewed():
    names = [ws.tenant_of(i, 2, 1.0) for i in range(3000)]
    assert names == [ws.tenant_of(i, 2, 1.0) for i in range(3000)]
    share = names.count("t0") / len(names)
    assert abs(share - 2 / 3) < 0.03
    assert {ws.tenant_of(i, 3, 0.0) for i in range(300)} == {"t0", "t1", "t2"}
    assert ws.tenant_of(0, 2) == "t0"  # u = 0
    with pytest.raises(ValueError, match="num_tenants"):
        ws.tenant_of(1, 0)


def test_flood_and_alone_shapes():
    flood, alone = ws.flood_workloads(ROWS, CORPUS, num_a=40, num_b=4)
    a = [r for r in flood.requests if r.tenant == "A"]
    b = [r for r in flood.requests if r.tenant == "B"]
    assert len(a) == 40 and len(b) == 4
    assert all(r.arrival_s == 0.0 and r.priority == 1 for r in a)
    assert all(r.arrival_s == 1.0 and r.priority == 0 for r in b)
    assert [(r.prompt_len, r.output_len) for r in a] == ROWS[:40]
    assert [r.id for r in alone.requests] == [r.id for r in b]
    assert len({r.id for r in flood.requests}) == 44
    need = sum(-(-(p + o) // 16) for p, o in ROWS[:40])
    assert flood.num_gpu_blocks == alone.num_gpu_blocks == need // 2
    again, _ = ws.flood_workloads(ROWS, CORPUS, num_a=40, num_b=4)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in flood.requests]
    with pytest.raises(ValueError, match="44 length rows"):
        ws.flood_workloads(ROWS[:10], CORPUS)


def test_backlogged_head_of_line_and_preemption_shapes():
    bl = ws.backlogged_workload(ROWS, CORPUS, num=48)
    assert all(r.arrival_s == 0 for r in bl.requests)
    assert [r.tenant for r in bl.requests] == ["A" if ws.tenant_of(i) == "t0" else "B" for i in range(48)]
    hol = ws.head_of_line_workload(CORPUS)
    assert [(r.prompt_len, r.output_len, r.arrival_s, r.after_id) for r in hol.requests[:5]] == [
        (176, 48, 0.0, None)
    ] * 4 + [(400, 8, 0.1, 3)]
    assert len(hol.requests) == 13 and all(r.prompt_len == 32 for r in hol.requests[5:])
    # the long prompt's 25 blocks exceed what the holders' prompts leave free
    assert 400 // 16 > hol.num_gpu_blocks - 4 * 176 // 16
    full = {w.name: w for w in ws.preemption_workloads(CORPUS)}
    assert sorted(full) == ["long", "many-short", "n4"]
    assert all(r.n == 4 for r in full["n4"].requests)
    # more KV than the cache holds: every workload must preempt
    for w in full.values():
        need = sum(r.n * -(-(r.prompt_len + r.output_len) // 16) for r in w.requests)
        assert need > w.num_gpu_blocks


def test_jain_index_hand_values():
    assert ws.jain_index([1, 1]) == 1.0
    assert ws.jain_index([2, 1]) == pytest.approx(9 / 10)
    assert ws.jain_index([1, 0, 0, 0]) == pytest.approx(1 / 4)
    assert ws.jain_index([3, 1, 2]) == pytest.approx(36 / 42)
    assert ws.jain_index([]) is None and ws.jain_index([0, 0]) is None


def test_windowed_jain_by_hand():
    # both active over [0, 20]: window 1 has A 10 tokens, B 10; window 2 A 30, B 10
    times = {
        "A": [0.5 + i for i in range(10)] + [10 + i / 3 for i in range(30)],
        "B": [0.5 + i for i in range(20)],
    }
    active = {"A": (0.0, 20.0), "B": (0.0, 20.0)}
    res = ws.windowed_jain(times, active, window_s=10.0)
    assert res["windows"] == pytest.approx([1.0, 40**2 / (2 * (900 + 100))])
    assert res["mean"] == pytest.approx((1.0 + 0.8) / 2)
    # weights: B's weight 1/3 makes its 10 tokens count as 30, A's 30 in window 2: fair
    w = ws.windowed_jain(times, active, {"A": 1.0, "B": 1 / 3}, window_s=10.0)
    assert w["windows"][1] == pytest.approx(1.0)
    # only the shared span [5, 6] counts: A's tokens before B arrives do not; there A got
    # the one token (at 6, the span's end) and B none (its token at 7 is past it): 1/n
    late = ws.windowed_jain({"A": [1, 2, 6], "B": [7]}, {"A": (0, 6), "B": (5, 7)}, window_s=10)
    assert late["span_s"] == (5, 6) and late["windows"] == pytest.approx([0.5])
    assert ws.windowed_jain({"A": [1]}, {"A": (0, 1)})["mean"] is None
    # a 2 s tail joins the window before it: [0, 10) and [10, 22] (A 12 tokens, B 10), where
    # a window of its own would hold only A's two tokens at 20 and 21 (index 1/2)
    tail = {
        "A": [0.5 + i for i in range(10)] + [10 + i for i in range(12)],
        "B": [0.5 + i for i in range(20)],
    }
    res = ws.windowed_jain(tail, {"A": (0.0, 22.0), "B": (0.0, 22.0)}, window_s=10.0)
    assert res["windows"] == pytest.approx([1.0, 22**2 / (2 * (144 + 100))])
    assert res["min"] == pytest.approx(22**2 / (2 * (144 + 100)))
    with pytest.raises(ValueError, match="window_s"):
        ws.windowed_jain(times, active, window_s=0)


def _row(w, runner, policy, value):
    return {"workload": w, "runner": runner, "policy": policy, "backfill": "-", "mode": "default", "v": value}


def test_prompt_service_is_spread_over_its_prefill():
    pieces = sb.spread(100.0, 2.0, 3.0)
    assert len(pieces) == 10 and sum(x for _, x in pieces) == pytest.approx(100.0)
    assert pieces[0][0] == pytest.approx(2.1) and pieces[-1][0] == pytest.approx(3.0)
    assert sb.spread(7.0, 5.0, 5.0) == [(5.0, 7.0)]  # no span: all at the first token
    # a prompt prefilled over [8, 12] with 10 s windows from 0: 19 of its 40 tenth-second
    # pieces (8.1 .. 9.9) in the first window, 21 in the second (at the first token, all 40
    # would land in the second window, and the first would read 1/2)
    res = ws.windowed_jain(
        {"A": sb.spread(40.0, 8.0, 12.0), "B": [(5.0, 20.0), (15.0, 20.0)]},
        {"A": (0.0, 20.0), "B": (0.0, 20.0)},
        window_s=10.0,
    )
    assert res["windows"] == pytest.approx([39**2 / (2 * (19**2 + 20**2)), 41**2 / (2 * (21**2 + 20**2))])


def test_rank_agreement_on_synthetic_rows():
    rows = [
        _row("x", "sim", "fcfs", 10.0),
        _row("x", "sim", "priority", 5.0),
        _row("x", "sim", "fair", 1.0),
        _row("x", "real", "fcfs", 30.0),
        _row("x", "real", "priority", 20.0),
        _row("x", "real", "fair", 20.5),  # within 5% of priority: a tie, agrees
    ]
    out = sb.rank_agreement(rows, lambda r: r["v"], higher_better=False)["x"]
    assert out["agree"] is True and out["pairs"] == 3 and out["discordant"] == []
    assert out["ties"] == {"sim": 0, "real": 1}
    assert "tied pairs: sim 0/3, real 1/3" in sb.agreement_lines({"x": out}, "m")[0]
    assert out["order"]["sim"] == ["fair/-/default", "priority/-/default", "fcfs/-/default"]
    rows[3]["v"] = 1.0  # real now puts fcfs first: discordant with both others
    out = sb.rank_agreement(rows, lambda r: r["v"], higher_better=False)["x"]
    assert out["agree"] is False
    assert out["discordant"] == [
        ("fcfs/-/default", "priority/-/default"),
        ("fcfs/-/default", "fair/-/default"),
    ]
    assert "DISAGREE" in sb.agreement_lines({"x": out}, "m")[0]
    sim_only = sb.rank_agreement(rows[:3], lambda r: r["v"], True)["x"]
    assert sim_only["agree"] is None


def test_registry_choices_and_bad_flags():
    assert sb.policy_names()[:2] == ["fcfs", "priority"]
    assert {"recompute", "swap"} <= set(sb.preemption_modes())
    assert sb.parse_choice("--policies", "priority,fcfs,fcfs", ["fcfs", "priority"]) == ["priority", "fcfs"]
    with pytest.raises(ValueError, match="--policies: nope not available"):
        sb.parse_choice("--policies", "nope", ["fcfs"])
    with pytest.raises(ValueError, match="--runners"):
        sb.parse_choice("--runners", " , ", sb.RUNNERS)
    assert fairness.main(["--runners", "sim", "--policies", "lottery"]) == 2
    assert fairness.main(["--runners", "sim", "--max-num-batched-tokens", "0"]) == 2
    for cmd in (fairness, preemption):  # a usage error naming the flag, before anything runs
        with pytest.raises(SystemExit) as e:
            cmd.main(["--runners", "sim", "--dtype", "bogus"])
        assert e.value.code == 2


def test_step_budget_reaches_both_runners_engine_args():
    ap = sb.build_parser("x", "", "default")
    _, configs, base, _ = sb.resolve(ap.parse_args(["--runners", "sim", "--max-num-batched-tokens", "384"]))
    w = ws.SchedWorkload("w", [], num_gpu_blocks=64)
    assert sb.engine_args(base, w, configs[0]).max_num_batched_tokens == 384
    _, _, default, _ = sb.resolve(ap.parse_args(["--runners", "sim"]))
    assert default.max_num_batched_tokens is None  # the engine's own default


def test_preemption_command_on_the_simulator(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert preemption.main(["--runners", "sim", "--quick", "--policies", "fcfs", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recomputed tok" in text and "ranking by output tok/s (long)" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == set(sb.preemption_modes())
    for r in rows:
        assert r["num_finished"] == r["num_requests"]
        assert r["output_tok_s"] > 0
    # the table's latency columns are milliseconds, as their headers say
    header, _, first, *_ = text[text.index("workload ") :].splitlines()
    assert "ttft p90 ms" in header
    col = header.index("ttft p90 ms") + len("ttft p90 ms")
    cell = first[:col].split()[-1]
    (tenant,) = rows[0]["tenants"].values()  # one tenant
    assert float(cell.replace(",", "")) == pytest.approx(tenant["ttft"]["p90"] * 1000, abs=0.01)
    by = {(r["workload"], r["mode"]): r for r in rows}
    # recompute mode preempts by recompute and re-prefills; swap mode moves blocks instead
    assert by[("long", "recompute")]["num_recompute_preemptions"] > 0
    assert by[("long", "recompute")]["recomputed_tokens"] >= 256
    assert by[("n4", "swap")]["num_swap_preemptions"] > 0
    assert by[("n4", "swap")]["recomputed_tokens"] == 0


def test_fairness_command_on_the_simulator(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sb, "trace_rows", lambda quick, num: ws.scale_lengths(ROWS[:num], 512, 24))
    out = tmp_path / "f.json"
    assert fairness.main(["--runners", "sim", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "B p90 alone" in text and "ranking by Jain's index (backlogged)" in text
    data = json.loads(out.read_text())
    rows = {(r["workload"], r["policy"], r["backfill"]): r for r in data["rows"]}
    assert {w for w, _, _ in rows} == {"flood", "backlogged", "head-of-line"}
    settings = {(p, b) for _, p, b in rows}
    assert {p for p, _ in settings} == set(sb.policy_names())
    backfills = ["off", "on"] if sb.backfill_supported() else ["-"]
    assert {b for _, b in settings} == set(backfills)
    off = backfills[0]
    flood = rows[("flood", "fcfs", off)]
    b90 = flood["tenants"]["B"]["ttft"]["p90"]
    assert flood["b_ttft_p90_alone"] is not None and b90 >= flood["b_ttft_p90_alone"]
    assert 0.5 <= rows[("backlogged", "fcfs", off)]["jain"] <= 1.0
    # head-of-line without backfill: the short requests wait behind the long prompt
    hol = rows[("head-of-line", "fcfs", off)]["tenants"]
    assert hol["B"]["ttft"]["p50"] > hol["A"]["ttft"]["p50"]
    if sb.backfill_supported():  # with it they start past the blocked prompt
        on = rows[("head-of-line", "fcfs", "on")]["tenants"]
        assert on["B"]["ttft"]["p50"] < hol["B"]["ttft"]["p50"] / 2


def test_step_prices_recover_a_linear_step_time():
    """Steps timed exactly ``0.01 + 0.002 * prefill tokens + 0.005 * decodes``: the fit gives
    back the per-token slope, and the decode-only steps' mean is their own time."""
    from types import SimpleNamespace

    from kvserve.sim.step_shape import StepShape

    shapes = [(64, 0), (0, 4), (32, 2), (128, 1), (0, 8), (16, 0)]
    steps = [
        SimpleNamespace(shape=StepShape(prefill_tokens=p, decode_seqs=d), step_s=0.01 + 0.002 * p + 0.005 * d)
        for p, d in shapes
    ]
    token_s, decode_s = sb.step_prices(steps)
    assert token_s == pytest.approx(0.002)
    assert decode_s == pytest.approx(((0.01 + 0.02) + (0.01 + 0.04)) / 2)
    # no prompt tokens: no slope to fit
    assert sb.step_prices(steps[1:2] * 4) == (None, pytest.approx(0.03))


def test_fairness_rows_count_rank_preemptions(tmp_path, monkeypatch):
    """The rows carry the preemptions by rank (``fair``'s by share) and their mode."""
    monkeypatch.setattr(sb, "trace_rows", lambda quick, num: ws.scale_lengths(ROWS[:num], 512, 24))
    out = tmp_path / "f.json"
    args = ["--runners", "sim", "--quick", "--policies", "fcfs,fair", "--backfill", "off", "--json", str(out)]
    assert fairness.main(args) == 0
    rows = {(r["workload"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    assert all(r["num_rank_preemptions"] == 0 for (_, p), r in rows.items() if p == "fcfs")
    fair = [r for (_, p), r in rows.items() if p == "fair"]
    assert sum(r["num_rank_preemptions"] for r in fair) > 0
    for r in fair:  # the host pool has room: every share preemption swaps, none recomputes
        assert r["num_rank_swap_preemptions"] == r["num_rank_preemptions"]
        assert r["num_rank_recomputed_tokens"] == 0


def test_workloads_flag_picks_by_name(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sb, "trace_rows", lambda quick, num: ws.scale_lengths(ROWS[:num], 512, 24))
    out = tmp_path / "h.json"
    assert (
        fairness.main(
            ["--runners", "sim", "--policies", "fcfs", "--workloads", "head-of-line", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {r["workload"] for r in rows} == {"head-of-line"}
    # the long prompt is tenant A's last first token: its TTFT is A's largest
    a = rows[0]["tenants"]["A"]["ttft"]
    assert a["max"] >= a["p90"] >= a["p50"]
    # b-alone comes with flood only; an unknown name is refused naming the flag
    wls = fairness.workloads(quick=True)
    assert [w.name for w in sb.select_workloads("flood", wls, {"b-alone": "flood"})] == ["flood", "b-alone"]
    for bad in ("b-alone", "nope"):
        with pytest.raises(ValueError, match="--workloads"):
            sb.select_workloads(bad, wls, {"b-alone": "flood"})
