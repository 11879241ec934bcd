"""Evictor for prefix-cached KV blocks that nothing references any more.

A block whose reference count drops to 0 while it still holds a computed, hashed prefix stays
in the cache (it counts as *free*: it can be handed out at any moment) until either a new
request hits its hash (it is taken back out of the evictor) or the pool runs out of never-used
blocks and a cached block is evicted and reused.

Order: two classes, each least recently released first. Blocks nobody *keeps* go first; a
block is kept while a request waiting for admission has its hash among its prompt's full
blocks (the block manager says which: ``set_keep``), and kept blocks are evicted only when
nothing else is left. Otherwise a request's cached prefix could be evicted by the admission
just ahead of it in the queue, and it would prefill the whole prompt again.

Within a class the order is by release time. The block manager releases a sequence's blocks
last block first, so among the blocks of a chain released together the deepest is evicted
first and what stays cached is always a usable head of the chain; a block shared by many
chains is released after all of them, so it outlives every chain below it. Waiting prompts
keep whole prefixes (every full block from the first), so the kept class is closed under
"parent of" too and the rule holds across the two classes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class EvictableBlock(Protocol):
    """What the evictor needs of a block (``block.PhysicalBlock`` has it): the evictor stays a
    leaf module, so the block pool can own one without an import cycle."""

    @property
    def block_number(self) -> int: ...

    @property
    def ref_count(self) -> int: ...


B = TypeVar("B", bound=EvictableBlock)

_FREE, _KEPT = 0, 1


class LRUEvictor(Generic[B]):
    """Holds refcount-0 cached blocks: unkept ones evicted first, each class least recently
    released first.

    ``add`` registers a released block (newest), ``remove`` takes a specific one out (prefix
    hit), ``set_keep`` moves a block between the classes keeping its release time, ``evict``
    pops the oldest unkept block, else the oldest kept one. One binary heap per class with
    lazy deletion: ``add``, ``set_keep`` and ``evict`` are O(log n) amortised, ``remove`` and
    lookups O(1).

    Attributes:
        num_kept_evictions: evictions that had to take a kept block (nothing unkept was left).
    """

    def __init__(self) -> None:
        # block number -> (release tick, class, block); the heaps hold (tick, block number)
        # and an item is live only while it matches this entry.
        self._entries: dict[int, tuple[int, int, B]] = {}
        self._heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        self._counts = [0, 0]
        self._tick = 0
        self.num_kept_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_number: int) -> bool:
        return block_number in self._entries

    def __iter__(self) -> Iterator[B]:
        """The blocks, oldest release first (a copy: safe to change the evictor meanwhile)."""
        return iter([e[2] for e in sorted(self._entries.values(), key=lambda e: e[0])])

    def num_kept(self) -> int:
        """Blocks in the kept class."""
        return self._counts[_KEPT]

    def is_kept(self, block_number: int) -> bool:
        """Whether the block is in the evictor and kept. O(1)."""
        e = self._entries.get(block_number)
        return e is not None and e[1] == _KEPT

    def _push(self, cls: int, tick: int, block_number: int) -> None:
        heap = self._heaps[cls]
        heapq.heappush(heap, (tick, block_number))
        if len(heap) > 2 * self._counts[cls] + 64:
            # Drop stale items (blocks removed or moved); amortised over the pushes before.
            live = [(t, n) for t, n in heap if self._live(cls, t, n)]
            heapq.heapify(live)
            heap[:] = live

    def _live(self, cls: int, tick: int, block_number: int) -> bool:
        e = self._entries.get(block_number)
        return e is not None and e[0] == tick and e[1] == cls

    def add(self, block: B, keep: bool = False) -> None:
        """Register a block that just became unreferenced (most recently released), in the
        kept class when ``keep``."""
        assert block.ref_count == 0, block
        assert block.block_number not in self._entries, block
        self._tick += 1
        cls = _KEPT if keep else _FREE
        self._entries[block.block_number] = (self._tick, cls, block)
        self._counts[cls] += 1
        self._push(cls, self._tick, block.block_number)

    def set_keep(self, block_number: int, keep: bool) -> None:
        """Move a block into the kept class (``keep``) or out of it, keeping its release time.
        No-op when the block is not in the evictor or already in that class."""
        e = self._entries.get(block_number)
        cls = _KEPT if keep else _FREE
        if e is None or e[1] == cls:
            return
        tick, old, block = e
        self._entries[block_number] = (tick, cls, block)
        self._counts[old] -= 1
        self._counts[cls] += 1
        self._push(cls, tick, block_number)

    def remove(self, block_number: int) -> B:
        """Take a block out (it is being reused by a prefix hit). Raises KeyError if absent."""
        _, cls, block = self._entries.pop(block_number)
        self._counts[cls] -= 1
        return block

    def evict(self) -> B:
        """Pop the least recently released unkept block, else the least recently released kept
        one (counted in ``num_kept_evictions``). Raises ValueError when empty."""
        if not self._entries:
            raise ValueError("LRUEvictor.evict: no evictable block")
        cls = _FREE if self._counts[_FREE] else _KEPT
        heap = self._heaps[cls]
        while True:
            tick, n = heapq.heappop(heap)
            if self._live(cls, tick, n):
                break
        if cls == _KEPT:
            self.num_kept_evictions += 1
        return self.remove(n)

    def drain(self) -> list[B]:
        """Take every block out (oldest release first) without counting evictions."""
        blocks = list(self)
        self._entries.clear()
        for heap in self._heaps:
            heap.clear()
        self._counts = [0, 0]
        return blocks

    def as_dict(self) -> dict[int, B]:
        return {n: e[2] for n, e in self._entries.items()}
