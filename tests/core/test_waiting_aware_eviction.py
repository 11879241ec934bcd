"""Waiting-aware prefix-cache eviction: cached blocks a waiting request's prompt holds are
evicted only after every other cached block, and the wanted counts follow groups into and out
of the waiting queue exactly."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.core.block import BlockPool
from kvserve.core.block_manager import AllocStatus, BlockSpaceManager, chain_block_hashes
from kvserve.core.evictor import LRUEvictor
from kvserve.core.scheduler import Scheduler
from kvserve.sequence import SequenceStatus
from tests.core.simutil import configs, make_group, prompt_of


# ---------------------------------------------------------------------------- evictor
def test_evictor_takes_unkept_blocks_first_each_class_oldest_release_first():
    pool = BlockPool("gpu", 6)
    blocks = [pool.blocks[i] for i in range(6)]
    ev: LRUEvictor = LRUEvictor()
    for b in blocks:
        ev.add(b, keep=b.block_number in (0, 3))
    ev.set_keep(4, True)
    ev.set_keep(0, False)  # back to the unkept class with its old release time: oldest there
    assert ev.num_kept() == 2
    assert [ev.evict().block_number for _ in range(4)] == [0, 1, 2, 5]
    assert ev.num_kept_evictions == 0
    assert [ev.evict().block_number for _ in range(2)] == [3, 4]
    assert ev.num_kept_evictions == 2
    with pytest.raises(ValueError):
        ev.evict()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("akre"), st.integers(0, 7), st.booleans()), max_size=80))
def test_evictor_matches_a_sorted_list_model(ops):
    """Random add / set_keep / remove / evict against a brute-force model: evict takes the
    minimum of (kept, release time)."""
    pool = BlockPool("gpu", 8)
    ev: LRUEvictor = LRUEvictor()
    model: dict[int, list] = {}  # block number -> [release time, kept]
    t = 0
    for op, n, flag in ops:
        if op == "a" and n not in model:
            t += 1
            ev.add(pool.blocks[n], keep=flag)
            model[n] = [t, flag]
        elif op == "k":
            ev.set_keep(n, flag)
            if n in model:
                model[n][1] = flag
        elif op == "r" and n in model:
            assert ev.remove(n).block_number == n
            del model[n]
        elif op == "e" and model:
            want = min(model, key=lambda k: (model[k][1], model[k][0]))
            assert ev.evict().block_number == want
            del model[want]
        assert len(ev) == len(model)
        assert ev.num_kept() == sum(kept for _, kept in model.values())
        assert [b.block_number for b in ev] == sorted(model, key=lambda k: model[k][0])


# ---------------------------------------------------------------------------- block manager
BS = 4


def _admit_run_free(bm, g):
    """Admit ``g``, compute its whole prompt, release it (its full blocks stay cached)."""
    bm.allocate(g)
    for s in g.get_seqs():
        s.status = SequenceStatus.RUNNING
        s.data.update_num_computed_tokens(s.data.get_num_uncomputed_tokens())
    bm.mark_blocks_as_computed(g)
    for s in g.get_seqs():
        bm.free(s)


@pytest.mark.parametrize("aware", [True, False])
def test_admission_evicts_around_the_prefix_the_next_waiting_request_needs(aware):
    """P's 2 cached blocks are the least recently released; admitting an unrelated prompt
    needs 2 cached blocks evicted. Plain LRU takes P's; waiting-aware takes Q's, and the
    waiting request with prefix P then hits both blocks."""
    bm = BlockSpaceManager(BS, 8, 0, watermark=0.0, enable_caching=True, waiting_aware_eviction=aware)
    p, q = prompt_of(1, 9), prompt_of(2, 9)
    _admit_run_free(bm, make_group("a", p))
    _admit_run_free(bm, make_group("b", q))
    assert bm.gpu.get_num_evictable() == 4
    later = make_group("later", p[:8] + [7, 7, 7])
    bm.add_waiting(later)
    first = make_group("first", prompt_of(3, 24))  # 6 blocks: 4 never used + 2 evicted
    assert bm.plan_allocation(first).status == AllocStatus.OK
    bm.allocate(first)
    bm.check_invariants()
    assert bm.gpu.get_num_evictable() == 2
    plan = bm.plan_allocation(later)
    assert plan.num_cached_tokens == (8 if aware else 0)
    assert bm.get_stats()["num_wanted_evictions"] == 0
    for s in first.get_seqs():
        bm.free(s)
    bm.allocate(later)
    assert later.num_cached_tokens == (8 if aware else 0)
    assert bm.gpu.wanted == {} and bm.get_num_waiting_groups() == 0
    bm.check_invariants()


def test_wanted_blocks_go_last_and_are_counted_when_nothing_else_is_left():
    bm = BlockSpaceManager(BS, 4, 0, watermark=0.0, enable_caching=True)
    p = prompt_of(1, 8)
    _admit_run_free(bm, make_group("a", p))
    w = make_group("w", p + [5])
    bm.add_waiting(w)
    assert bm.gpu.evictor.num_kept() == 2
    bm.allocate(make_group("big", prompt_of(2, 16)))  # the whole pool: both wanted blocks go
    assert bm.get_stats()["num_wanted_evictions"] == 2
    bm.check_invariants()


# ---------------------------------------------------------------------------- scheduler
def _step(sched):
    """Schedule, pretend the step ran, append token 1 to sampled sequences, end full ones."""
    metas, out = sched.schedule()
    sched.mark_computed(out)
    for ssg, m in zip(out.scheduled_seq_groups, metas):
        if not m.do_sample:
            continue
        g = ssg.seq_group
        for s in g.get_seqs(SequenceStatus.RUNNING):
            s.append_token_id(1)
            if s.get_output_len() >= g.sampling_params.max_tokens:
                s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                sched.free_seq(s)
    sched.free_finished_seq_groups()
    sched.block_manager.check_invariants()
    return out


def _drain(sched, max_steps=200):
    for _ in range(max_steps):
        if not sched.has_unfinished_seqs():
            return
        _step(sched)
    raise AssertionError("scheduler did not drain")


@pytest.mark.parametrize("aware", [True, False])
def test_scheduler_queue_admission_hits_the_kept_prefix(aware):
    cc, sc = configs(BS=BS, G=8, S=1, T=64, L=64, PC=True)
    cc.waiting_aware_eviction = aware
    sched = Scheduler(sc, cc)
    p, q = prompt_of(1, 9), prompt_of(2, 9)
    for rid, prompt in (("a", p), ("b", q)):
        sched.add_seq_group(make_group(rid, prompt, max_tokens=1))
        _drain(sched)
    first = make_group("first", prompt_of(3, 20), max_tokens=2)  # 5 blocks, then a 6th
    later = make_group("later", p[:8] + [7, 7, 7], max_tokens=1)
    sched.add_seq_group(first)
    sched.add_seq_group(later)
    _drain(sched)
    assert first.num_cached_tokens == 0
    assert later.num_cached_tokens == (8 if aware else 0)
    stats = sched.get_kv_cache_stats()
    assert stats["num_wanted_evictions"] == 0
    assert sched.block_manager.gpu.wanted == {}


def test_abort_reject_and_admit_drop_the_wanted_counts():
    cc, sc = configs(BS=BS, G=16, S=2, T=64, L=32, PC=True)
    sched = Scheduler(sc, cc)
    bm = sched.block_manager
    shared = prompt_of(1, 8)
    groups = [make_group(f"r{i}", shared + prompt_of(10 + i, 5)) for i in range(4)]
    for g in groups:
        sched.add_seq_group(g)
    assert bm.get_num_waiting_groups() == 4
    assert sorted(bm.gpu.wanted.values()) == [1, 1, 1, 1, 4, 4]  # 2 shared + 1 own block each
    sched.add_seq_group(make_group("long", prompt_of(5, 40)))  # over max_model_len: rejected
    assert bm.get_num_waiting_groups() == 4
    sched.abort_seq_group("r3")
    assert bm.get_num_waiting_groups() == 3 and sorted(bm.gpu.wanted.values()) == [1, 1, 1, 3, 3]
    _step(sched)  # admits r0 and r1 (max_num_seqs 2)
    assert bm.get_num_waiting_groups() == 1 and sorted(bm.gpu.wanted.values()) == [1, 1, 1]
    sched.abort_seq_group(["r0", "r2"])
    assert bm.get_num_waiting_groups() == 0 and bm.gpu.wanted == {}
    _drain(sched)
    bm.check_invariants()
    # A group that never uses the prefix cache adds nothing.
    cc2, sc2 = configs(BS=BS, G=16, PC=False)
    plain = Scheduler(sc2, cc2)
    plain.add_seq_group(make_group("x", shared))
    assert plain.block_manager.get_num_waiting_groups() == 0


def test_recompute_preempted_group_is_wanted_again_until_readmitted():
    cc, sc = configs(BS=BS, G=6, S=4, T=64, L=64, PC=True, PM="recompute")
    sched = Scheduler(sc, cc)
    bm = sched.block_manager
    a = make_group("a", prompt_of(1, 8), max_tokens=12)
    b = make_group("b", prompt_of(2, 8), max_tokens=12)
    sched.add_seq_group(a)
    sched.add_seq_group(b)
    seen_preempted_wanted = False
    for _ in range(60):
        if not sched.has_unfinished_seqs():
            break
        _step(sched)
        waiting = {g.request_id for g in sched.waiting}
        assert set(bm._waiting_hashes) == waiting
        if waiting & {"a", "b"} and sched.num_recompute_preemptions:
            seen_preempted_wanted = True
    assert seen_preempted_wanted and sched.num_recompute_preemptions > 0
    assert bm.gpu.wanted == {}


# ---------------------------------------------------------------------------- property
STREAMS = [[(s * 13 + j * 7) % 5 for j in range(24)] for s in range(3)]
SBS = 2


class WaitingEvictionMachine(RuleBasedStateMachine):
    """Random add-to-waiting / admit / abort / run-and-finish / recompute-preempt sequences on
    a small pool (admissions evict): blocks are conserved, and the pool's wanted counts equal
    the chain hashes of the waiting prompts' full blocks, recomputed from scratch."""

    @initialize(G=st.integers(3, 12), aware=st.booleans())
    def setup(self, G, aware):
        self.bm = BlockSpaceManager(
            SBS, G, 0, watermark=0.0, enable_caching=True, waiting_aware_eviction=aware
        )
        self.waiting: dict[str, object] = {}
        self.running: dict[str, object] = {}
        self.counter = 0

    @rule(stream=st.integers(0, 2), length=st.integers(1, 16), tail=st.integers(0, 3))
    def add(self, stream, length, tail):
        g = make_group(f"r{self.counter}", STREAMS[stream][:length] + [9] * tail, block_size=SBS)
        self.counter += 1
        self.bm.add_waiting(g)
        self.waiting[g.request_id] = g

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        g = self.waiting[rid]
        plan = self.bm.plan_allocation(g)
        if plan.status != AllocStatus.OK:
            return
        self.bm.allocate(g, plan)
        self.bm.release_pins()  # the step that copies a full hit's last block has run
        for s in g.get_seqs():
            s.status = SequenceStatus.RUNNING
        self.running[rid] = self.waiting.pop(rid)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        g = self.waiting.pop(rid)
        self.bm.remove_waiting(g)
        for s in g.get_seqs():
            self.bm.free(s)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        """Compute the group's prompt (registering its blocks), then release it: finished, or
        preempted for recompute (back to waiting, wanted again)."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        g = self.running.pop(rid)
        for s in g.get_seqs():
            s.data.update_num_computed_tokens(s.data.get_num_uncomputed_tokens())
        self.bm.mark_blocks_as_computed(g)
        for s in g.get_seqs():
            self.bm.free(s)
            if preempt:
                s.status = SequenceStatus.WAITING
                s.data.reset_state_for_recompute()
        if preempt:
            self.bm.add_waiting(g)
            self.waiting[rid] = g

    @invariant()
    def books_balance(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        expect: Counter = Counter()
        for g in self.waiting.values():
            prompt = g.get_seqs()[0].data.prompt_token_ids
            expect.update(chain_block_hashes(prompt, SBS))
        assert dict(expect) == self.bm.gpu.wanted
        assert self.bm.get_num_waiting_groups() == len(self.waiting)
        if self.bm.gpu.keep_wanted:
            for b in self.bm.gpu.evictor:
                assert self.bm.gpu.evictor.is_kept(b.block_number) == (b.block_hash in expect)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for g in list(self.waiting.values()):
            self.bm.remove_waiting(g)
        for g in list(self.waiting.values()) + list(self.running.values()):
            for s in g.get_seqs():
                self.bm.free(s)
        assert self.bm.gpu.wanted == {}
        assert self.bm.get_num_free_gpu_blocks() == self.bm.num_total_gpu_blocks


TestWaitingEviction = WaitingEvictionMachine.TestCase
TestWaitingEviction.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
