"""The prefix cache's host tier: demotion of evicted device blocks, promotion on a later hit,
LRU within the tier's bound, preemption swaps that never fail because of it, the cost rule,
and random workloads on the simulator whose K/V read-backs are checked token by token."""

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from kvserve.core.block_manager import AllocStatus, BlockSpaceManager
from kvserve.core.preemption import LinearPreemptionCost
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import SequenceStatus
from tests.core.simutil import Harness, configs, make_group, prompt_of

BS = 4


def tier_bm(G=6, C=0, tier=4, **kw):
    return BlockSpaceManager(BS, G, C + tier, watermark=0.0, enable_caching=True, host_tier_blocks=tier, **kw)


def admit(bm, g):
    plan = bm.plan_allocation(g)
    assert plan.status == AllocStatus.OK, plan
    bm.allocate(g, plan)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
    return plan


def end_step(bm, groups=()):
    """What one engine step does around the executor: take the moves, run, mark computed."""
    swap_in, swap_out = bm.take_tier_moves({})
    for g in groups:
        for s in g.get_unfinished_seqs():
            s.data.update_num_computed_tokens(s.data.get_num_uncomputed_tokens())
        bm.mark_blocks_as_computed(g)
    bm.release_pins()
    bm.check_invariants()
    return swap_in, swap_out


def finish(bm, g):
    for s in g.get_seqs():
        bm.free(s)
    bm.check_invariants()


def test_evicted_block_is_demoted_then_promoted_on_a_hit():
    bm = tier_bm()
    a = make_group("a", prompt_of(1, 9))  # 2 full blocks + 1 token
    admit(bm, a)
    end_step(bm, [a])
    finish(bm, a)
    a_blocks = {h: bm.gpu.lookup(h).block_number for h in bm._get_hashes(a.get_seqs()[0], 2)}
    # b takes the whole device pool: a's two cached blocks are evicted and demoted.
    b = make_group("b", prompt_of(2, 6 * BS))
    admit(bm, b)
    swap_in, swap_out = end_step(bm, [b])
    assert swap_in == {}
    assert sorted(swap_out) == sorted(a_blocks.values())
    assert {bm.cpu.blocks[c].block_hash for c in swap_out.values()} == set(a_blocks)
    assert bm.get_stats()["host_tier_blocks"] == 2 and bm.host_tier_demotions == 2
    finish(bm, b)
    # The same prompt again: both full blocks come back from the host tier.
    a2 = make_group("a2", prompt_of(1, 9))
    plan = admit(bm, a2)
    assert plan.num_cached_tokens == 8
    assert a2.get_seqs()[0].data.get_num_computed_tokens() == 8
    swap_in, swap_out = end_step(bm, [a2])
    table = bm.get_block_table(a2.get_seqs()[0])
    host = {h: bm.cpu.lookup(h).block_number for h in a_blocks}
    assert swap_in == {host[h]: table[i] for i, h in enumerate(a_blocks)}
    assert bm.host_tier_hits == 2
    # After the step the promoted blocks are device-cached again under their hashes.
    for i, h in enumerate(a_blocks):
        assert bm.gpu.lookup(h).block_number == table[i]
    assert bm.get_stats()["prefix_cache_hits"] == 8


def test_tier_evicts_least_recently_demoted_within_its_bound():
    bm = tier_bm(G=2, tier=2)
    hashes = []
    for i in range(3):  # each prompt's one full block is evicted by the next prompt
        g = make_group(f"g{i}", prompt_of(i, BS + 1))
        admit(bm, g)
        end_step(bm, [g])
        hashes.append(bm._get_hashes(g.get_seqs()[0], 1)[0])
        finish(bm, g)
    g = make_group("last", prompt_of(9, 2 * BS))  # evicts the third prompt's block
    admit(bm, g)
    end_step(bm, [g])
    assert bm._num_tier_blocks() == 2
    # three demotions into a tier of two: the first demoted went
    assert bm.cpu.lookup(hashes[0]) is None
    assert bm.cpu.lookup(hashes[1]) is not None and bm.cpu.lookup(hashes[2]) is not None


