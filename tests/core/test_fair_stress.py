"""The ``fair`` policy under hostile workloads on the simulator: tiny caches, step budgets down to
one token, swap and recompute preemption, n > 1, priorities within a tenant, tenants churning,
extreme tenant weights and burst credits, aborts mid-prefill. The Harness checks the scheduler's
invariants every step; every request must end (finished, or aborted when the test aborted it),
every block come back, and the policy forget every request. Greedy outputs match ``fcfs``."""

import random

import pytest

from kvserve.sampling_params import SamplingParams
from tests.core.simutil import Harness, configs, prompt_of

L = 24  # max_model_len of every case


def _workload(seed: int, extreme: bool) -> dict:
    """A random case (deterministic in ``seed``): the config and the requests as
    ``(arrival step, tenant, prompt family, prompt length, max_tokens, priority, n)``."""
    rnd = random.Random(seed)
    bs = rnd.choice([2, 4])
    pm = rnd.choice([None, "recompute", "swap"])
    budget = rnd.choice([1, 2, 4, 16, 32])
    weights = [1e-6, 0.5, 1.0, 1e6] if extreme else [0.5, 1.0, 2.0]
    bursts = [0.0, 8.0, 2048.0, 1e300] if extreme else [0.0, 8.0, 2048.0]
    chunked = budget < L or rnd.random() < 0.5
    cfg = dict(
        BS=bs,
        G=L // bs + rnd.randint(1, 4),  # any one request fits alone, barely
        C=0 if pm == "recompute" else 64,
        S=rnd.choice([1, 2, 4]),
        T=budget,
        L=L,
        CP=chunked,
        PC=rnd.random() < 0.5,
        PM=pm,
        policy="fair",
        max_num_partial_prefills=rnd.choice([1, 4]) if chunked else 1,
        tenant_weights={t: rnd.choice(weights) for t in "abc" if rnd.random() < 0.6},
        fair_burst_tokens=rnd.choice(bursts),
    )
    reqs = []
    for _ in range(rnd.randint(1, 14)):
        tenant = rnd.choice([None, "a", "b", "c", f"u{rnd.randint(0, 50)}"])
        plen = rnd.randint(1, 14)
        n = rnd.choice([1, 1, 2, 3])
        if n > min(cfg["S"], budget):
            n = 1  # the engine refuses more sequences than a step holds (its own test)
        reqs.append(
            (
                rnd.randint(0, 10),
                tenant,
                rnd.randint(0, 3),
                plen,
                rnd.randint(1, min(8, L - plen)),
                rnd.randint(0, 2),
                n,
            )
        )
    aborts = {i: rnd.randint(0, 20) for i in range(len(reqs)) if rnd.random() < 0.25}
    return dict(cfg=cfg, reqs=reqs, aborts=aborts)


def _run(cfg: dict, reqs: list, aborts: dict[int, int]) -> Harness:
    """Drive the case to the end (bounded steps: a hang fails); returns the Harness."""
    h = Harness(*configs(**cfg))
    fair = cfg["policy"] == "fair"
    pending = sorted(enumerate(reqs), key=lambda x: (x[1][0], x[0]))
    steps = 0
    while pending or h.engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, tenant, fam, plen, mt, prio, n) = pending.pop(0)
            params = SamplingParams(
                n=n, max_tokens=mt, temperature=0.0 if n == 1 else 1.0, ignore_eos=True, seed=i
            )
            h.add(
                f"r{i}",
                {"prompt_token_ids": prompt_of(fam, plen)},
                params,
                priority=prio if fair else 0,
                tenant=tenant if fair else None,
            )
        for i, at in aborts.items():
            if at == steps and f"r{i}" in h.engine._groups:
                h.engine.abort_request(f"r{i}")
        h.step()
        steps += 1
        assert steps < 3000, "did not drain (hang / livelock)"
    h.assert_idle()
    return h


