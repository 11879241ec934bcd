"""Fault isolation in ``LLMEngine.step``: a step that raises for one request ends only that
request (``failed``, its id in the error), every other request's output equals a run without
it, blocks are conserved, and the engine keeps serving.

The property test drives the real scheduler and block manager on the simulator (whose shadow KV
cache turns any stale, double-swapped or unwritten block into a different token or a
``KVCacheCorruption``) in every mode, with a fault injected *after* the executor applied the
step's block moves and wrote its K/V (the worst case: the retry must not apply them again)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.fault_isolation import bisect_failures
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import BlockMoveError
from tests.core.simutil import Harness, configs, prompt_of
from tests.core.test_stateful import BASE, oracle


class InjectedFault(RuntimeError):
    pass


def inject(harness: Harness, bad: set[str], from_step: int, before: bool = False) -> list[int]:
    """Make the executor raise for every batch holding a request of ``bad`` from the
    ``from_step``-th executor call on (after running it, unless ``before``). Returns a list
    that counts the calls."""
    real = harness.executor.execute_model
    harness.allow_failed = True
    calls: list[int] = []

    def execute_model(req):
        calls.append(len(req.seq_group_metadata_list))
        hit = len(calls) >= from_step and any(m.request_id in bad for m in req.seq_group_metadata_list)
        if hit and before:
            raise InjectedFault("poisoned before running")
        out = real(req)
        if hit:
            raise InjectedFault("poisoned row")
        return out

    harness.executor.execute_model = execute_model
    return calls


requests_st = st.lists(
    st.tuples(st.integers(1, 20), st.integers(1, 3), st.integers(1, 8), st.booleans()),
    min_size=2,
    max_size=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests_st,
    bad_mask=st.lists(st.booleans(), min_size=6, max_size=6),
    from_step=st.integers(1, 12),
    cp=st.booleans(),
    pc=st.booleans(),
    pm=st.sampled_from([None, "recompute", "swap"]),
    G=st.integers(10, 24),
)
def test_a_faulty_request_never_changes_the_others(reqs, bad_mask, from_step, cp, pc, pm, G):
    cc, sc = configs(BS=4, G=G, C=16, S=4, T=24, L=32, CP=cp, PC=pc, PM=pm)
    h = Harness(cc, sc)
    bad = {f"r{i}" for i in range(len(reqs)) if bad_mask[i]}
    if len(bad) == len(reqs):
        bad.discard("r0")
    inject(h, bad, from_step)
    expected = {}
    for i, (plen, n, max_tokens, shared) in enumerate(reqs):
        prompt = (BASE[:8] if shared else []) + prompt_of(i, plen)
        prompt = prompt[:24]
        params = SamplingParams(
            n=n, max_tokens=max_tokens, temperature=0.0 if n == 1 else 1.0, seed=i, ignore_eos=True
        )
        try:
            h.add(f"r{i}", prompt, params)
        except ValueError as e:  # its sequences can never fit the tiny cache: refused, not queued
            assert "KV cache" in str(e), e
            continue
        expected[f"r{i}"] = oracle(prompt, n, max_tokens)
    free0 = h.scheduler.block_manager.get_num_free_gpu_blocks()
    h.run(max_steps=2000)
    h.assert_idle()
    assert h.scheduler.block_manager.get_num_free_gpu_blocks() == free0
    for rid, want in expected.items():
        out = h.outputs[rid]
        assert h.num_final[rid] == 1
        if rid in bad and out.outcome == "failed":
            assert rid in out.error and "InjectedFault" in out.error
            continue
        # innocent (or a bad one that finished before the fault was armed): the clean answer
        assert out.outcome == "finished", (rid, out.outcome, out.error)
        if out.error is None:
            assert sorted(h.tokens(rid)) == sorted(want), rid
        else:  # outgrew the tiny cache: length-capped, its tokens a prefix of the answer
            assert "KV blocks" in out.error
            for toks in h.tokens(rid):
                assert any(w[: len(toks)] == toks for w in want), rid


def test_engine_serves_after_a_fault_in_every_row():
    """A fault of the engine itself (every batch raises): every scheduled request fails, the
    blocks come back, and once the fault is gone the engine serves again."""
    cc, sc = configs(BS=4, G=16, C=0, S=4, T=32, L=32)
    h = Harness(cc, sc)
    calls = inject(h, {"a", "b", "c"}, 1, before=True)
    for rid in "abc":
        h.add(rid, prompt_of(ord(rid), 5), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    h.run(max_steps=50)
    h.assert_idle()
    assert {h.outputs[r].outcome for r in "abc"} == {"failed"}
    assert len(calls) == 2 * 3 - 1  # the batch, then bisection down to each row
    h.add("d", prompt_of(4, 5), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    h.run(max_steps=50)
    assert h.outputs["d"].outcome == "finished"
    assert h.tokens("d") == oracle(prompt_of(4, 5), 1, 3)
    h.assert_idle()


def test_failed_block_moves_end_the_step_and_the_swapped_out_groups_only():
    """A fault while applying swaps/copies (nothing ran): the step's groups and the groups
    swapped out by it fail; everyone else finishes with the clean answer."""
    cc, sc = configs(BS=4, G=8, C=16, S=3, T=32, L=32, PM="swap")
    h = Harness(cc, sc)
    h.allow_failed = True
    real = h.executor.execute_model
    failed_once = []

    def execute_model(req):
        if req.blocks_to_swap_out and not failed_once:
            failed_once.append(dict(req.blocks_to_swap_out))
            raise BlockMoveError("swap-out failed")
        return real(req)

    h.executor.execute_model = execute_model
    prompts = {f"r{i}": prompt_of(i, 6) for i in range(5)}
    for rid, p in prompts.items():
        h.add(rid, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    h.run(max_steps=200)
    h.assert_idle()
    assert failed_once, "the scenario must swap"
    outcomes = {rid: h.outputs[rid].outcome for rid in prompts}
    assert "failed" in outcomes.values() and "finished" in outcomes.values()
    for rid, p in prompts.items():
        if outcomes[rid] == "finished":
            assert h.tokens(rid) == oracle(p, 1, 10)


def test_bisection_finds_exactly_the_failing_rows():
    items = list(range(11))
    bad = {3, 4, 9}
    runs = []

    def run(sub):
        runs.append(sub)
        if bad & set(sub):
            raise ValueError(f"bad {sorted(bad & set(sub))}")
        return [x * 10 for x in sub]

    results, faults = bisect_failures(run, items, ValueError("all"))
    assert sorted(faults) == [3, 4, 9]
    assert all(isinstance(e, ValueError) for e in faults.values())
    assert results == [None if i in bad else i * 10 for i in items]
    # every good item ran successfully exactly once
    ok = [x for sub in runs if not bad & set(sub) for x in sub]
    assert sorted(ok) == sorted(set(items) - bad)
    _, faults = bisect_failures(run, [3], ValueError("alone"))
    assert str(faults[0]) == "alone"