def test_preemption_swap_succeeds_when_the_tier_fills_the_host_pool():
    bm = tier_bm(G=6, C=2, tier=4)
    for i in range(2):
        g = make_group(f"fill{i}", prompt_of(i, 5 * BS + 1))
        admit(bm, g)
        end_step(bm, [g])
        finish(bm, g)
    assert bm._num_tier_blocks() == 4  # the tier holds its bound; 2 swap blocks free
    # A running group of 6 blocks is preempted by swap: it takes the tier's blocks (LRU).
    r = make_group("r", prompt_of(7, 6 * BS))
    admit(bm, r)
    end_step(bm, [r])
    assert bm.can_swap_out(r)
    mapping = bm.swap_out(r)
    for s in r.get_seqs():
        s.status = SequenceStatus.SWAPPED
    assert len(mapping) == 6
    assert bm._num_tier_blocks() == 0
    bm.check_invariants()
    assert bm.can_swap_in(r) == AllocStatus.OK
    bm.swap_in(r)
    for s in r.get_seqs():
        s.status = SequenceStatus.RUNNING
    end_step(bm)
    finish(bm, r)
    assert bm.get_num_free_cpu_blocks() == 6 and bm.get_num_free_gpu_blocks() == 6


def test_short_host_run_is_recomputed_when_swapping_costs_more():
    dear = LinearPreemptionCost(token_s=1e-6, block_s=1.0)  # a swap far dearer than a prefill
    for cost, expect in ((None, 8), (dear, 0)):
        bm = tier_bm(tier_cost=cost)
        a = make_group("a", prompt_of(1, 9))
        admit(bm, a)
        end_step(bm, [a])
        finish(bm, a)
        b = make_group("b", prompt_of(2, 6 * BS))
        admit(bm, b)
        end_step(bm, [b])
        finish(bm, b)
        a2 = make_group("a2", prompt_of(1, 9))
        assert admit(bm, a2).num_cached_tokens == expect
        swap_in, _ = end_step(bm, [a2])
        assert len(swap_in) == expect // BS


def test_two_groups_hitting_one_host_block_in_a_step_share_its_promotion():
    bm = tier_bm(G=8)
    a = make_group("a", prompt_of(1, 9))
    admit(bm, a)
    end_step(bm, [a])
    finish(bm, a)
    b = make_group("b", prompt_of(2, 8 * BS))
    admit(bm, b)
    end_step(bm, [b])
    finish(bm, b)
    x, y = make_group("x", prompt_of(1, 9)), make_group("y", prompt_of(1, 10))
    admit(bm, x)
    admit(bm, y)
    tx, ty = bm.get_block_table(x.get_seqs()[0]), bm.get_block_table(y.get_seqs()[0])
    assert tx[:2] == ty[:2]
    swap_in, _ = end_step(bm, [x, y])
    assert sorted(swap_in.values()) == sorted(tx[:2]) and bm.host_tier_hits == 2


def test_tier_needs_prefix_caching_and_a_bound_within_the_host_pool():
    import pytest

    from kvserve.config import CacheConfig

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(num_gpu_blocks=4, kv_offload_gib=1.0)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        CacheConfig(num_gpu_blocks=4, kv_offload_gib=-1.0, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="host_tier_blocks"):
        BlockSpaceManager(BS, 4, 2, host_tier_blocks=3)


