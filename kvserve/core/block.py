"""Physical KV blocks and a reference-counted block pool (one per device).

A *block* holds the K/V of ``block_size`` consecutive token positions of one sequence
(PagedAttention, Kwon et al., SOSP'23, §4.1-4.3). Several sequences may reference the same
physical block (forked samples share their prompt; prefix caching shares equal prefixes
across requests); the block goes back to the pool when its reference count drops to 0.

Pool accounting (the conservation invariant the tests hold after every step)::

    num_free (never-used/uncached + cached-evictable) + num_in_use (ref_count > 0) == num_blocks

With prefix caching a block whose content is a computed full block is *registered* under its
content hash (``block_hash``); when its last reference goes it moves to the LRU evictor
instead of the plain free list, so a later request with the same prefix can reuse it.

Reachability (held by ``check_invariants``): a cached block is only found through the cached
blocks of its whole prefix (lookups walk a chain from its head), so every registered block's
parent hash is registered too. ``register`` refuses a block whose parent is not cached, and
dropping a hash from the cache (eviction) drops its cached descendants at once: an evictable
one goes back to the plain free list, an in-use one stays with its sequence, unregistered.
The block manager releases a sequence's blocks tail first, so LRU eviction takes a chain's
deepest blocks first and keeps its longest reusable head.

Wanted hashes: the block manager counts, per content hash, the waiting requests whose prompt
holds it (``want`` / ``unwant``); a refcount-0 block whose hash is wanted sits in the
evictor's kept class and is evicted only when no other cached block is left
(``core/evictor.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvserve.core.evictor import LRUEvictor

GPU = "gpu"
CPU = "cpu"


class NoFreeBlocksError(RuntimeError):
    """Raised by ``BlockPool.allocate`` when neither a free nor an evictable block is left.

    The scheduler checks capacity first (``can_allocate`` / ``can_append_slots`` /
    ``can_swap_*``), so this signals a bookkeeping bug, never normal back-pressure.
    """


class PhysicalBlock:
    """One block of a pool.

    Attributes:
        block_number: index in its pool (what block tables hold).
        device: ``"gpu"`` (the device pool) or ``"cpu"`` (swap space).
        ref_count: how many sequence block-table entries point at it.
        block_hash: content hash when the block is registered in the prefix cache, else None.
        parent_hash: hash of the previous block of its chain when registered (None for a
            chain head or an unregistered block).
        tier_key: a registered device block's key in the host tier when that tier is keyed
            other than by ``block_hash`` (stable keys, for the disk tier), else None.
    """

    __slots__ = ("block_number", "device", "ref_count", "block_hash", "parent_hash", "tier_key")

    def __init__(self, block_number: int, device: str) -> None:
        self.block_number = block_number
        self.device = device
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.tier_key: int | None = None

    def __repr__(self) -> str:
        return (
            f"PhysicalBlock({self.device}#{self.block_number}, ref={self.ref_count}, hash={self.block_hash})"
        )


class BlockPool:
    """Reference-counted allocator over ``num_blocks`` blocks of one device.

    Args:
        device: ``"gpu"`` or ``"cpu"``.
        num_blocks: pool size in blocks (>= 0).
        enable_caching: keep registered (hashed, computed) blocks after their last reference
            in an LRU evictor; they count as free and are reused on a hash hit.
        keep_wanted: evict blocks whose hash is ``want``-ed only after every other cached
            block (False: plain LRU; the wanted counts are kept either way).

    Plain free blocks are handed out lowest number first (a heap), so a long-running engine
    keeps its K/V on the fewest pages, and blocks allocated together (a prompt's) mostly in
    runs. A first-in-first-out list would spread a busy engine's blocks over the whole pool and
    slow decode attention down (``docs/benchmarks.md``).
    """

    def __init__(
        self, device: str, num_blocks: int, enable_caching: bool = False, keep_wanted: bool = True
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.device = device
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[PhysicalBlock] = [PhysicalBlock(i, device) for i in range(num_blocks)]
        self._free_ids: list[int] = list(range(num_blocks))  # a heap (sorted is one)
        self.evictor: LRUEvictor[PhysicalBlock] = LRUEvictor()
        # content hash -> the registered block holding it
        self.cached: dict[int, PhysicalBlock] = {}
        # parent hash -> block numbers of the registered blocks that continue it
        self._children: dict[int, set[int]] = {}
        self._num_in_use = 0
        self.keep_wanted = keep_wanted
        # content hash -> number of waiting requests whose prompt holds it (absent: 0)
        self.wanted: dict[int, int] = {}
        #: Called with a cached block that ``allocate`` is about to evict (its hash still
        #: set), before it is unregistered: the block manager demotes it to the host tier.
        self.on_evict: Callable[[PhysicalBlock], None] | None = None

    # ------------------------------------------------------------------ counts
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never-used/uncached plus cached refcount-0."""
        return len(self._free_ids) + len(self.evictor)

    def get_num_in_use(self) -> int:
        """Blocks with ``ref_count > 0``."""
        return self._num_in_use

    def get_num_evictable(self) -> int:
        return len(self.evictor)

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> PhysicalBlock:
        """A fresh private block with ``ref_count == 1`` and no hash.

        Takes the lowest-numbered never-used/uncached block first; otherwise evicts the least
        recently used cached block (dropping its hash entry).

        Raises:
            NoFreeBlocksError: nothing free and nothing evictable.
        """
        if self._free_ids:
            block = self.blocks[heapq.heappop(self._free_ids)]
        elif len(self.evictor):
            block = self.evictor.evict()
            if self.on_evict is not None:
                self.on_evict(block)
            self._unregister(block)
        else:
            raise NoFreeBlocksError(f"no free {self.device} block (pool of {self.num_blocks})")
        assert block.ref_count == 0, block
        block.ref_count = 1
        self._num_in_use += 1
        return block

    def incr_ref(self, block: PhysicalBlock) -> None:
        """Add a reference (fork, prefix hit, shared swap). Revives a cached free block."""
        if block.ref_count == 0:
            # Only registered blocks can be referenced again from refcount 0 (a prefix hit).
            self.evictor.remove(block.block_number)
            self._num_in_use += 1
        block.ref_count += 1

    def free(self, block: PhysicalBlock) -> None:
        """Drop one reference; at 0 the block becomes evictable (if cached) or free.

        Raises:
            ValueError: the block is already free (double free).
        """
        if block.ref_count <= 0:
            raise ValueError(f"double free of {block!r}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._num_in_use -= 1
            if block.block_hash is not None:
                self.evictor.add(block, keep=self.keep_wanted and block.block_hash in self.wanted)
            else:
                heapq.heappush(self._free_ids, block.block_number)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int) -> PhysicalBlock | None:
        """The registered block holding ``block_hash`` (in use or evictable), or None."""
        return self.cached.get(block_hash)

    def register(self, block: PhysicalBlock, block_hash: int, parent_hash: int | None = None) -> bool:
        """Enter a computed full block in the prefix cache under ``block_hash``.

        Args:
            parent_hash: hash of the block before it in its chain (None for the first block).

        Returns False (and leaves the block private) when caching is off, the block is
        already registered, another block already holds this content, or ``parent_hash`` is
        not cached (the block could never be reached by a lookup).
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        if parent_hash is not None:
            if parent_hash not in self.cached:
                return False
            self._children.setdefault(parent_hash, set()).add(block.block_number)
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        self.cached[block_hash] = block
        return True

    def want(self, block_hash: int) -> None:
        """One more waiting request needs ``block_hash`` (cached now or not): a refcount-0
        block holding it moves to the evictor's kept class. O(log n)."""
        n = self.wanted.get(block_hash, 0)
        self.wanted[block_hash] = n + 1
        if n == 0 and self.keep_wanted:
            b = self.cached.get(block_hash)
            if b is not None and b.ref_count == 0:
                self.evictor.set_keep(b.block_number, True)

    def unwant(self, block_hash: int) -> None:
        """Undo one ``want``. Raises KeyError when ``block_hash`` is not wanted."""
        n = self.wanted[block_hash] - 1
        if n:
            self.wanted[block_hash] = n
            return
        del self.wanted[block_hash]
        b = self.cached.get(block_hash)
        if b is not None and b.ref_count == 0:
            self.evictor.set_keep(b.block_number, False)

    def get_num_wanted_evictions(self) -> int:
        """Evictions that took a block a waiting request wanted (nothing else was cached)."""
        return self.evictor.num_kept_evictions

    def _unregister(self, block: PhysicalBlock) -> None:
        """Drop ``block`` from the cache, with every cached block below it in its chain (they
        would be unreachable). Descendants in the evictor become plain free blocks; ``block``
        itself is left where the caller has it (taken out of the evictor already, or in use).
        O(number of blocks dropped)."""
        stack = [block]
        while stack:
            b = stack.pop()
            h = b.block_hash
            if h is None:
                continue
            if self.cached.get(h) is b:
                del self.cached[h]
            if b.parent_hash is not None:
                siblings = self._children.get(b.parent_hash)
                if siblings is not None:
                    siblings.discard(b.block_number)
                    if not siblings:
                        del self._children[b.parent_hash]
            b.block_hash = None
            b.parent_hash = None
            b.tier_key = None
            for n in self._children.pop(h, ()):
                child = self.blocks[n]
                if child.ref_count == 0 and n in self.evictor:
                    self.evictor.remove(n)
                    heapq.heappush(self._free_ids, n)
                stack.append(child)

    def evict_one(self) -> bool:
        """Drop the least recently released cached refcount-0 block from the cache (it becomes
        a plain free block; no ``on_evict``). Returns False when nothing is evictable."""
        if not len(self.evictor):
            return False
        block = self.evictor.evict()
        self._unregister(block)
        heapq.heappush(self._free_ids, block.block_number)
        return True

    def reset_cache(self) -> bool:
        """Evict every cached refcount-0 block (hash entries dropped, blocks become plain free).

        Returns True when no registered block remains (nothing cached is in use), else False
        (the in-use ones stay registered and are dropped later by normal eviction).
        """
        for block in self.evictor.drain():
            self._unregister(block)
            heapq.heappush(self._free_ids, block.block_number)
        return not self.cached

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert conservation and ref-count consistency (used by the tests).

        Raises:
            AssertionError: with the counts when the pool's books do not balance.
        """
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        assert in_use == self._num_in_use, (self.device, in_use, self._num_in_use)
        assert len(set(self._free_ids)) == len(self._free_ids), "duplicate free ids"
        for i in self._free_ids:
            b = self.blocks[i]
            assert b.ref_count == 0 and b.block_hash is None and i not in self.evictor, b
        for b in self.evictor:
            assert b.ref_count == 0 and b.block_hash is not None, b
            kept = self.keep_wanted and b.block_hash in self.wanted
            assert self.evictor.is_kept(b.block_number) == kept, ("evictor class", b)
        assert all(n > 0 for n in self.wanted.values()), "non-positive wanted count"
        for h, b in self.cached.items():
            assert b.block_hash == h, (h, b)
            # Reachable from its chain head: the parent is cached (by induction, all ancestors).
            assert b.parent_hash is None or b.parent_hash in self.cached, ("unreachable", b)
            if b.parent_hash is not None:
                assert b.block_number in self._children.get(b.parent_hash, ()), ("child index", b)
        for b in self.blocks:
            assert b.block_hash is None or self.cached.get(b.block_hash) is b, ("stale hash", b)
        for parent, kids in self._children.items():
            assert parent in self.cached and kids, (parent, kids)
            for n in kids:
                assert self.blocks[n].parent_hash == parent, (parent, self.blocks[n])
        free = len(self._free_ids) + len(self.evictor)
        assert free + in_use == self.num_blocks, (self.device, free, in_use, self.num_blocks)
