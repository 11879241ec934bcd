"""Paged KV-cache bookkeeping: block tables, copy-on-write, swapping, prefix caching.

``BlockSpaceManager`` maps every live sequence to a *block table*: the list of physical block
numbers holding the K/V of its token positions (position ``p`` lives in slot ``p % block_size``
of block ``table[p // block_size]``). It is pure bookkeeping (no tensors): the executor applies
the block moves it returns (``swap_out``: GPU -> CPU, ``swap_in``: CPU -> GPU, copy-on-write
``(src, dst)`` pairs) before running the forward. Design after PagedAttention (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP'23):
§4.2 block tables, §4.4 copy-on-write for parallel sampling, §4.5 swapping / recomputation.

Units: ``block_size`` and lengths are in tokens; pool sizes, watermark and all counts returned
by ``get_num_*`` are in blocks.

Prefix caching (``enable_caching``): a *full* block is identified by a hash chained over its
parent's hash and its own token ids, so equal hashes mean equal prefixes. A block is entered in
the cache only once the forward that fills it has run (``mark_blocks_as_computed``). A new
sequence reuses the longest run of cached full blocks of its tokens, but never all of its
tokens: at least the last token is computed again to get its logits. When the tokens are a
block-aligned full hit, the last block is copied into a private block (``allocate`` returns the
``(src, dst)`` copy) so that writing the last token's K/V cannot touch the shared block.
Unreferenced cached blocks count as free and are evicted least-recently-used first; a sequence
releases its blocks tail first, so among blocks released together the deepest go first and a
chain under pressure shrinks to its longest still-usable head (evicting a head first would
leave the rest of the chain unreachable while it still occupies memory). A completed block
whose content is already cached in another block is replaced by that block (deduplicated), and
a swapped-in sequence re-registers its blocks, so every cached block's prefix stays cached.
Eviction is waiting-aware: while a group waits for admission (``add_waiting`` until it is
admitted by ``allocate`` or leaves by ``remove_waiting``) the hashes of its prompt's full blocks
are *wanted*, and cached blocks holding a wanted hash are evicted only after every other cached
block, so admitting one request cannot evict the prefix the next one in the queue would hit.
The chain of a sequence running with a LoRA adapter starts from the adapter's id
(``Sequence.lora_int_id``): the same tokens give other K/V under another adapter, so blocks are
shared only between sequences of the same adapter (or both of the base model).
Without ``enable_caching`` a group whose ``sampling_params.cache_prefix`` is set still does both
(its full blocks are registered, and it reuses registered blocks); every other group neither
registers nor looks up, so its blocks and costs are those of an engine without caching. Beam
search sets it: each step's beams are new requests that continue their parents' blocks.

Host tier (``host_tier_blocks`` > 0): the host pool holds, besides swapped-out sequences, up to
``host_tier_blocks`` prefix blocks that the device pool evicted. When device-pool allocation
evicts a cached block, it is *demoted*: a host block is taken (the least recently used tier
block gives way when the tier is full) and the step's ``blocks_to_swap_out`` copies it there.
The executor applies swap-outs before swap-ins, copies and the forward, so the copy reads the
block before its new owner writes it. The host copy enters the host cache once the step has
run (``release_pins``), as a refcount-0 block in the host pool's LRU evictor: it counts as free
host memory, so a preemption swap-out takes it like any free block (the tier never makes a swap
fail; the pool is sized swap space + tier, so without swapping beyond the swap space no tier
block is taken either). A lookup walks a chain through the device cache and, past its first
device miss, through the host cache; such host hits are *promoted*: a fresh device block, filled
by the step's ``blocks_to_swap_in`` (the step that admits the group), registered in the device
cache after the step like any computed block. The host source is pinned until the step has run.
Host blocks are cached flat (no parent index): the device cache is closed under "parent of",
so a chain is a device run then a host run, and a host block whose chain lost an earlier block
is never reached and ages out by LRU. A host run is promoted only when swapping it in is cheaper
than prefilling its tokens again (``tier_cost``, a ``PreemptionCost``); else it is recomputed.

Sliding window (``sliding_window`` tokens): once every position of a block is outside the
window of the next query, the block is released; its table entry then repeats the number of
a block the sequence still holds (the runner masks those positions, so any valid block works).
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvserve.core.block import CPU, GPU, BlockPool, PhysicalBlock
from kvserve.core.preemption import LinearPreemptionCost, PreemptionCost
from kvserve.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[PhysicalBlock | None]


def _present(block: PhysicalBlock | None) -> PhysicalBlock:
    # A table's None entries are blocks a sliding window dropped; a fresh allocation has none.
    assert block is not None
    return block


class AllocStatus(enum.Enum):
    """Result of an admission check (``can_allocate`` / ``can_swap_in``).

    OK: fits now. LATER: fits once other sequences free blocks. NEVER: needs more blocks than
    the pool minus the watermark will ever have; the scheduler must reject the group instead
    of waiting for it (which would block every request queued behind it).
    """

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@dataclass
class AllocationPlan:
    """What ``allocate`` would do for a group right now (computed without side effects).

    Attributes:
        status: OK / LATER / NEVER.
        num_required_blocks: distinct blocks the group's tokens need with no cache hit
            (siblings' identical full blocks counted once). Compared with the pool for NEVER.
        num_usable_blocks: ``num_gpu_blocks - watermark_blocks``.
        cost: free blocks the allocation would consume now (fresh blocks + revived cached
            refcount-0 blocks).
        num_cached_tokens: tokens per sequence found in the prefix cache (0 without caching;
            at most ``len - 1``).
    """

    status: AllocStatus
    num_required_blocks: int
    num_usable_blocks: int
    cost: int
    num_cached_tokens: int = 0
    # Internal: per seq, the cached blocks to reuse (len == num_cached_blocks).
    _hits: list[list[PhysicalBlock]] = field(default_factory=list, repr=False)
    _cow_last: bool = False


def lora_chain_seed(lora_int_id: int, lora_request: Hashable | None = None) -> Hashable | None:
    """The ``parent`` of block 0's hash for a sequence running with adapter ``lora_int_id``
    (``lora_request``: its ``LoRARequest``, name and path included): None for the base model
    (0), so its hashes are unchanged by LoRA support; a value no block hash equals otherwise,
    so chains of different adapters never meet, also when an id unloaded from the engine
    comes back naming another adapter (its old blocks may still be cached)."""
    return ("lora", lora_int_id, lora_request) if lora_int_id else None


def chain_block_hashes(
    token_ids: Seq[int], block_size: int, start: int = 0, parent: Hashable | None = None
) -> list[int]:
    """Chained content hashes of the full blocks ``start, start + 1, ...`` of ``token_ids``.

    Block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)``; its hash is
    ``hash((parent, tuple(tokens)))`` where ``parent`` is block ``i - 1``'s hash (for block 0:
    ``lora_chain_seed(lora_int_id)``, None for the base model; pass the hash of block
    ``start - 1`` when ``start > 0``). Equal hashes mean equal
    prefixes, which is what the prefix cache and the data-parallel router match on. Only full
    blocks are hashed (a trailing partial block is not). Values are stable within one process
    only (``hash(None)`` is per process on Python < 3.12): never send them to another.
    """
    hashes: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        h = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(h)
        parent = h
    return hashes


def stable_block_keys(token_ids: Seq[int], block_size: int, start: int = 0, parent: int = 0) -> list[int]:
    """Chained keys of the full blocks ``start, start + 1, ...`` of ``token_ids``, equal in
    every process (``chain_block_hashes`` is per process): block ``i``'s key is the first 63
    bits of blake2b-64 over block ``i - 1``'s key (``parent`` for the first: 0 for the base
    model) and its token ids, as little-endian int64s. Keys of the disk tier."""
    keys: list[int] = []
    for i in range(start, len(token_ids) // block_size):
        data = array("q", [parent, *token_ids[i * block_size : (i + 1) * block_size]]).tobytes()
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
        keys.append(parent)
    return keys


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockSpaceManager:
    """Block tables of all live sequences over a device pool and a CPU swap pool.

    Args:
        block_size: tokens per block (>= 1).
        num_gpu_blocks: device-pool size in blocks.
        num_cpu_blocks: swap-pool size in blocks (0 disables swapping).
        watermark: fraction of device blocks kept free when admitting new prefills or
            swapping in (``watermark_blocks = int(watermark * num_gpu_blocks)``).
        sliding_window: attention window in tokens, or None.
        enable_caching: prefix caching on the device pool for every group (else only for
            groups that ask for it, ``caches``).
        waiting_aware_eviction: evict cached blocks that waiting groups' prompts hold only
            after every other cached block (False: plain least-recently-released order).
        host_tier_blocks: most host-pool blocks the prefix cache's host tier may hold (0: no
            tier; evicted device blocks are dropped). Part of ``num_cpu_blocks``.
        tier_cost: prices promoting a host run (``swap_s(n) / 2``: one way) against
            prefilling its tokens again; None: ``LinearPreemptionCost.default(block_size)``.
        stable_tier_keys: key the host tier by ``stable_block_keys`` (equal across processes;
            the disk tier needs them) instead of the per-process block hashes. Chains of an
            adapter or a ``kv_salt`` are seeded per process and only match within it.

    Raises:
        ValueError: for sizes out of range (``host_tier_blocks`` above ``num_cpu_blocks``).
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        sliding_window: int | None = None,
        enable_caching: bool = False,
        waiting_aware_eviction: bool = True,
        host_tier_blocks: int = 0,
        tier_cost: PreemptionCost | None = None,
        stable_tier_keys: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not 0 <= host_tier_blocks <= (num_cpu_blocks or 0):
            raise ValueError(
                f"host_tier_blocks must be in [0, num_cpu_blocks={num_cpu_blocks or 0}], got {host_tier_blocks}"
            )
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks or 0
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        # The pool can always register blocks: only groups that ``caches`` ever do.
        self.gpu = BlockPool(GPU, num_gpu_blocks, enable_caching=True, keep_wanted=waiting_aware_eviction)
        self.host_tier_blocks = host_tier_blocks
        self.stable_tier_keys = stable_tier_keys
        # seq_id -> stable keys of its leading full blocks (stable_tier_keys only)
        self._seq_tier_keys: dict[int, list[int]] = {}
        # (host block, key) of tier blocks entered since ``take_new_tier_blocks``
        self._new_tier_blocks: list[tuple[int, int]] = []
        self.cpu = BlockPool(
            CPU, self.num_total_cpu_blocks, enable_caching=host_tier_blocks > 0, keep_wanted=False
        )
        self.tier_cost: PreemptionCost = tier_cost or LinearPreemptionCost.default(block_size)
        if host_tier_blocks:
            self.gpu.on_evict = self._demote
        # This step's tier moves: device block -> host block (demotions), host block -> device
        # block (promotions); handed to the scheduler by ``take_tier_moves``.
        self._demotions: dict[int, int] = {}
        self._promotions: dict[int, int] = {}
        # Host blocks demoted in a step not yet run -> their hash (pinned, registered by
        # ``release_pins``), and host sources of promotions (pinned until the step has run).
        self._pending_tier: dict[int, int] = {}
        self._pinned_host: list[PhysicalBlock] = []
        self.gpu_hit_blocks = 0  # distinct device blocks reused by admissions
        self.host_tier_hits = 0  # blocks promoted from the host tier
        self.host_tier_demotions = 0  # device blocks copied into the host tier
        self.block_tables: dict[int, BlockTable] = {}
        # seq_id -> block numbers as handed out by get_block_table (rebuilt after a change;
        # a new list each time, so lists already handed out stay valid snapshots).
        self._ids: dict[int, list[int]] = {}
        # seq_id -> chained hashes of its leading full blocks (prefix caching only).
        self._seq_hashes: dict[int, list[int]] = {}
        # seq_id -> number of leading blocks already considered by mark_blocks_as_computed.
        self._num_marked: dict[int, int] = {}
        # COW sources of full-hit prompts, pinned until the step that copies them has run.
        self._pinned: list[PhysicalBlock] = []
        # request_id -> the prompt block hashes the waiting group wants (``add_waiting``).
        self._waiting_hashes: dict[str, tuple[int, ...]] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def caches(self, seq_group: SequenceGroup) -> bool:
        """Whether ``seq_group`` uses the prefix cache: ``enable_caching``, or its
        ``sampling_params.cache_prefix``."""
        return self.enable_caching or bool(getattr(seq_group.sampling_params, "cache_prefix", False))

    # ================================================================== hashing
    def _get_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained content hashes of ``seq``'s first ``num_blocks`` full blocks; the first
        block's hash is seeded with ``seq``'s adapter when it runs with one (the base
        model's chain is seeded with None, as before adapters existed)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_blocks:
            tokens = seq.get_token_ids()[: num_blocks * self.block_size]
            parent = hashes[-1] if hashes else lora_chain_seed(seq.lora_int_id, seq.lora_request)
            if not hashes and seq.kv_salt is not None:  # K/V that depend on more than tokens
                parent = ("kv_salt", seq.kv_salt, parent)
            hashes.extend(chain_block_hashes(tokens, self.block_size, len(hashes), parent))
        return hashes[:num_blocks] if len(hashes) > num_blocks else hashes

    def _tier_keys(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Host-tier keys of ``seq``'s first ``num_blocks`` full blocks: its block hashes, or
        with ``stable_tier_keys`` its stable keys."""
        if not self.stable_tier_keys:
            return self._get_hashes(seq, num_blocks)
        keys = self._seq_tier_keys.setdefault(seq.seq_id, [])
        if len(keys) < num_blocks:
            tokens = seq.get_token_ids()[: num_blocks * self.block_size]
            if keys:
                parent = keys[-1]
            else:
                seed = lora_chain_seed(seq.lora_int_id, seq.lora_request)
                if seq.kv_salt is not None:
                    seed = ("kv_salt", seq.kv_salt, seed)
                parent = 0 if seed is None else hash(seed) & ((1 << 63) - 1) or 1
            keys.extend(stable_block_keys(tokens, self.block_size, len(keys), parent))
        return keys[:num_blocks]

    def _cache_hits(self, seq: Sequence) -> list[PhysicalBlock]:
        """Leading full blocks of ``seq`` present in the prefix cache (longest run): device
        blocks, then (host tier) host blocks -- or the device block a host block is being
        promoted into this step. A host run that is cheaper to prefill again than to swap in
        (``tier_cost``) is left out."""
        num_full = seq.get_len() // self.block_size
        hits: list[PhysicalBlock] = []
        n_host = 0
        tier_keys: list[int] | None = None
        for i, h in enumerate(self._get_hashes(seq, num_full)):
            b = self.gpu.lookup(h)
            if b is None and self.host_tier_blocks:
                if tier_keys is None:
                    tier_keys = self._tier_keys(seq, num_full)
                b = self.cpu.lookup(tier_keys[i])
                if b is not None:
                    n_host += 1
                    g = self._promotions.get(b.block_number)
                    if g is not None:
                        b = self.gpu.blocks[g]
            if b is None:
                break
            hits.append(b)
        if n_host:
            cost = self.tier_cost
            tokens = n_host * self.block_size
            recompute = cost.recompute_s(tokens, 1) - cost.recompute_s(0, 1)
            if recompute < cost.swap_s(n_host) / 2:
                del hits[len(hits) - n_host :]
        return hits

    # ================================================================== waiting groups
    def add_waiting(self, seq_group: SequenceGroup) -> None:
        """``seq_group`` entered the waiting queue (new, or preempted for recompute): mark the
        hashes of its prompt's full blocks wanted until it is admitted (``allocate``) or
        leaves (``remove_waiting``). Only the prompt's full blocks count, so a group adds at
        most ``prompt_len // block_size`` hashes; they are computed here once and reused by
        ``plan_allocation``. No-op for a group that does not use the prefix cache, has no
        waiting sequence, or is already registered."""
        if not self.caches(seq_group) or seq_group.request_id in self._waiting_hashes:
            return
        seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
        if not seqs:
            return
        n = seqs[0].get_prompt_len() // self.block_size
        hashes = tuple(self._get_hashes(seqs[0], n)[:n])
        self._waiting_hashes[seq_group.request_id] = hashes
        for h in hashes:
            self.gpu.want(h)

    def remove_waiting(self, seq_group: SequenceGroup) -> None:
        """``seq_group`` left the waiting queue (admitted, aborted, rejected, finished): drop
        its wanted hashes. No-op when it holds none."""
        for h in self._waiting_hashes.pop(seq_group.request_id, ()):
            self.gpu.unwant(h)

    def get_num_waiting_groups(self) -> int:
        """Groups whose prompt hashes are currently wanted."""
        return len(self._waiting_hashes)

    # ================================================================== admission
    def _live_seqs(self, seq_group: SequenceGroup) -> list[Sequence]:
        seqs = seq_group.get_seqs(status=SequenceStatus.WAITING)
        return seqs if seqs else seq_group.get_unfinished_seqs()

    def _num_shared_with_first(self, first: Sequence, seq: Sequence, limit: int) -> int:
        """Leading full blocks (at most ``limit``) whose tokens are identical in both seqs."""
        a, b, bs = first.get_token_ids(), seq.get_token_ids(), self.block_size
        n = 0
        while n < limit and a[n * bs : (n + 1) * bs] == b[n * bs : (n + 1) * bs]:
            n += 1
        return n

    def _prefill_layout(self, seqs: list[Sequence]) -> tuple[list[int], int]:
        """Per sequence, the leading full blocks it shares with ``seqs[0]`` (0 for the first),
        and the distinct blocks a prefill of all their tokens needs (shared ones counted once)."""
        first = seqs[0]
        length = first.get_len()
        n_blocks = _cdiv(length, self.block_size)
        shared = [0] + [self._num_shared_with_first(first, s, length // self.block_size) for s in seqs[1:]]
        return shared, n_blocks + sum(n_blocks - k for k in shared[1:])

    def fits_once_recomputed(self, seq_group: SequenceGroup) -> bool:
        """Whether the group's live sequences, freed and prefilled again, fit the usable pool
        (the test ``plan_allocation`` makes for NEVER). Forked sequences hold private copies of
        every block written after the fork, equal tokens or not; a re-prefill shares the leading
        full blocks whose tokens equal the first sequence's, so a group that
        ``can_ever_append_slots`` rejects may still go on after a recompute."""
        _, required = self._prefill_layout(self._live_seqs(seq_group))
        return required <= self.num_total_gpu_blocks - self.watermark_blocks

    def plan_allocation(self, seq_group: SequenceGroup) -> AllocationPlan:
        """Decide (without side effects) whether the group's live sequences fit now.

        A group normally has one sequence; after recompute preemption of a forked group each
        live sequence is re-prefilled from its own tokens, and full blocks identical to the
        first sequence's are shared (counted once).
        """
        seqs = self._live_seqs(seq_group)
        bs = self.block_size
        shared, required = self._prefill_layout(seqs)
        usable = self.num_total_gpu_blocks - self.watermark_blocks

        hits: list[list[PhysicalBlock]] = [[] for _ in seqs]
        num_cached_blocks = 0
        if self.caches(seq_group):
            hits = [self._cache_hits(s) for s in seqs]
            num_cached_blocks = min(len(h) for h in hits)
            need = seq_group.prompt_logits_needed_from()
            if need is not None:
                # A hit position has no logits: reuse only blocks wholly before the first
                # position whose prompt logprob is still to be computed.
                num_cached_blocks = min(num_cached_blocks, need // bs)
        plan = self._plan_with_hits(
            seqs, shared, [h[:num_cached_blocks] for h in hits], num_cached_blocks, required, usable
        )
        if plan.status == AllocStatus.LATER and plan._cow_last:
            # A full hit costs one block more than its length (the private copy of the last
            # block). When that extra block is what does not fit, reuse one block fewer and
            # recompute it instead: otherwise a prompt filling the whole pool would wait
            # forever for a block that can never be free.
            k = num_cached_blocks - 1
            fallback = self._plan_with_hits(seqs, shared, [h[:k] for h in hits], k, required, usable)
            if fallback.status == AllocStatus.OK:
                return fallback
        return plan

    def _plan_with_hits(
        self,
        seqs: list[Sequence],
        shared: list[int],
        hits: list[list[PhysicalBlock]],
        num_cached_blocks: int,
        required: int,
        usable: int,
    ) -> AllocationPlan:
        """The plan that reuses the first ``num_cached_blocks`` hit blocks of every sequence."""
        bs = self.block_size
        length = seqs[0].get_len()
        n_blocks = _cdiv(length, bs)
        cow_last = num_cached_blocks > 0 and num_cached_blocks * bs >= length
        num_cached_tokens = min(num_cached_blocks * bs, length - 1)

        # Free blocks consumed: fresh blocks for every non-hit, non-shared entry, plus
        # revived (refcount-0) hit blocks, plus the private copy of a full-hit last block.
        # A refcount-0 host hit costs a fresh device block (its promotion) like a revived one.
        revived = {(b.device, b.block_number) for h in hits for b in h if b.ref_count == 0}
        fresh = 0
        for i in range(len(seqs)):
            start = num_cached_blocks
            if i > 0:
                start = max(start, shared[i])
            fresh += n_blocks - start
            if cow_last and (i == 0 or shared[i] < num_cached_blocks):
                fresh += 1
        cost = fresh + len(revived)

        if required > usable:
            status = AllocStatus.NEVER
        elif self.gpu.get_num_free_blocks() - cost >= self.watermark_blocks:
            status = AllocStatus.OK
        else:
            status = AllocStatus.LATER
        return AllocationPlan(status, required, usable, cost, num_cached_tokens, hits, cow_last)

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        """OK / LATER / NEVER for prefilling the group's waiting sequences now."""
        return self.plan_allocation(seq_group).status

    def allocate(self, seq_group: SequenceGroup, plan: AllocationPlan | None = None) -> list[tuple[int, int]]:
        """Give every live sequence of the group a block table for all of its tokens.

        Reuses prefix-cache hits (and sets ``seq.data`` computed tokens to the hit length),
        shares siblings' identical full blocks, allocates the rest fresh.

        Args:
            plan: the result of ``plan_allocation`` just before (recomputed when None).

        Returns:
            copy-on-write ``(src, dst)`` GPU block pairs for full-hit prompts (the executor
            must copy before the forward).

        Raises:
            NoFreeBlocksError: the caller ignored a non-OK status.
        """
        if plan is None:
            plan = self.plan_allocation(seq_group)
        seqs = self._live_seqs(seq_group)
        bs = self.block_size
        first = seqs[0]
        length = first.get_len()
        n_blocks = _cdiv(length, bs)
        num_cached_blocks = len(plan._hits[0]) if plan._hits else 0
        copies: list[tuple[int, int]] = []
        first_table: BlockTable = []
        # Hold every hit block while allocating, so a fresh allocation for one sequence can
        # never evict a cached block another sequence of the group is about to reuse.
        held = list({(b.device, b.block_number): b for h in plan._hits for b in h}.values())
        for b in held:
            self._pool(b).incr_ref(b)
        for i, seq in enumerate(seqs):
            assert seq.seq_id not in self.block_tables, f"seq {seq.seq_id} already has blocks"
            shared = 0 if i == 0 else self._num_shared_with_first(first, seq, length // bs)
            table: BlockTable = []
            for j in range(n_blocks):
                if j < num_cached_blocks:
                    last_cow = plan._cow_last and j == num_cached_blocks - 1
                    if i > 0 and j < shared and (not last_cow or shared >= num_cached_blocks):
                        b = _present(first_table[j])
                        self.gpu.incr_ref(b)
                    elif last_cow:
                        src = plan._hits[i][j]
                        if src.device == CPU:
                            src = self._promote(src)  # the swap-in runs before the copy
                        else:
                            self.gpu.incr_ref(src)
                        # pin: the copy runs at the next step
                        self._pinned.append(src)
                        b = self.gpu.allocate()
                        copies.append((src.block_number, b.block_number))
                    else:
                        b = plan._hits[i][j]
                        if b.device == CPU:
                            b = self._promote(b)
                        else:
                            self.gpu.incr_ref(b)
                elif i > 0 and j < shared:
                    b = _present(first_table[j])
                    self.gpu.incr_ref(b)
                else:
                    b = self.gpu.allocate()
                table.append(b)
            self.block_tables[seq.seq_id] = table
            self._ids.pop(seq.seq_id, None)
            # Promoted blocks are not registered yet: mark_blocks_as_computed enters them.
            promoted = set(self._promotions.values())
            registered = 0
            while registered < num_cached_blocks and _present(table[registered]).block_number not in promoted:
                registered += 1
            self._num_marked[seq.seq_id] = registered
            seq.data.set_num_computed_tokens(plan.num_cached_tokens)
            if i == 0:
                first_table = table
        for b in held:
            self._pool(b).free(b)
        self.remove_waiting(seq_group)
        if self.caches(seq_group):
            self.prefix_cache_queries += length
            self.prefix_cache_hits += plan.num_cached_tokens
            self.gpu_hit_blocks += sum(1 for b in held if b.device == GPU)
        if seq_group.num_cached_tokens is None:
            seq_group.num_cached_tokens = plan.num_cached_tokens
        return copies

    # ================================================================== host tier
    def _pool(self, block: PhysicalBlock) -> BlockPool:
        return self.gpu if block.device == GPU else self.cpu

    def _num_tier_blocks(self) -> int:
        """Host blocks held by the tier: cached ones plus demotions of the step not yet run."""
        return len(self.cpu.cached) + len(self._pending_tier)

    def _demote(self, block: PhysicalBlock) -> None:
        """``gpu.on_evict``: copy the evicted cached device block into the host tier (this
        step's swap-out), unless the tier holds its hash already or no host block can be had
        (every host block in use)."""
        h = block.tier_key if self.stable_tier_keys else block.block_hash
        if h is None or h in self.cpu.cached or h in self._pending_tier.values():
            return
        assert block.block_number not in self._demotions, block
        if self._num_tier_blocks() >= self.host_tier_blocks and not self.cpu.evict_one():
            return
        if not self.cpu.get_num_free_blocks():
            return
        c = self.cpu.allocate()  # may evict the least recently used tier block
        self._pending_tier[c.block_number] = h
        self._demotions[block.block_number] = c.block_number
        self.host_tier_demotions += 1

    def _promote(self, host: PhysicalBlock) -> PhysicalBlock:
        """A device block (one reference for the caller) that this step's swap-in fills from
        tier block ``host``; the same one for every group that hits ``host`` in the step."""
        g = self._promotions.get(host.block_number)
        if g is not None:
            b = self.gpu.blocks[g]
            self.gpu.incr_ref(b)
            return b
        b = self.gpu.allocate()
        self._promotions[host.block_number] = b.block_number
        self.cpu.incr_ref(host)  # pinned: no demotion may overwrite it before the swap-in
        self._pinned_host.append(host)
        self.host_tier_hits += 1
        return b

    def take_tier_moves(self, swap_out: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
        """This step's tier moves, once its scheduling is done: ``(swap_in, swap_out)`` maps
        (host -> device promotions, device -> host demotions) to merge into the step's.

        ``swap_out``: the step's preemption swap-out map; a demotion whose device block is
        also a key there is dropped (one copy per source block), its host block freed.
        """
        demotions: dict[int, int] = {}
        for g, c in self._demotions.items():
            if g in swap_out:
                del self._pending_tier[c]
                self.cpu.free(self.cpu.blocks[c])
            else:
                demotions[g] = c
        promotions = self._promotions
        self._demotions, self._promotions = {}, {}
        return promotions, demotions

    def take_new_tier_blocks(self) -> list[tuple[int, int]]:
        """``(host block, stable key)`` of the blocks that entered the host tier since the last
        call (``stable_tier_keys`` only), for the disk tier to write. Their bytes are valid
        until the next step's block moves run."""
        out, self._new_tier_blocks = self._new_tier_blocks, []
        # one the tier has dropped since may already hold other bytes
        return [(c, k) for c, k in out if self.cpu.blocks[c].block_hash == k]

    def adopt_tier_blocks(self, keys: Seq[int]) -> dict[int, int]:
        """Enter blocks read from disk in the host tier, least recently used first, while the
        tier has room and a host block is free. Returns stable key -> host block number (the
        caller fills the blocks before any step). Needs ``stable_tier_keys``."""
        if not self.stable_tier_keys:
            raise ValueError("adopt_tier_blocks needs stable_tier_keys")
        placed: dict[int, int] = {}
        for k in keys:
            if k in self.cpu.cached or k in placed:
                continue
            if self._num_tier_blocks() >= self.host_tier_blocks or not self.cpu.get_num_free_blocks():
                break
            b = self.cpu.allocate()
            self.cpu.register(b, k)
            self.cpu.free(b)
            placed[k] = b.block_number
        return placed

    def drop_tier_moves(self) -> None:
        """The step's block moves failed: its demoted host blocks hold nothing valid, so
        they are freed without entering the tier."""
        for c in self._pending_tier:
            self.cpu.free(self.cpu.blocks[c])
        self._pending_tier.clear()
        self._demotions.clear()

    # ================================================================== decode growth
    def _write_range(self, seq: Sequence, num_lookahead_slots: int) -> tuple[int, int]:
        """Block indices [first, end) written by the next step of ``seq``."""
        first = seq.data.get_num_computed_tokens() // self.block_size
        end = _cdiv(seq.get_len() + num_lookahead_slots, self.block_size)
        return first, end

    def _num_new_blocks_for_append(
        self,
        seq_group: SequenceGroup,
        num_lookahead_slots: int,
        status: SequenceStatus = SequenceStatus.RUNNING,
    ) -> int:
        """New blocks the group's next step needs: growth plus copy-on-write copies."""
        needed = 0
        shared: dict[int, list] = {}
        for seq in seq_group.get_seqs(status=status):
            table = self.block_tables.get(seq.seq_id)
            if table is None:
                continue
            first, end = self._write_range(seq, num_lookahead_slots)
            needed += max(0, end - len(table))
            for i in range(first, min(end, len(table))):
                b = table[i]
                if b is not None and b.ref_count > 1:
                    entry = shared.setdefault(b.block_number, [b, 0])
                    entry[1] += 1
        for b, k in shared.values():
            needed += k if b.ref_count > k else k - 1
        return needed

    def can_append_slots(
        self, seq_group: SequenceGroup, num_lookahead_slots: int = 0, reserve: int = 0
    ) -> bool:
        """Whether every running sequence of the group can get its next slot(s) now, leaving
        ``reserve`` free blocks untouched (blocks promised to a higher-ranked group).

        Counts new blocks for growth and for copy-on-write of shared blocks about to be
        written (a block shared by k of the group's seqs and nobody else needs k-1 copies).
        """
        return (
            self._num_new_blocks_for_append(seq_group, num_lookahead_slots)
            <= self.gpu.get_num_free_blocks() - reserve
        )

    def can_ever_append_slots(self, seq_group: SequenceGroup, num_lookahead_slots: int = 0) -> bool:
        """False when the group's blocks after its next append exceed the whole device pool
        (it could not continue even with every other group preempted)."""
        held = self._distinct_blocks(self._group_tables(seq_group, SequenceStatus.RUNNING))
        return (
            held + self._num_new_blocks_for_append(seq_group, num_lookahead_slots)
            <= self.num_total_gpu_blocks
        )

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Make room for ``seq``'s next token(s) (plus lookahead slots).

        Allocates new blocks as the sequence grows; a shared block about to be written is
        replaced by a private copy (copy-on-write).

        Returns:
            ``(src, dst)`` GPU block pairs to copy before the forward.

        Raises:
            KeyError: ``seq`` has no block table.
            NoFreeBlocksError: ``can_append_slots`` was not checked.
        """
        table = self.block_tables[seq.seq_id]
        first, end = self._write_range(seq, num_lookahead_slots)
        copies: list[tuple[int, int]] = []
        if len(table) < end:
            self._ids.pop(seq.seq_id, None)
            while len(table) < end:
                table.append(self.gpu.allocate())
        for i in range(first, end):
            b = table[i]
            if b is not None and b.ref_count > 1:
                new = self.gpu.allocate()
                self.gpu.free(b)
                table[i] = new
                copies.append((b.block_number, new.block_number))
                self._ids.pop(seq.seq_id, None)
        if self.sliding_window is not None:
            self._release_outside_window(seq)
        return copies

    def try_append_slots(
        self, seq_group: SequenceGroup, num_lookahead_slots: int = 0, reserve: int = 0
    ) -> list[tuple[int, int]] | None:
        """``can_append_slots`` + ``append_slots`` for every running sequence of the group in
        one pass (the scheduler's hot path). Returns the copy-on-write pairs, or None (and
        changes nothing) when the free blocks minus ``reserve`` do not suffice."""
        seqs = [s for s in seq_group.seqs_dict.values() if s.status == SequenceStatus.RUNNING]
        if len(seqs) == 1:
            seq = seqs[0]
            table = self.block_tables[seq.seq_id]
            data = seq.data
            bs = self.block_size
            first = data.get_num_computed_tokens() // bs
            end = -(-(data.get_len() + num_lookahead_slots) // bs)
            need = end - len(table) if end > len(table) else 0
            for i in range(first, min(end, len(table))):
                b = table[i]
                if b is not None and b.ref_count > 1:
                    need += 1
            if need > self.gpu.get_num_free_blocks() - reserve:
                return None
            if need == 0 and self.sliding_window is None:
                return []
            return self.append_slots(seq, num_lookahead_slots)
        if not self.can_append_slots(seq_group, num_lookahead_slots, reserve):
            return None
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            copies.extend(self.append_slots(seq, num_lookahead_slots))
        return copies

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares all of the parent's blocks (ref counts +1; copy-on-write later)."""
        src = self.block_tables[parent_seq.seq_id]
        for b in src:
            if b is not None:
                (self.gpu if b.device == GPU else self.cpu).incr_ref(b)
        self.block_tables[child_seq.seq_id] = list(src)
        self._ids.pop(child_seq.seq_id, None)
        self._num_marked[child_seq.seq_id] = self._num_marked.get(parent_seq.seq_id, 0)
        if parent_seq.seq_id in self._seq_hashes:
            # Only hashes of blocks both share (full blocks before the fork point) stay valid.
            n = parent_seq.get_len() // self.block_size
            self._seq_hashes[child_seq.seq_id] = list(self._seq_hashes[parent_seq.seq_id][:n])
        if parent_seq.seq_id in self._seq_tier_keys:
            n = parent_seq.get_len() // self.block_size
            self._seq_tier_keys[child_seq.seq_id] = list(self._seq_tier_keys[parent_seq.seq_id][:n])

    # ================================================================== swapping
    def _group_tables(
        self, seq_group: SequenceGroup, status: SequenceStatus
    ) -> list[tuple[Sequence, BlockTable]]:
        return [
            (s, self.block_tables[s.seq_id])
            for s in seq_group.get_seqs(status=status)
            if s.seq_id in self.block_tables
        ]

    @staticmethod
    def _distinct_blocks(tables: Seq[tuple[Sequence, BlockTable]]) -> int:
        return len({b.block_number for _, t in tables for b in t if b is not None})

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        """Whether the group's running blocks (shared ones once) fit in free CPU blocks."""
        need = self._distinct_blocks(self._group_tables(seq_group, SequenceStatus.RUNNING))
        return need <= self.cpu.get_num_free_blocks()

    def can_swap_in(
        self, seq_group: SequenceGroup, num_lookahead_slots: int = 0, ignore_watermark: bool = False
    ) -> AllocStatus:
        """OK / LATER / NEVER for bringing a swapped group back with room for its next step
        (the blocks its next token(s) need: growth and copy-on-write).

        NEVER when that exceeds the whole device pool. The watermark applies unless
        ``ignore_watermark`` (the scheduler sets it when nothing is running, so the watermark
        can never make a lone group wait forever).
        """
        tables = self._group_tables(seq_group, SequenceStatus.SWAPPED)
        need = self._distinct_blocks(tables) + self._num_new_blocks_for_append(
            seq_group, num_lookahead_slots, SequenceStatus.SWAPPED
        )
        if need > self.num_total_gpu_blocks:
            return AllocStatus.NEVER
        reserve = 0 if ignore_watermark else self.watermark_blocks
        if self.gpu.get_num_free_blocks() - need >= reserve:
            return AllocStatus.OK
        return AllocStatus.LATER

    def get_num_swapped_blocks(self, seq_group: SequenceGroup) -> int:
        """Distinct CPU blocks held by the group's swapped sequences."""
        return self._distinct_blocks(self._group_tables(seq_group, SequenceStatus.SWAPPED))

    def _move(
        self, tables, src_pool: BlockPool, dst_pool: BlockPool, moved: dict[int, int] | None
    ) -> dict[int, int]:
        # ``moved``: this step's source -> destination numbers so far (updated here). The
        # executor's maps are keyed by source block, so a block shared with a group already
        # moved this step (prefix cache) reuses its destination: a second copy's map entry
        # would overwrite the first, leaving that group's destination never written.
        moved = {} if moved is None else moved
        mapping: dict[int, int] = {}
        if src_pool is self.cpu and self.host_tier_blocks:
            # Hold the host sources until the step has run: a demotion in the same step must
            # not take one (swap-outs are applied before swap-ins).
            for b in {b.block_number: b for _, t in tables for b in t if b is not None}.values():
                self.cpu.incr_ref(b)
                self._pinned_host.append(b)
        for seq, table in tables:
            new_table: BlockTable = []
            for b in table:
                if b is None:
                    new_table.append(None)
                    continue
                n = moved.get(b.block_number)
                if n is None:
                    nb = dst_pool.allocate()
                    moved[b.block_number] = nb.block_number
                else:
                    nb = dst_pool.blocks[n]
                    assert nb.ref_count > 0, f"destination {nb!r} freed within the step"
                    dst_pool.incr_ref(nb)
                mapping[b.block_number] = nb.block_number
                new_table.append(nb)
            self._free_table(table)
            self.block_tables[seq.seq_id] = new_table
            self._ids.pop(seq.seq_id, None)
            if dst_pool is self.gpu:
                # The fresh device copies are unregistered: enter them again (or swap them for
                # the cached originals) at the next mark_blocks_as_computed.
                self._num_marked[seq.seq_id] = 0
        return mapping

    def swap_out(self, seq_group: SequenceGroup, moved: dict[int, int] | None = None) -> dict[int, int]:
        """Move the group's running sequences' blocks to CPU. Shared blocks move once and
        stay shared -- also with other groups when ``moved`` is the step's swap-out map so
        far (it is updated). Returns the group's GPU block -> CPU block. Raises
        NoFreeBlocksError when ``can_swap_out`` was False."""
        tables = self._group_tables(seq_group, SequenceStatus.RUNNING)
        return self._move(tables, self.gpu, self.cpu, moved)

    def swap_in(self, seq_group: SequenceGroup, moved: dict[int, int] | None = None) -> dict[int, int]:
        """Move the group's swapped sequences' blocks back to the device (``moved``: the
        step's swap-in map so far, as for ``swap_out``). Returns the group's CPU block -> GPU
        block. Raises NoFreeBlocksError when ``can_swap_in`` was not OK."""
        tables = self._group_tables(seq_group, SequenceStatus.SWAPPED)
        return self._move(tables, self.cpu, self.gpu, moved)

    # ================================================================== release
    def release_lookahead(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks past those its tokens occupy: lookahead blocks a verification
        left unfilled (its drafts rejected). Held, they counted against the group in every
        later fit check, so a tight cache capped a request earlier than without speculation.
        They hold no computed or hashed slot. No-op without a GPU table."""
        table = self.block_tables.get(seq.seq_id)
        keep = _cdiv(seq.get_len(), self.block_size)
        if (
            table is None
            or len(table) <= keep
            or any(b is not None and b.device != GPU for b in table[keep:])
        ):
            return
        self._free_table(table[keep:])
        del table[keep:]
        self._ids.pop(seq.seq_id, None)

    def free(self, seq: Sequence) -> None:
        """Drop every block reference of ``seq`` (GPU or CPU). No-op if it holds none."""
        table = self.block_tables.pop(seq.seq_id, None)
        self._ids.pop(seq.seq_id, None)
        self._num_marked.pop(seq.seq_id, None)
        self._seq_hashes.pop(seq.seq_id, None)
        self._seq_tier_keys.pop(seq.seq_id, None)
        if table is None:
            return
        self._free_table(table)

    def _free_table(self, table: BlockTable) -> None:
        """Drop one reference per entry, last block first: blocks that become evictable
        together are then evicted deepest first."""
        for b in reversed(table):
            if b is not None:
                (self.gpu if b.device == GPU else self.cpu).free(b)

    def release_pins(self) -> None:
        """Once the step that copied them has run: unpin copy-on-write sources and promoted
        tier blocks, and enter the step's demoted blocks in the host tier (most recent)."""
        pins, self._pinned = self._pinned, []
        for b in pins:
            self.gpu.free(b)
        host, self._pinned_host = self._pinned_host, []
        for b in host:
            self.cpu.free(b)
        pending, self._pending_tier = self._pending_tier, {}
        for c, h in pending.items():
            b = self.cpu.blocks[c]
            if self.cpu.register(b, h) and self.stable_tier_keys:
                self._new_tier_blocks.append((c, h))
            self.cpu.free(b)

    def _release_outside_window(self, seq: Sequence) -> None:
        if self.sliding_window is None:
            return
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        # Next query position >= computed; it attends to positions > computed - window.
        n_release = (seq.data.get_num_computed_tokens() - self.sliding_window) // self.block_size
        n_release = min(n_release, len(table) - 1)  # always keep the last block
        for i in reversed(range(max(0, n_release))):
            b = table[i]
            if b is not None:
                (self.gpu if b.device == GPU else self.cpu).free(b)
                table[i] = None
                self._ids.pop(seq.seq_id, None)

    def mark_blocks_as_computed(self, seq_group: SequenceGroup) -> None:
        """After a step: enter newly completed full blocks of the group in the prefix cache,
        release blocks that left the sliding window, unpin copy-on-write sources."""
        self.release_pins()
        caching = self.caches(seq_group)
        for seq in seq_group.get_unfinished_seqs():
            table = self.block_tables.get(seq.seq_id)
            if table is None:
                continue
            if caching:
                n_full = min(seq.data.get_num_computed_tokens() // self.block_size, len(table))
                start = self._num_marked.get(seq.seq_id, 0)
                if n_full > start:
                    self._register_blocks(seq, table, start, n_full)
                    self._num_marked[seq.seq_id] = n_full
            self._release_outside_window(seq)

    def _register_blocks(self, seq: Sequence, table: BlockTable, start: int, end: int) -> None:
        """Enter ``seq``'s computed full blocks ``[start, end)`` in the prefix cache, in chain
        order. A block whose content another block already holds is replaced by that block
        in the table (same K/V; the duplicate is freed), so the chain stays reachable when
        either copy would otherwise be evicted."""
        hashes = self._get_hashes(seq, end)
        pool = self.gpu
        for i in range(start, end):
            b = table[i]
            if b is None or b.device != GPU:
                continue
            holder = pool.lookup(hashes[i])
            if holder is None:
                if pool.register(b, hashes[i], hashes[i - 1] if i else None) and self.stable_tier_keys:
                    b.tier_key = self._tier_keys(seq, end)[i]
            elif holder is not b:
                pool.incr_ref(holder)
                table[i] = holder
                pool.free(b)
                self._ids.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nothing references (host tier included). True if the
        cache is now empty."""
        host = self.cpu.reset_cache()
        return self.gpu.reset_cache() and host

    # ================================================================== queries
    def get_block_table(self, seq: Sequence) -> list[int]:
        """Block numbers of ``seq`` (entries released by the sliding window repeat a block
        the sequence still holds). Raises KeyError if ``seq`` has no table. The list is
        shared: callers must not modify it (it is replaced, never mutated, on changes)."""
        ids = self._ids.get(seq.seq_id)
        if ids is None:
            table = self.block_tables[seq.seq_id]
            filler = next((b.block_number for b in table if b is not None), 0)
            ids = self._ids[seq.seq_id] = [b.block_number if b is not None else filler for b in table]
        return ids

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def get_computed_block_nums(self, seq: Sequence) -> list[int]:
        """Block numbers of ``seq``'s leading blocks whose every slot is already computed."""
        table = self.block_tables.get(seq.seq_id, [])
        n = seq.data.get_num_computed_tokens() // self.block_size
        return [b.block_number for b in table[:n] if b is not None]

    def get_num_freeable_blocks(self, seq_group: SequenceGroup) -> int:
        """GPU blocks that preempting the group would return (its blocks nobody else holds)."""
        refs: dict[int, list] = {}
        for s in seq_group.get_unfinished_seqs():
            for b in self.block_tables.get(s.seq_id, ()):
                if b is not None and b.device == GPU:
                    refs.setdefault(b.block_number, [b, 0])[1] += 1
        return sum(1 for b, k in refs.values() if b.ref_count == k)

    def get_num_free_gpu_blocks(self) -> int:
        """Free device blocks (cached refcount-0 blocks included)."""
        return self.gpu.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.get_num_free_blocks()

    def get_prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens over all allocations (0.0 before any query)."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_stats(self) -> dict[str, float]:
        """Block counts (blocks), prefix-cache counters (tokens) and the device hits and host
        tier counters (blocks)."""
        free_gpu = self.get_num_free_gpu_blocks()
        return {
            "num_gpu_blocks": self.num_total_gpu_blocks,
            "num_free_gpu_blocks": free_gpu,
            "num_cpu_blocks": self.num_total_cpu_blocks,
            "num_free_cpu_blocks": self.get_num_free_cpu_blocks(),
            "num_cached_gpu_blocks": self.gpu.get_num_evictable(),
            "gpu_cache_usage": 1.0 - free_gpu / self.num_total_gpu_blocks,
            "cpu_cache_usage": (
                1.0 - self.get_num_free_cpu_blocks() / self.num_total_cpu_blocks
                if self.num_total_cpu_blocks
                else 0.0
            ),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.get_prefix_cache_hit_rate(),
            "num_wanted_evictions": self.gpu.get_num_wanted_evictions(),
            "gpu_prefix_cache_hit_blocks": self.gpu_hit_blocks,
            "host_tier_capacity_blocks": self.host_tier_blocks,
            "host_tier_blocks": len(self.cpu.cached),
            "host_tier_hits": self.host_tier_hits,
            "host_tier_demotions": self.host_tier_demotions,
        }

    def check_invariants(self) -> None:
        """Assert conservation on both pools and that ref counts equal table references
        (plus pins). Raises AssertionError with the mismatch."""
        self.gpu.check_invariants()
        self.cpu.check_invariants()
        wanted: dict[int, int] = {}
        for hashes in self._waiting_hashes.values():
            for h in hashes:
                wanted[h] = wanted.get(h, 0) + 1
        assert wanted == self.gpu.wanted, ("wanted counts", wanted, self.gpu.wanted)
        counts: dict[tuple[str, int], int] = {}
        for table in self.block_tables.values():
            for b in table:
                if b is not None:
                    key = (b.device, b.block_number)
                    counts[key] = counts.get(key, 0) + 1
        for b in self._pinned:
            counts[(GPU, b.block_number)] = counts.get((GPU, b.block_number), 0) + 1
        for b in self._pinned_host:
            counts[(CPU, b.block_number)] = counts.get((CPU, b.block_number), 0) + 1
        for c in self._pending_tier:
            counts[(CPU, c)] = counts.get((CPU, c), 0) + 1
        tier = self._num_tier_blocks()
        assert tier <= self.host_tier_blocks, ("host tier over its bound", tier, self.host_tier_blocks)
        for b in self.cpu.cached.values():
            assert b.parent_hash is None, ("host tier blocks are cached flat", b)
        for pool in (self.gpu, self.cpu):
            for b in pool.blocks:
                assert b.ref_count == counts.get((pool.device, b.block_number), 0), (
                    b,
                    counts.get((pool.device, b.block_number), 0),
                )
