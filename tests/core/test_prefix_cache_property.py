"""Hypothesis stateful test of the prefix cache's reachability property: after any sequence
of allocations (with prefix hits), prefill chunks, decodes, forks, swaps, frees, evictions
and cache resets -- sliding window or not -- every cached block is reachable from its chain
head (all of its ancestors' hashes are cached), so no evictable block holds memory that no
lookup can ever find. Checked after every operation against the chain hashes the test saw
(independently of the parent link the pool stores), together with block conservation."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.core.block_manager import AllocStatus, BlockSpaceManager
from kvserve.sequence import SequenceStatus
from tests.core.simutil import make_group

BS = 2
# Prompts are drawn from a few token streams so that prefixes are shared between requests.
STREAMS = [[(s * 13 + j * 7) % 5 for j in range(24)] for s in range(3)]


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(
        G=st.integers(3, 14),
        C=st.integers(0, 8),
        window=st.sampled_from([None, None, 4, 6]),
    )
    def setup(self, G, C, window):
        self.bm = BlockSpaceManager(
            block_size=BS,
            num_gpu_blocks=G,
            num_cpu_blocks=C,
            watermark=0.0,
            sliding_window=window,
            enable_caching=True,
        )
        self.groups = {}  # request id -> group (live: running or swapped)
        self.parent_of: dict[int, int | None] = {}  # every chain hash seen -> its parent
        self.counter = 0
        self.next_seq = 10_000

    # ------------------------------------------------------------------ helpers
    def _seqs(self, g, status):
        return [s for s in g.get_seqs() if s.status == status]

    def _running(self):
        return sorted(r for r, g in self.groups.items() if self._seqs(g, SequenceStatus.RUNNING))

    def _swapped(self):
        return sorted(r for r, g in self.groups.items() if self._seqs(g, SequenceStatus.SWAPPED))

    def _learn_hashes(self):
        for hashes in self.bm._seq_hashes.values():
            for i, h in enumerate(hashes):
                self.parent_of.setdefault(h, hashes[i - 1] if i else None)

    # ------------------------------------------------------------------ rules
    @rule(stream=st.integers(0, 2), length=st.integers(1, 20), tail=st.integers(0, 4))
    def add(self, stream, length, tail):
        prompt = STREAMS[stream][:length] + [9] * tail  # a private tail diverges from the stream
        g = make_group(f"r{self.counter}", prompt, block_size=BS)
        self.counter += 1
        if self.bm.can_allocate(g) != AllocStatus.OK:
            return
        self.bm.allocate(g)
        for s in g.get_seqs():
            s.status = SequenceStatus.RUNNING
        self.groups[g.request_id] = g
        self._learn_hashes()

    @precondition(lambda self: self._running())
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 4))
    def step(self, data, chunk, token):
        """One engine step of a running group: a prefill chunk, or a decode token."""
        g = self.groups[data.draw(st.sampled_from(self._running()))]
        bm = self.bm
        seqs = self._seqs(g, SequenceStatus.RUNNING)
        if seqs[0].data.get_num_uncomputed_tokens() == 0:
            for i, s in enumerate(seqs):
                s.append_token_id(token + i)
            if not bm.can_append_slots(g):
                del self.groups[g.request_id]  # no room: preempted by recompute (freed)
                for s in g.get_seqs():
                    bm.free(s)
                return
            for s in seqs:
                bm.append_slots(s)
        for s in seqs:
            n = min(chunk, s.data.get_num_uncomputed_tokens())
            s.data.update_num_computed_tokens(n)
        bm.mark_blocks_as_computed(g)
        bm.release_pins()
        self._learn_hashes()

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data):
        g = self.groups[data.draw(st.sampled_from(self._running()))]
        parent = self._seqs(g, SequenceStatus.RUNNING)[0]
        if parent.data.get_num_uncomputed_tokens() or len(g.get_seqs()) >= 3:
            return
        child = parent.fork(self.next_seq)
        self.next_seq += 1
        g.add(child)
        self.bm.fork(parent, child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free(self, data):
        g = self.groups.pop(data.draw(st.sampled_from(sorted(self.groups))))
        for s in g.get_seqs():
            self.bm.free(s)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        g = self.groups[data.draw(st.sampled_from(self._running()))]
        if len(self._seqs(g, SequenceStatus.RUNNING)) != len(g.get_seqs()) or not self.bm.can_swap_out(g):
            return
        self.bm.swap_out(g)
        for s in g.get_seqs():
            s.status = SequenceStatus.SWAPPED

    @precondition(lambda self: self._swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        g = self.groups[data.draw(st.sampled_from(self._swapped()))]
        if self.bm.can_swap_in(g) != AllocStatus.OK:
            return
        self.bm.swap_in(g)
        for s in g.get_seqs():
            s.status = SequenceStatus.RUNNING

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()

    # ------------------------------------------------------------------ the property
    @invariant()
    def every_cached_block_is_reachable_from_its_chain_head(self):
        if not hasattr(self, "bm"):
            return
        self._learn_hashes()
        cached = self.bm.gpu.cached
        for h in cached:
            assert h in self.parent_of, h
            parent = self.parent_of[h]
            assert parent is None or parent in cached, ("unreachable cached block", cached[h])
        self.bm.check_invariants()

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.release_pins()  # copy-on-write sources of full hits are pinned until a step ran
        for g in self.groups.values():
            for s in g.get_seqs():
                bm.free(s)
        assert bm.gpu.get_num_in_use() == 0 and bm.cpu.get_num_in_use() == 0
        assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
        bm.check_invariants()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
