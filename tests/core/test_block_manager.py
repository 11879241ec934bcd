"""Unit tests of the block pool, the LRU evictor and BlockSpaceManager."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.block import BlockPool, NoFreeBlocksError
from kvserve.core.block_manager import AllocStatus, BlockSpaceManager
from kvserve.core.evictor import LRUEvictor
from kvserve.sequence import SequenceStatus
from tests.core.simutil import make_group, prompt_of


def bm_(G=16, C=8, BS=4, **kw):
    kw.setdefault("watermark", 0.0)
    return BlockSpaceManager(block_size=BS, num_gpu_blocks=G, num_cpu_blocks=C, **kw)


def admit(bm, g):
    copies = bm.allocate(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
    return copies


def run_prefill(bm, g):
    """Pretend the whole prompt was computed (what mark_computed does)."""
    for s in g.get_unfinished_seqs():
        s.data.update_num_computed_tokens(s.data.get_num_uncomputed_tokens())
    bm.mark_blocks_as_computed(g)


def test_pool_refcount_and_conservation():
    pool = BlockPool("gpu", 3)
    a, b = pool.allocate(), pool.allocate()
    pool.incr_ref(a)
    assert pool.get_num_free_blocks() == 1 and pool.get_num_in_use() == 2
    pool.free(a)
    assert a.ref_count == 1
    pool.free(a)
    pool.free(b)
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    pool.allocate(), pool.allocate(), pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_pool_hands_out_the_lowest_free_block_first():
    """Freed blocks are reused lowest number first, so a prompt allocated after churn gets a
    run of consecutive blocks where one is free (not the blocks freed longest ago)."""
    pool = BlockPool("gpu", 8)
    blocks = [pool.allocate() for _ in range(8)]
    assert [b.block_number for b in blocks] == list(range(8))
    for n in (6, 2, 7, 3, 5):
        pool.free(blocks[n])
    assert [pool.allocate().block_number for _ in range(3)] == [2, 3, 5]
    pool.free(blocks[0])
    assert [pool.allocate().block_number for _ in range(3)] == [0, 6, 7]
    pool.check_invariants()


def test_evictor_is_lru():
    pool = BlockPool("gpu", 4, enable_caching=True)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        assert pool.register(b, 100 + i)
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):
        pool.free(b)
    assert pool.get_num_free_blocks() == 4 and pool.get_num_evictable() == 4
    x = pool.allocate()  # evicts the least recently freed: blocks[2]
    assert x is blocks[2] and x.block_hash is None and pool.lookup(102) is None
    assert pool.lookup(100) is blocks[0]
    ev = LRUEvictor()
    with pytest.raises(ValueError):
        ev.evict()
    pool.check_invariants()


def test_allocate_append_free():
    bm = bm_(G=8)
    g = make_group("a", prompt_of(1, 6))
    assert bm.can_allocate(g) == AllocStatus.OK
    assert admit(bm, g) == []
    seq = g.get_seqs()[0]
    assert len(bm.get_block_table(seq)) == 2 and bm.get_num_free_gpu_blocks() == 6
    run_prefill(bm, g)
    for t in range(3):
        seq.append_token_id(t)
        assert bm.can_append_slots(g)
        assert bm.append_slots(seq) == []
    assert seq.get_len() == 9 and len(bm.get_block_table(seq)) == 3
    bm.check_invariants()
    bm.free(seq)
    bm.free(seq)  # idempotent
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()


def test_can_allocate_never_later_ok_and_watermark():
    bm = bm_(G=8, watermark=0.25)  # 2 watermark blocks
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(make_group("big", prompt_of(1, 25))) == AllocStatus.NEVER  # 7 > 6
    assert bm.can_allocate(make_group("ok", prompt_of(1, 24))) == AllocStatus.OK  # 6 <= 6
    g = make_group("a", prompt_of(2, 12))
    admit(bm, g)  # 3 used, 5 free
    assert bm.can_allocate(make_group("b", prompt_of(3, 16))) == AllocStatus.LATER  # 5-4 < 2
    assert bm.can_allocate(make_group("c", prompt_of(3, 12))) == AllocStatus.OK  # 5-3 >= 2


def test_fork_shares_and_copy_on_write():
    bm = bm_(G=8)
    g = make_group("a", prompt_of(1, 6), n=2)
    admit(bm, g)
    run_prefill(bm, g)
    parent = g.get_seqs()[0]
    child = parent.fork(999_001)
    g.add(child)
    bm.fork(parent, child)
    assert bm.get_block_table(parent) == bm.get_block_table(child)
    assert bm.get_num_free_gpu_blocks() == 6
    parent.append_token_id(1)
    child.append_token_id(2)
    # Both write position 6 in the shared block 1: one copy is enough (k=2 seqs -> 1 copy).
    assert bm._num_new_blocks_for_append(g, 0) == 1
    c1 = bm.append_slots(parent)
    c2 = bm.append_slots(child)
    assert len(c1) == 1 and c2 == []
    src, dst = c1[0]
    assert bm.get_block_table(child)[1] == src and bm.get_block_table(parent)[1] == dst
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8


def test_swap_out_in_keeps_sharing():
    bm = bm_(G=8, C=8)
    g = make_group("a", prompt_of(1, 8), n=2)
    admit(bm, g)
    run_prefill(bm, g)
    p = g.get_seqs()[0]
    c = p.fork(999_002)
    g.add(c)
    bm.fork(p, c)
    p.append_token_id(1)
    c.append_token_id(2)
    bm.append_slots(p)
    bm.append_slots(c)
    assert bm.get_num_free_gpu_blocks() == 4  # 2 shared + 2 private
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert len(out) == 4 and len(set(out.values())) == 4
    for s in g.get_seqs():
        s.status = SequenceStatus.SWAPPED
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 4
    assert bm.can_swap_in(g) == AllocStatus.OK
    back = bm.swap_in(g)
    assert sorted(back) == sorted(out.values())
    assert bm.get_block_table(p)[:2] == bm.get_block_table(c)[:2]  # still shared
    assert bm.get_num_free_cpu_blocks() == 8
    bm.check_invariants()


def test_swaps_of_one_step_move_a_block_shared_across_groups_once():
    # Two groups sharing a prefix-cache block, swapped out (then in) in one step: the step's
    # map is keyed by source block, so the shared block must move to one destination.
    bm = bm_(G=8, C=8, enable_caching=True)
    p = prompt_of(5, 10)
    a, b = make_group("a", p), make_group("b", p)
    admit(bm, a)
    run_prefill(bm, a)
    admit(bm, b)  # hits a's 2 cached full blocks
    run_prefill(bm, b)
    sa, sb = a.get_seqs()[0], b.get_seqs()[0]
    out = {}
    ga, gb = bm.swap_out(a, out), bm.swap_out(b, out)
    assert out == {**ga, **gb} and len(out) == 4 and len(set(out.values())) == 4
    assert bm.get_block_table(sa)[:2] == bm.get_block_table(sb)[:2]  # one CPU copy, shared
    assert bm.get_num_free_cpu_blocks() == 4
    sa.status = sb.status = SequenceStatus.SWAPPED
    back = {}
    bm.swap_in(a, back)
    bm.swap_in(b, back)
    assert sorted(back) == sorted(out.values()) and len(set(back.values())) == 4
    assert bm.get_block_table(sa)[:2] == bm.get_block_table(sb)[:2]
    assert bm.get_num_free_cpu_blocks() == 8 and bm.get_num_free_gpu_blocks() == 4
    bm.check_invariants()


def test_swap_in_never_when_it_cannot_grow():
    bm = bm_(G=4, C=8)
    g = make_group("a", prompt_of(1, 16))
    admit(bm, g)
    run_prefill(bm, g)
    g.get_seqs()[0].append_token_id(1)
    bm.swap_out(g)
    g.get_seqs()[0].status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(g) == AllocStatus.NEVER  # 4 blocks + 1 for the next token > 4


def test_prefix_cache_hit_eviction_and_stats():
    bm = bm_(G=8, enable_caching=True)
    p = prompt_of(5, 10)  # 2 full blocks + 2 tokens
    a = make_group("a", p)
    admit(bm, a)
    assert a.get_seqs()[0].data.get_num_computed_tokens() == 0
    # Not cached before its forward ran.
    assert bm.plan_allocation(make_group("x", p)).num_cached_tokens == 0
    run_prefill(bm, a)
    b = make_group("b", p)
    plan = bm.plan_allocation(b)
    assert plan.num_cached_tokens == 8 and plan.cost == 1
    admit(bm, b)
    sb = b.get_seqs()[0]
    assert sb.data.get_num_computed_tokens() == 8
    assert bm.get_block_table(sb)[:2] == bm.get_block_table(a.get_seqs()[0])[:2]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 20
    assert bm.get_prefix_cache_hit_rate() == pytest.approx(0.4)
    bm.free(a.get_seqs()[0])
    bm.free(sb)
    # 2 cached refcount-0 blocks count as free.
    assert bm.get_num_free_gpu_blocks() == 8 and bm.gpu.get_num_evictable() == 2
    bm.check_invariants()
    # Fill the pool: the cached blocks get evicted and their hashes dropped.
    big = make_group("big", prompt_of(6, 32))
    admit(bm, big)
    assert not bm.gpu.cached
    assert bm.plan_allocation(make_group("y", p)).num_cached_tokens == 0
    bm.free(big.get_seqs()[0])
    assert bm.reset_prefix_cache()


def test_prefix_cache_block_aligned_full_hit_copies_last_block():
    bm = bm_(G=8, enable_caching=True)
    p = prompt_of(7, 8)
    a = make_group("a", p)
    admit(bm, a)
    run_prefill(bm, a)
    b = make_group("b", p)
    copies = admit(bm, b)
    sb, sa = b.get_seqs()[0], a.get_seqs()[0]
    assert sb.data.get_num_computed_tokens() == 7
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == bm.get_block_table(sa)[1] and dst == bm.get_block_table(sb)[1]
    assert bm.get_block_table(sb)[0] == bm.get_block_table(sa)[0]
    bm.check_invariants()  # the pinned source is accounted for
    bm.release_pins()
    bm.check_invariants()
    bm.free(sa)
    bm.free(sb)
    assert bm.get_num_free_gpu_blocks() == 8


def test_full_hit_of_a_pool_filling_prompt_recomputes_last_block_instead_of_waiting():
    """Stateful-test find: a prompt that fills every usable block, fully cached, would need
    one block more for the private copy of its last block and waited forever (LATER with an
    idle pool). It must reuse one block fewer and recompute it."""
    for watermark, G in ((0.0, 4), (0.25, 8)):
        bm = BlockSpaceManager(
            block_size=2, num_gpu_blocks=G, num_cpu_blocks=0, watermark=watermark, enable_caching=True
        )
        usable = G - bm.watermark_blocks
        p = prompt_of(3, 2 * usable)
        a = make_group("a", p)
        admit(bm, a)
        run_prefill(bm, a)
        bm.free(a.get_seqs()[0])
        b = make_group("b", p)
        plan = bm.plan_allocation(b)
        assert plan.status == AllocStatus.OK, plan
        assert plan.num_cached_tokens == 2 * (usable - 1) and not plan._cow_last
        assert admit(bm, b) == []
        assert b.get_seqs()[0].data.get_num_computed_tokens() == 2 * (usable - 1)
        bm.check_invariants()
        bm.free(b.get_seqs()[0])
        assert bm.get_num_free_gpu_blocks() == G


@settings(max_examples=150, deadline=None)
@given(
    BS=st.sampled_from([1, 2, 4]),
    G=st.integers(2, 12),
    wm=st.sampled_from([0.0, 0.2]),
    cached=st.lists(st.integers(1, 40), max_size=4),
    plen=st.integers(1, 40),
    same_as=st.integers(-1, 3),
)
def test_an_admissible_group_is_ok_whenever_nothing_runs(BS, G, wm, cached, plen, same_as):
    """The whole kind of fault: a group that is not NEVER must be OK once nothing else holds
    blocks (everything free or merely cached), or the scheduler waits on it forever."""
    bm = BlockSpaceManager(
        block_size=BS, num_gpu_blocks=G, num_cpu_blocks=0, watermark=wm, enable_caching=True
    )
    prompts = [prompt_of(7, n) for n in cached]  # shared prefixes of one token stream
    for i, p in enumerate(prompts):
        g = make_group(f"c{i}", p)
        if bm.can_allocate(g) != AllocStatus.OK:
            continue
        admit(bm, g)
        run_prefill(bm, g)
        bm.release_pins()
        bm.free(g.get_seqs()[0])
    prompt = prompts[same_as] if 0 <= same_as < len(prompts) else prompt_of(7, plen)
    g = make_group("x", prompt)
    plan = bm.plan_allocation(g)
    assert plan.status != AllocStatus.LATER, plan
    if plan.status == AllocStatus.OK:
        admit(bm, g)
        bm.check_invariants()
        bm.release_pins()
        bm.free(g.get_seqs()[0])
        assert bm.get_num_free_gpu_blocks() == G


def test_sliding_window_releases_old_blocks():
    bm = bm_(G=8, sliding_window=8)
    g = make_group("a", prompt_of(1, 8))
    admit(bm, g)
    run_prefill(bm, g)
    seq = g.get_seqs()[0]
    for t in range(12):
        seq.append_token_id(t)
        assert bm.can_append_slots(g)
        bm.append_slots(seq)
        seq.data.update_num_computed_tokens(1)
        bm.mark_blocks_as_computed(g)
    # len 20, computed 20: positions < 12 are out of the 8-token window -> blocks 0..2 freed.
    table = bm.block_tables[seq.seq_id]
    assert table[0] is None and table[2] is None and table[3] is not None
    assert bm.get_num_free_gpu_blocks() == 8 - 2
    assert all(isinstance(b, int) for b in bm.get_block_table(seq))
    bm.check_invariants()
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8


def test_recompute_group_shares_identical_sibling_blocks():
    bm = bm_(G=16)
    g = make_group("a", prompt_of(1, 8), n=2)
    p = g.get_seqs()[0]
    c = p.fork(999_003)
    g.add(c)
    for i in range(5):
        p.append_token_id(10 + i)
        c.append_token_id(20 + i)
    plan = bm.plan_allocation(g)
    assert plan.num_required_blocks == 4 + 2  # 2 shared prompt blocks + 2 private each
    admit(bm, g)
    assert bm.get_block_table(p)[:2] == bm.get_block_table(c)[:2]
    assert bm.get_block_table(p)[2] != bm.get_block_table(c)[2]
    assert bm.get_num_free_gpu_blocks() == 10
    bm.check_invariants()


def test_eviction_under_pressure_keeps_the_longest_cached_head():
    """A 4-block prompt finished; a new request needs one cached block evicted. The prompt
    must still find its first 3 blocks (it used to find 0: the chain head went first, leaving
    3 cached blocks nobody could reach)."""
    bm = bm_(G=5, C=0, enable_caching=True)
    p = prompt_of(5, 17)  # 4 full blocks + 1 token
    a = make_group("a", p)
    admit(bm, a)
    run_prefill(bm, a)
    bm.free(a.get_seqs()[0])
    assert bm.gpu.get_num_evictable() == 4
    other = make_group("o", prompt_of(6, 8))  # 2 blocks: the free one and one evicted
    admit(bm, other)
    bm.check_invariants()
    assert bm.plan_allocation(make_group("again", p)).num_cached_tokens == 12
    # Least recently released first: a's 3 blocks were released before o's 2, so the next
    # eviction takes a's (new) tail, and o keeps its whole chain.
    run_prefill(bm, other)
    bm.free(other.get_seqs()[0])
    admit(bm, make_group("x", prompt_of(7, 4)))
    bm.check_invariants()
    assert bm.plan_allocation(make_group("again", p)).num_cached_tokens == 8
    assert bm.plan_allocation(make_group("o2", prompt_of(6, 9))).num_cached_tokens == 8


def test_register_refuses_a_block_whose_parent_is_not_cached_and_eviction_drops_descendants():
    pool = BlockPool("gpu", 3, enable_caching=True)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert not pool.register(b, 2, parent_hash=1)  # parent 1 not cached: unreachable
    assert pool.register(a, 1) and pool.register(b, 2, parent_hash=1) and pool.register(c, 3, 2)
    pool.free(a)  # head released first (e.g. a sliding window): it is evicted first
    pool.free(c)
    pool.check_invariants()
    x = pool.allocate()  # evicts a; b (in use) and c (evictable) became unreachable
    assert x is a and not pool.cached and b.block_hash is None and c.block_hash is None
    assert pool.get_num_evictable() == 0 and pool.get_num_free_blocks() == 1
    pool.check_invariants()
    pool.free(b)
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()
