"""LoRA slot turnover (``LoRAConfig.max_slot_preemptions``): a lone straggler's adapter slot is
handed to an adapter with more groups waiting by preempting the straggler (recompute), at most
``max_slot_preemptions`` times per group; slots never exceed ``max_loras``, order within an
adapter stays FCFS, nobody starves, blocks are conserved, and the tokens are those of a run
without it. Also the slot rule's lower bound on the steps of a burst, which the default policy
stays close to on the benchmark's workload."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.benchmarks.lora_occupancy import assign_round_robin, occupancy, slot_bound_steps
from kvserve.config import EngineArgs, LoRAConfig
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams
from kvserve.workload.workload import BenchRequest, default_workload_path, load_workload
from tests.core.simutil import Harness, configs, lora, make_group, prompt_of
from tests.core.test_lora_scheduler import run_lora_workload, waiting_ids
from tests.core.test_scheduler import ids, sched_step


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("bad", [-1, 9, True, 1.0, "1"])
def test_max_slot_preemptions_out_of_range_is_an_error_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"max_slot_preemptions must be an integer in \[0, 8\]"):
        LoRAConfig(max_loras=2, max_slot_preemptions=bad)
    with pytest.raises(ValueError, match="max_slot_preemptions"):
        EngineArgs(enable_lora=True, max_slot_preemptions=bad)


def test_max_slot_preemptions_defaults_to_off_and_reaches_the_lora_config():
    assert LoRAConfig().max_slot_preemptions == 0
    lc = EngineArgs(enable_lora=True, max_loras=2, max_slot_preemptions=3).create_lora_config()
    assert lc is not None and lc.max_slot_preemptions == 3


# ---------------------------------------------------------------- unit
def _straggler_and_pair(CP, msp, waiting_b=2):
    """max_loras=1: ``a`` (adapter 1, 12 tokens) runs; ``waiting_b`` groups of adapter 2
    arrive behind it."""
    cc, sc = configs(G=64, S=8, T=64, CP=CP)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1, max_slot_preemptions=msp))
    sched.add_seq_group(make_group("a", prompt_of(0, 8), max_tokens=12, arrival_time=0, lora_request=lora(1)))
    for k in range(waiting_b):
        sched.add_seq_group(
            make_group(f"b{k}", prompt_of(k + 1, 8), max_tokens=2, arrival_time=1 + k, lora_request=lora(2))
        )
    return sched


@pytest.mark.parametrize("CP", [False, True])
def test_turnover_preempts_the_lone_straggler_and_admits_the_waiting_adapter_in_that_step(CP):
    sched = _straggler_and_pair(CP, msp=1)
    _, out = sched_step(sched)
    assert ids(out) == ["a"] and waiting_ids(sched) == ["b0", "b1"]
    _, out = sched_step(sched)
    # a holds its slot alone and adapter 2 has 2 >= 2 x 1 groups waiting: a is recomputed
    assert ids(out) == ["b0", "b1"] and out.preempted == 1
    assert waiting_ids(sched) == ["a"] and sched._slot_preemptions == {"a": 1}
    assert sched.num_slot_preemptions == 1 and sched.num_recompute_preemptions == 1
    history = []
    for _ in range(40):
        if not sched.has_unfinished_seqs():
            break
        _, out = sched_step(sched)
        history.append(ids(out))
    assert not sched.has_unfinished_seqs()
    # b0, b1 decode to their end, then a resumes (re-prefilled) and is never preempted again
    assert history[0] == ["b0", "b1"] and all(h == ["a"] for h in history[1:])
    assert sched.num_slot_preemptions == 1 and not sched._slot_preemptions
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_turnover_takes_all_groups_of_the_adapter_and_keeps_their_order():
    """Two running groups give way to four waiting ones (2 x 2 <= 4); they go back to the
    front of ``waiting`` in their order and resume together."""
    cc, sc = configs(G=64, S=8, T=64, CP=True)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1, max_slot_preemptions=1))
    for k in range(2):
        sched.add_seq_group(
            make_group(f"a{k}", prompt_of(k, 8), max_tokens=12, arrival_time=k, lora_request=lora(1))
        )
    for k in range(4):
        sched.add_seq_group(
            make_group(f"b{k}", prompt_of(k + 2, 8), max_tokens=2, arrival_time=2 + k, lora_request=lora(2))
        )
    _, out = sched_step(sched)
    assert ids(out) == ["a0", "a1"]
    _, out = sched_step(sched)
    assert ids(out) == ["b0", "b1", "b2", "b3"] and out.preempted == 2
    assert waiting_ids(sched) == ["a0", "a1"]
    sched_step(sched)
    _, out = sched_step(sched)
    assert ids(out) == ["a0", "a1"]


@pytest.mark.parametrize("CP", [False, True])
def test_turnover_off_or_too_little_waiting_work_keeps_vllm_rule(CP):
    for msp, waiting_b in [(0, 2), (1, 1)]:
        sched = _straggler_and_pair(CP, msp=msp, waiting_b=waiting_b)
        for _ in range(12):
            _, out = sched_step(sched)
            assert ids(out) == ["a"], (msp, waiting_b)
        assert sched.num_preemptions == 0


def test_turnover_never_preempts_a_group_mid_prefill():
    cc, sc = configs(G=64, S=8, T=8, L=64, CP=True)
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1, max_slot_preemptions=2))
    sched.add_seq_group(make_group("a", prompt_of(0, 40), max_tokens=4, lora_request=lora(1)))
    for k in range(3):
        sched.add_seq_group(
            make_group(f"b{k}", prompt_of(k + 1, 4), max_tokens=2, arrival_time=1 + k, lora_request=lora(2))
        )
    for _ in range(5):  # a's 40-token prompt takes 5 steps of 8
        _, out = sched_step(sched)
        assert ids(out) == ["a"]
    assert sched.num_preemptions == 0
    _, out = sched_step(sched)  # now a decodes alone: turned over (two 4-token prompts fit 8)
    assert ids(out) == ["b0", "b1"] and sched.num_slot_preemptions == 1
    assert waiting_ids(sched) == ["a", "b2"]


@pytest.mark.parametrize("straggler_priority,turned", [(0, False), (5, True)])
def test_turnover_under_priority_policy_only_for_a_group_that_outranks_the_straggler(
    straggler_priority, turned
):
    cc, sc = configs(G=64, S=8, T=64, CP=True, policy="priority")
    sched = Scheduler(sc, cc, LoRAConfig(max_loras=1, max_slot_preemptions=1))
    sched.add_seq_group(
        make_group("a", prompt_of(0, 8), max_tokens=12, priority=straggler_priority, lora_request=lora(1))
    )
    sched_step(sched)
    for k in range(2):
        sched.add_seq_group(
            make_group(
                f"b{k}",
                prompt_of(k + 1, 8),
                max_tokens=2,
                arrival_time=1 + k,
                priority=2,
                lora_request=lora(2),
            )
        )
    _, out = sched_step(sched)
    assert ids(out) == (["b0", "b1"] if turned else ["a"])
    assert sched.num_slot_preemptions == int(turned)


# ---------------------------------------------------------------- property
@st.composite
def turnover_workloads(draw):
    """Mostly adapter requests over more adapters than slots, with mixed output lengths (so
    stragglers are common), random arrival steps, on random tiny caches."""
    n = draw(st.integers(2, 14))
    bs = draw(st.sampled_from([2, 4]))
    reqs = [
        (
            draw(st.integers(0, 6)),  # arrival step
            draw(st.sampled_from([0, 1, 1, 2, 2, 3, 3, 4])),  # adapter (0 = base)
            draw(st.integers(0, 3)),  # prompt family (shared prefixes across requests)
            draw(st.integers(1, 10)),  # prompt length
            draw(st.sampled_from([1, 2, 3, 12])),  # max_tokens
        )
        for _ in range(n)
    ]
    return dict(
        reqs=reqs,
        BS=bs,
        G=draw(st.integers(24 // bs + 1, 24 // bs + 12)),  # any one request fits alone
        CP=draw(st.booleans()),
        PC=draw(st.booleans()),
        PM=draw(st.sampled_from(["recompute", "swap"])),
        max_loras=draw(st.integers(1, 2)),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turnover_workloads(), st.integers(1, 3))
def test_property_turnover_random_arrivals_invariants_and_same_tokens(w, msp):
    """Random arrivals, lengths and adapters on random tiny caches with turnover on: every step
    holds <= max_loras adapters, blocks are conserved (both checked every step), every group
    finishes within a bounded number of steps, admission is FCFS within an adapter, no group is
    turned over more than ``msp`` times, all blocks come back, and every request's tokens equal
    those of the same run with turnover off (preemption never changes tokens)."""

    def run(m):
        counts: dict[str, int] = {}

        def note_turnovers(h):
            for rid, c in h.scheduler._slot_preemptions.items():
                counts[rid] = max(counts.get(rid, 0), c)

        lc = LoRAConfig(max_loras=w["max_loras"], max_slot_preemptions=m)
        h, added = run_lora_workload(w, lc, on_step=note_turnovers)
        sched = h.scheduler
        assert not sched._slot_preemptions
        assert all(c <= m for c in counts.values()), counts
        assert sum(counts.values()) == sched.num_slot_preemptions
        return {rid: h.tokens(rid) for rid, _ in added}, sched.num_slot_preemptions

    on, _ = run(msp)
    off, n_off = run(0)
    assert n_off == 0
    assert on == off


def test_property_turnover_happens_on_a_burst_with_stragglers():
    """Not vacuous: a burst over more adapters than slots, one long request per adapter, does
    turn slots over (each group at most once), and every request still finishes."""
    cc, sc = configs(BS=4, G=2048, S=64, T=512, L=256, CP=True)
    h = Harness(cc, sc, check_kv=True, lora_config=LoRAConfig(max_loras=2, max_slot_preemptions=1))
    for i in range(24):
        mt = 60 if i % 4 == 0 else 6
        h.add(
            f"r{i}",
            {"prompt_token_ids": prompt_of(i, 12)},
            SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True),
            lora_request=lora(i % 6 + 1),
        )
    h.run()
    h.assert_idle()
    assert h.scheduler.num_slot_preemptions >= 2
    assert all(h.outputs[f"r{i}"].outcome == "finished" for i in range(24))
    assert max(len(a) for a in h.lora_steps) <= 2


# ---------------------------------------------------------------- the slot rule's bound
def test_slot_bound_steps_is_the_adapters_longest_requests_over_the_slots():
    reqs = [BenchRequest([1], n, lora_id=lid) for n, lid in [(10, 1), (3, 1), (7, 2), (5, 3), (2, 0)]]
    assert slot_bound_steps(reqs, 2) == 11  # (10 + 7 + 5) / 2
    assert slot_bound_steps(reqs, 4) == 10  # the longest request alone
    assert slot_bound_steps([BenchRequest([1], 4)], 2) == 0


@pytest.mark.skipif(not default_workload_path().is_file(), reason="needs the shared w64 workload")
def test_w64_over_16_adapters_4_slots_runs_within_4_percent_of_the_slot_bound():
    """The benchmark's lora16 on the simulator: 64 requests round-robin over 16 adapters, 4
    slots. The default policy takes within 4% of the fewest steps the slot rule allows (each
    adapter held for its longest request), so no admission order can gain more than that;
    turnover preemption (which cannot change how many slot-steps an adapter needs) does not
    take fewer steps than the bound either."""
    reqs = assign_round_robin(load_workload(default_workload_path()), 16)
    bound = slot_bound_steps(reqs, 4)
    assert bound == 1300
    r = occupancy(reqs, 4)
    assert r["finished"] == 64 and r["slot_preemptions"] == 0
    assert bound <= r["steps"] <= 1.04 * bound, r["steps"]
    turned = occupancy(assign_round_robin(load_workload(default_workload_path()), 16), 4, 2)
    assert turned["slot_preemptions"] > 0 and turned["steps"] >= bound
    # what a slot runs per step is fixed by its adapter's lengths: turnover only moves it
    assert turned["slot_steps_by_groups"] == r["slot_steps_by_groups"]


def test_lora_occupancy_cli_prints_each_run_and_writes_json(tmp_path, capsys):
    import json

    from kvserve.benchmarks.lora_occupancy import main

    wl = tmp_path / "w.jsonl"
    wl.write_text(
        "\n".join(
            json.dumps({"prompt_token_ids": prompt_of(i, 10), "output_len": [20, 3][i % 2]}) for i in range(8)
        )
    )
    out = tmp_path / "o.json"
    rc = main(["--workload", str(wl), "--adapters", "4", "--max-loras", "2", "--slot-preemptions", "0,1"])
    assert rc == 0
    assert main(["--workload", str(wl), "--adapters", "4", "--max-loras", "2", "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "base16" in text and "lora4" in text and "bound" in text
    runs = json.loads(out.read_text())
    assert [r["run"] for r in runs] == ["base", "base16", "lora4", "lora4", "lora4"]
    lora0 = runs[2]
    # adapters 1..4 each get requests i and i + 4: lengths 20 (even i) or 3; bound = (20+3+20+3) / 2
    assert lora0["bound_steps"] == 23 and lora0["finished"] == 8 and lora0["steps"] >= 23
    assert main(["--workload", str(tmp_path / "missing.jsonl")]) == 2
