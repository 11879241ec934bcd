"""LRU evictor for prefix-cached KV blocks that nothing references any more.

A block whose reference count drops to 0 while it still holds a computed, hashed prefix stays
in the cache (it counts as *free*: it can be handed out at any moment) until either a new
request hits its hash (it is taken back out of the evictor) or the pool runs out of never-used
blocks and the least recently used cached block is evicted and reused.

Order: by release time. The block manager releases a sequence's blocks last block first, so
among the blocks of a chain released together the deepest is evicted first and what stays
cached is always a usable head of the chain (vLLM's evictors break ties the same way: the
block with the most prefix tokens goes first).
"""

from __future__ import annotations

from collections import OrderedDict
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


class LRUEvictor(Generic[B]):
    """Holds refcount-0 cached blocks in least-recently-released order.

    ``add`` puts a block at the most-recently-used end, ``remove`` takes a specific block out
    (prefix hit), ``evict`` pops the least recently used one. All operations are O(1).
    """

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, B] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_number: int) -> bool:
        return block_number in self._blocks

    def __iter__(self) -> Iterator[B]:
        return iter(list(self._blocks.values()))

    def add(self, block: B) -> None:
        """Register a block that just became unreferenced (most recently used)."""
        assert block.ref_count == 0, block
        self._blocks[block.block_number] = block
        self._blocks.move_to_end(block.block_number)

    def remove(self, block_number: int) -> B:
        """Take a block out (it is being reused by a prefix hit). Raises KeyError if absent."""
        return self._blocks.pop(block_number)

    def evict(self) -> B:
        """Pop the least recently released block. Raises ValueError when empty."""
        if not self._blocks:
            raise ValueError("LRUEvictor.evict: no evictable block")
        _, block = self._blocks.popitem(last=False)
        return block

    def as_dict(self) -> dict[int, B]:
        return dict(self._blocks)
