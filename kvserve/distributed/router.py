"""Which data-parallel replica serves a request: ``--router prefix|least-loaded|round-robin``.

Pure bookkeeping (no Ray, no tensors): the caller passes each replica's outstanding request
count and whether it is up, and tells the router where a request went (``on_routed``) and when
a replica was replaced (``reset_replica``: its new process has an empty KV cache).

``PrefixAwareRouter`` follows SGLang's cache-aware router and llm-d's prefix scorer: it keeps,
per replica, an LRU of the prompt block hashes recently routed there (the chained hashes of
``core.block_manager.chain_block_hashes``, so a hash stands for its whole prefix) and sends a
request to the replica with the longest run of matching leading blocks, unless that replica has
more than ``balance_threshold`` outstanding requests over the least-loaded one; with no match,
or past the threshold, the least-loaded replica takes it (and so starts caching that prefix;
among equally loaded ones, the one caching fewest blocks).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.core.block_manager import chain_block_hashes

ROUTER_NAMES = ("prefix", "least-loaded", "round-robin")

#: Default ``balance_threshold`` of the prefix router, in outstanding requests.
DEFAULT_BALANCE_THRESHOLD = 8
#: Default capacity of each replica's hash LRU, in blocks.
DEFAULT_CACHE_BLOCKS = 4096


def _up_replicas(healthy: Sequence[bool]) -> list[int]:
    up = [i for i, ok in enumerate(healthy) if ok]
    if not up:
        raise RuntimeError("no data-parallel replica is up")
    return up


def _least_loaded(loads: Sequence[int], candidates: Sequence[int]) -> int:
    # ties go to the lowest index, so the choice is deterministic
    return min(candidates, key=lambda i: (loads[i], i))


class Router:
    """Base class: ``select`` a replica for a prompt, then ``on_routed`` once it is sent.

    Args:
        num_replicas: how many replicas (indices ``0 .. num_replicas - 1``).
    """

    name = "?"

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        self.num_replicas = num_replicas

    def select(self, prompt_token_ids: Sequence[int], loads: Sequence[int], healthy: Sequence[bool]) -> int:
        """The replica index for a prompt. ``loads[i]``: replica ``i``'s outstanding requests;
        ``healthy[i]``: whether it is up. Raises RuntimeError when none is up."""
        raise NotImplementedError

    def on_routed(self, replica: int, prompt_token_ids: Sequence[int]) -> None:
        """Record that a prompt was sent to ``replica``."""

    def reset_replica(self, replica: int) -> None:
        """``replica`` was replaced: forget what it held."""


class RoundRobinRouter(Router):
    """Replicas in turn (skipping those that are down), blind to load and prefixes."""

    name = "round-robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = itertools.count()

    def select(self, prompt_token_ids, loads, healthy) -> int:
        up = _up_replicas(healthy)
        for _ in range(self.num_replicas):
            i = next(self._next) % self.num_replicas
            if healthy[i]:
                return i
        return up[0]


class LeastLoadedRouter(Router):
    """The replica with the fewest outstanding requests (lowest index on ties)."""

    name = "least-loaded"

    def select(self, prompt_token_ids, loads, healthy) -> int:
        return _least_loaded(loads, _up_replicas(healthy))


class PrefixAwareRouter(Router):
    """Longest matching prefix (in blocks) wins, within a load-balance threshold.

    Args:
        num_replicas: how many replicas.
        block_size: tokens per block (the engines' ``block_size``).
        balance_threshold: the prefix winner is taken only while its outstanding requests
            exceed the least-loaded replica's by at most this many (>= 0).
        cache_blocks: capacity of each replica's LRU of block hashes (>= 1).

    Raises:
        ValueError: a non-positive ``block_size`` or ``cache_blocks``, a negative threshold.
    """

    name = "prefix"

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
        cache_blocks: int = DEFAULT_CACHE_BLOCKS,
    ):
        super().__init__(num_replicas)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if balance_threshold < 0:
            raise ValueError(f"router_balance_threshold must be >= 0, got {balance_threshold}.")
        if cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {cache_blocks}.")
        self.block_size = block_size
        self.balance_threshold = balance_threshold
        self.cache_blocks = cache_blocks
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        # the hashes of the last prompt scored (select then on_routed hash it once)
        self._memo: tuple[tuple[int, ...], list[int]] | None = None
        self.num_prefix_routed = 0  # requests sent to their best prefix match
        self.num_balanced = 0  # requests that had a match but went to the least-loaded replica

    def _hashes(self, prompt_token_ids: Sequence[int]) -> list[int]:
        key = tuple(prompt_token_ids)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        hashes = chain_block_hashes(key, self.block_size)
        self._memo = (key, hashes)
        return hashes

    def match_blocks(self, replica: int, prompt_token_ids: Sequence[int]) -> int:
        """How many leading full blocks of the prompt were recently routed to ``replica``."""
        lru = self._lru[replica]
        n = 0
        for h in self._hashes(prompt_token_ids):
            if h not in lru:
                break
            n += 1
        return n

    def select(self, prompt_token_ids, loads, healthy) -> int:
        up = _up_replicas(healthy)
        # among the least loaded, the one caching least (SGLang's "smallest tree"): at low
        # load new prefixes then spread over the replicas' caches instead of piling on one
        least = min(up, key=lambda i: (loads[i], len(self._lru[i]), i))
        scores = {i: self.match_blocks(i, prompt_token_ids) for i in up}
        best = max(up, key=lambda i: (scores[i], -loads[i], -i))
        if scores[best] == 0:
            return least
        if loads[best] - loads[least] > self.balance_threshold:
            self.num_balanced += 1
            return least
        self.num_prefix_routed += 1
        return best

    def on_routed(self, replica: int, prompt_token_ids: Sequence[int]) -> None:
        lru = self._lru[replica]
        for h in self._hashes(prompt_token_ids):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.cache_blocks:
            lru.popitem(last=False)

    def reset_replica(self, replica: int) -> None:
        self._lru[replica].clear()


def make_router(
    name: str,
    num_replicas: int,
    block_size: int,
    balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
    cache_blocks: int = DEFAULT_CACHE_BLOCKS,
) -> Router:
    """The router named ``name`` (one of ``ROUTER_NAMES``). Raises ValueError naming the
    choices for an unknown name."""
    if name == "prefix":
        return PrefixAwareRouter(num_replicas, block_size, balance_threshold, cache_blocks)
    if name == "least-loaded":
        return LeastLoadedRouter(num_replicas)
    if name == "round-robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"router must be one of {list(ROUTER_NAMES)}, got {name!r}.")
