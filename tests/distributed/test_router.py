"""The data-parallel routers (pure bookkeeping, no Ray): prefix affinity within the balance
threshold, least-loaded, round-robin, replicas that are down, and the shared hash chain."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.block_manager import chain_block_hashes
from kvserve.distributed.router import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    make_router,
)

BS = 4


def _prompt(prefix_id: int, n_prefix_blocks: int, suffix: list[int]) -> list[int]:
    return [1000 * prefix_id + i for i in range(n_prefix_blocks * BS)] + suffix


def test_chain_block_hashes_cover_full_blocks_only_and_chain():
    toks = list(range(10))
    h = chain_block_hashes(toks, 4)
    assert len(h) == 2  # the trailing 2 tokens are no block
    assert h[0] == hash((None, (0, 1, 2, 3)))
    assert h[1] == hash((h[0], (4, 5, 6, 7)))
    # resuming from block 1 with its parent gives the same tail
    assert chain_block_hashes(toks, 4, start=1, parent=h[0]) == h[1:]
    # equal second blocks under different first blocks hash differently (the chain)
    other = chain_block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert other[1] != h[1]


def test_prefix_router_sends_a_shared_prefix_to_one_replica():
    r = PrefixAwareRouter(2, BS, balance_threshold=4)
    loads = [0, 0]
    chosen = []
    for i in range(6):
        p = _prompt(7, 8, [i, i + 1])
        idx = r.select(p, loads, [True, True])
        r.on_routed(idx, p)
        loads[idx] += 1  # they stay outstanding
        chosen.append(idx)
    # the first goes to the least loaded (0); the rest follow their prefix while within 4
    assert chosen == [0, 0, 0, 0, 0, 1]
    assert r.match_blocks(0, _prompt(7, 8, [])) == 8
    assert r.match_blocks(1, _prompt(7, 8, [])) == 8  # the balanced one now caches it too


def test_prefix_router_spreads_distinct_prompts_by_load():
    r = PrefixAwareRouter(3, BS, balance_threshold=2)
    loads = [0, 0, 0]
    for i in range(9):
        p = _prompt(100 + i, 3, [])
        idx = r.select(p, loads, [True] * 3)
        r.on_routed(idx, p)
        loads[idx] += 1
    assert loads == [3, 3, 3]
    assert r.num_prefix_routed == 0


def test_prefix_router_idle_replicas_share_new_prefixes():
    """At no load (every request ends before the next), distinct prompts alternate: the
    least-loaded tie goes to the replica caching fewest blocks."""
    r = PrefixAwareRouter(2, BS)
    chosen = []
    for i in range(4):
        p = _prompt(50 + i, 2, [])
        idx = r.select(p, [0, 0], [True, True])
        r.on_routed(idx, p)
        chosen.append(idx)
    assert chosen == [0, 1, 0, 1]
    assert r.select(_prompt(51, 2, [1]), [0, 0], [True, True]) == 1  # its prefix is there


def test_prefix_router_prefers_longest_match():
    r = PrefixAwareRouter(2, BS, balance_threshold=10)
    short, long_ = _prompt(1, 2, []), _prompt(1, 6, [])
    r.on_routed(0, short)
    r.on_routed(1, long_)
    assert r.select(_prompt(1, 6, [5, 5, 5, 5]), [0, 0], [True, True]) == 1
    assert r.select(_prompt(1, 2, [9, 9, 9, 9]), [0, 3], [True, True]) == 0  # tie on 2 blocks: less loaded


def test_prefix_router_skips_a_replica_that_is_down_and_forgets_a_replaced_one():
    r = PrefixAwareRouter(2, BS)
    p = _prompt(3, 4, [])
    r.on_routed(1, p)
    assert r.select(p, [0, 0], [True, True]) == 1
    assert r.select(p, [0, 0], [True, False]) == 0
    r.reset_replica(1)
    assert r.match_blocks(1, p) == 0


def test_prefix_router_lru_evicts_oldest_hashes():
    r = PrefixAwareRouter(1, BS, cache_blocks=4)
    a, b = _prompt(1, 4, []), _prompt(2, 4, [])
    r.on_routed(0, a)
    r.on_routed(0, b)
    assert r.match_blocks(0, a) == 0 and r.match_blocks(0, b) == 4


def test_round_robin_and_least_loaded():
    rr = RoundRobinRouter(3)
    assert [rr.select([], [0, 0, 0], [True] * 3) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.select([], [0, 0, 0], [True, False, True]) for _ in range(3)] == [2, 0, 2]
    ll = LeastLoadedRouter(3)
    assert ll.select([], [2, 1, 1], [True] * 3) == 1
    assert ll.select([], [2, 1, 0], [True, True, False]) == 1


def test_no_replica_up_raises():
    for r in (RoundRobinRouter(2), LeastLoadedRouter(2), PrefixAwareRouter(2, BS)):
        with pytest.raises(RuntimeError, match="no data-parallel replica is up"):
            r.select([1, 2, 3, 4], [0, 0], [False, False])


def test_make_router_names_and_bad_values():
    assert isinstance(make_router("prefix", 2, 16), PrefixAwareRouter)
    assert isinstance(make_router("least-loaded", 2, 16), LeastLoadedRouter)
    assert isinstance(make_router("round-robin", 2, 16), RoundRobinRouter)
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("random", 2, 16)
    with pytest.raises(ValueError, match="router_balance_threshold"):
        PrefixAwareRouter(2, 16, balance_threshold=-1)
    with pytest.raises(ValueError, match="num_replicas"):
        LeastLoadedRouter(0)


def test_engine_args_validate_data_parallel_fields():
    from kvserve.config import EngineArgs

    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="router must be one of"):
        EngineArgs(router="nope")
    with pytest.raises(ValueError, match="router_balance_threshold"):
        EngineArgs(router_balance_threshold=-2)
    args = EngineArgs(data_parallel_size=3, block_size=8, router="round-robin")
    rep = args.replica_args()
    assert rep.data_parallel_size == 1 and rep.block_size == 8 and rep.router == "round-robin"


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    threshold=st.integers(0, 5),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    down=st.sets(st.integers(0, 3), max_size=3),
)
def test_prefix_router_property_picks_an_up_replica_within_the_threshold(n, threshold, ops, down):
    """Whatever the traffic: the choice is up; it is within ``threshold`` of the least
    loaded, or it is the least loaded; with no match anywhere it is the least loaded."""
    healthy = [i not in down for i in range(n)]
    if not any(healthy):
        healthy[0] = True
    r = PrefixAwareRouter(n, BS, balance_threshold=threshold, cache_blocks=16)
    loads = [0] * n
    rng = random.Random(0)
    for prefix_id, n_blocks, suffix_len, finish in ops:
        p = _prompt(prefix_id, n_blocks, [rng.randrange(50) for _ in range(suffix_len)])
        matches = [r.match_blocks(i, p) if healthy[i] else 0 for i in range(n)]
        idx = r.select(p, loads, healthy)
        assert healthy[idx]
        least = min(loads[i] for i in range(n) if healthy[i])
        assert loads[idx] - least <= threshold or loads[idx] == least
        if max(matches) == 0:
            assert loads[idx] == least
        r.on_routed(idx, p)
        loads[idx] += 1
        if finish:  # one request of the busiest replica ends
            j = max(range(n), key=lambda i: loads[i])
            loads[j] = max(0, loads[j] - 1)