# ---------------------------------------------------------------------- random workloads
STREAMS = [[(s * 131 + j * 17) % 997 + 1 for j in range(40)] for s in range(3)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    G=st.integers(6, 14),
    C=st.integers(0, 6),
    tier=st.integers(1, 10),
    chunked=st.booleans(),
    mode=st.sampled_from(["swap", "recompute"]),
    reqs=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 3), st.integers(1, 6)),
        min_size=4,
        max_size=14,
    ),
)
def test_random_workloads_read_back_the_right_kv_and_conserve_blocks(G, C, tier, chunked, mode, reqs):
    """Requests sharing prefixes of a few token streams, on a device pool too small to keep
    them: with the tier, every K/V read-back equals the sequence's tokens (the simulator
    raises otherwise), both pools balance after every step (the harness checks), the tier
    stays within its bound, and each request's tokens equal those of a run without it."""
    results = []
    for with_tier in (True, False):
        cc, sc = configs(
            BS=2, G=G, C=C, S=4, T=16, L=48, CP=chunked, PC=True, PM=mode, TIER=tier if with_tier else None
        )
        h = Harness(cc, sc)
        for i, (stream, length, tail, out) in enumerate(reqs):
            prompt = STREAMS[stream][:length] + [999] * tail
            if len(prompt) + out > 48 or len(prompt) // 2 + 2 > G:
                continue
            h.add(f"r{i}", prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
            h.step()
        h.run()
        h.assert_idle()
        results.append({r: o.outputs[0].token_ids for r, o in h.outputs.items()})
        if with_tier:
            bm = h.scheduler.block_manager
            assert bm._num_tier_blocks() <= tier
            target(float(bm.host_tier_hits))  # steer the search towards workloads that hit the tier
    assert results[0] == results[1]


def _demote_prompt(bm, prompt, filler_len):
    a = make_group("a", prompt)
    admit(bm, a)
    end_step(bm, [a])
    finish(bm, a)
    b = make_group("b", prompt_of(2, filler_len))
    admit(bm, b)
    return b


def test_failed_block_moves_leave_nothing_in_the_tier():
    bm = tier_bm()
    b = _demote_prompt(bm, prompt_of(1, 9), 6 * BS)
    assert bm._pending_tier
    bm.drop_tier_moves()  # the executor raised while applying the step's moves
    bm.release_pins()
    bm.check_invariants()
    assert bm._num_tier_blocks() == 0 and bm.take_tier_moves({}) == ({}, {})
    finish(bm, b)
    assert bm.get_num_free_cpu_blocks() == 4


def test_full_hit_from_the_tier_copies_its_last_block_after_the_swap_in():
    bm = tier_bm()
    b = _demote_prompt(bm, prompt_of(1, 2 * BS), 6 * BS)
    end_step(bm, [b])
    finish(bm, b)
    a2 = make_group("a2", prompt_of(1, 2 * BS))  # block-aligned: a full hit
    plan = bm.plan_allocation(a2)
    assert plan.num_cached_tokens == 2 * BS - 1
    copies = bm.allocate(a2, plan)
    swap_in, _ = bm.take_tier_moves({})
    assert len(swap_in) == 2 and len(copies) == 1
    src, dst = copies[0]
    table = bm.get_block_table(a2.get_seqs()[0])
    # the copy's source is the promoted last block; the table holds its private copy
    assert src in swap_in.values() and table == [list(swap_in.values())[0], dst]
    bm.release_pins()
    bm.check_invariants()


def test_stable_keys_are_equal_in_another_process():
    """The disk tier's keys do not depend on the process (Python salts str hashes, and
    ``hash(None)`` varies per process before 3.12); block hashes may."""
    import os
    import subprocess
    import sys

    from kvserve.core.block_manager import stable_block_keys

    tokens = prompt_of(3, 3 * BS + 1)
    code = (
        f"from kvserve.core.block_manager import stable_block_keys;print(stable_block_keys({tokens!r}, {BS}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    keys = stable_block_keys(tokens, BS)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert out.stdout.strip() == str(keys)
    assert stable_block_keys(tokens, BS, 1, keys[0]) == keys[1:]


def test_stable_keyed_tier_adopts_disk_blocks_and_reports_new_ones():
    bm = tier_bm(stable_tier_keys=True)
    prompt = prompt_of(1, 9)
    keys = stable_block_keys_of(prompt)
    placed = bm.adopt_tier_blocks(keys)
    assert sorted(placed) == sorted(keys) and bm._num_tier_blocks() == 2
    assert bm.take_new_tier_blocks() == []  # adopted blocks are on disk already
    a = make_group("a", prompt)
    assert admit(bm, a).num_cached_tokens == 8
    swap_in, _ = end_step(bm, [a])
    assert sorted(swap_in) == sorted(placed.values())
    finish(bm, a)
    b = make_group("b", prompt_of(2, 6 * BS))
    admit(bm, b)
    end_step(bm, [b])  # a's blocks are device-cached again: evicted and demoted, nothing new
    assert bm.take_new_tier_blocks() == []  # the tier still holds both keys
    c = make_group("c", prompt_of(5, 2 * BS + 1))
    finish(bm, b)
    admit(bm, c)
    end_step(bm, [c])  # evicts 3 of b's 6 cached blocks: new to the tier
    new = bm.take_new_tier_blocks()
    b_keys = stable_block_keys_of(prompt_of(2, 6 * BS))
    assert len(new) == 3 and {k for _, k in new} <= set(b_keys)
    assert all(bm.cpu.blocks[c].block_hash == k for c, k in new)
    assert bm.take_new_tier_blocks() == []


def stable_block_keys_of(tokens):
    from kvserve.core.block_manager import stable_block_keys

    return stable_block_keys(tokens, BS)