def _check(h: Harness, reqs: list, aborts: dict[int, int]) -> None:
    pol = h.scheduler.policy
    assert pol._members == {} and pol._backlog == {}  # type: ignore[attr-defined]
    for i in range(len(reqs)):
        out = h.outputs.get(f"r{i}")
        if i in aborts:
            assert out is None or out.outcome in ("finished", "aborted", "rejected"), out
        else:
            assert out is not None and out.finished, f"r{i} never ended"
            assert out.outcome in ("finished", "rejected"), out


def test_a_swapped_group_tied_with_a_waiting_tenant_does_not_deadlock():
    """Swapped groups of two tenants at equal counters, and a waiting request of one of them
    with a lower ``priority`` value than its tenant's swapped group: that waiting request goes
    before its own tenant's swapped group but not past the other tenant's (a tie), which sat
    behind the first in the swapped order. Stopping at the first swapped group left nothing
    able to move (a hang with free blocks and nothing running)."""
    cfg = dict(
        BS=4, G=7, C=64, S=4, T=32, L=L, CP=False, PC=False, PM="swap", policy="fair",
        tenant_weights={"c": 2.0}, fair_burst_tokens=0.0,
    )  # fmt: skip
    reqs = [
        (9, "u17", 2, 9, 4, 2, 2), (3, "c", 2, 4, 7, 2, 3), (8, "u3", 1, 14, 7, 0, 3),
        (4, "b", 0, 1, 4, 0, 2), (10, "a", 3, 4, 3, 0, 1), (5, "a", 1, 5, 8, 1, 1),
        (8, "c", 3, 13, 3, 2, 1), (2, "b", 2, 5, 3, 1, 1), (4, "c", 0, 5, 3, 1, 3),
        (3, None, 2, 14, 5, 1, 1), (3, "b", 1, 7, 5, 1, 1),
    ]  # fmt: skip
    aborts = {0: 3, 3: 7, 4: 6}
    _check(_run(cfg, reqs, aborts), reqs, aborts)


@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "extreme-weights"])
def test_random_hostile_workloads_drain_with_invariants(extreme):
    for seed in range(300):
        w = _workload(seed, extreme)
        try:
            _check(_run(w["cfg"], w["reqs"], w["aborts"]), w["reqs"], w["aborts"])
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {w}") from e


def test_greedy_outputs_match_fcfs():
    """The policy reorders work, never changes it: the same greedy requests (no aborts) give the
    same tokens under ``fair`` (tenants, priorities) as under ``fcfs``."""
    for seed in range(40):
        w = _workload(seed, extreme=False)
        reqs = [r[:6] + (1,) for r in w["reqs"]]
        fair = _run(w["cfg"], reqs, {})
        fcfs = _run(
            {**w["cfg"], "policy": "fcfs", "tenant_weights": {}, "fair_burst_tokens": 2048.0}, reqs, {}
        )
        for i in range(len(reqs)):
            assert fair.outputs[f"r{i}"].outcome == fcfs.outputs[f"r{i}"].outcome, (seed, i)
            assert fair.tokens(f"r{i}") == fcfs.tokens(f"r{i}"), (seed, i)


def test_a_huge_burst_over_a_tiny_weight_still_drains():
    """The credit is the same on every counter (not the burst over the weight), so a huge burst
    beside a tiny weight stays finite: the joining tenant starts far below the floor, and every
    request still ends with the invariants held."""
    for seed in range(20):
        w = _workload(seed, extreme=False)
        cfg = {**w["cfg"], "tenant_weights": {"b": 1e-300}, "fair_burst_tokens": 1.7e308}
        _check(_run(cfg, w["reqs"], w["aborts"]), w["reqs"], w["aborts"])


def test_counters_overflowing_to_infinity_still_drain():
    """Weights at the ends of the float range, no burst credit: a tiny weight's counter is
    infinite after one token, a huge one's never moves; every request still ends."""
    for seed in range(60):
        w = _workload(seed, extreme=False)
        cfg = {
            **w["cfg"],
            "tenant_weights": {"a": 5e-324, "b": 1e308, "c": 1.7e308},
            "fair_burst_tokens": 0.0,
        }
        _check(_run(cfg, w["reqs"], w["aborts"]), w["reqs"], w["aborts"])
