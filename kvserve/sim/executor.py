"""A tensor-free executor: runs the real scheduler/block manager against a cost model.

``SimulatedExecutor.execute_model`` takes the same ``ExecuteModelRequest`` the real worker
gets and returns one ``CompletionSequenceGroupOutput`` per scheduled group, so ``LLMEngine``
runs unchanged on top of it (``LLMEngine(..., executor=sim, clock=sim.clock)``).

It is also a checker for the KV bookkeeping. It keeps a *shadow KV cache*: for every GPU and
CPU block, the token id written in each slot. Each step it

1. validates the request (chunk inside the block table, no zero-token prefill, no position
   >= max_model_len, swap/copy maps one-to-one and in range, no CPU block both written by a
   swap-out and read by a swap-in in the same step, no two sequences writing different tokens
   into one slot -- a missed copy-on-write);
2. applies swap-out, swap-in, then copies, exactly like the real cache engine;
3. writes each scheduled token id into its slot through the block table;
4. "samples" by reading the context back *through the block table* and hashing it. The
   sampled token is therefore a deterministic function of the sequence's tokens when the
   bookkeeping is right -- any schedule gives the same outputs -- and a swap, copy or
   prefix-cache bug shows up as a different token (or, with ``strict``, as an immediate
   ``KVCacheCorruption`` naming the sequence and position).

Speculative decoding (``acceptance``, an ``AcceptanceModel``): a decode whose metadata
reserves ``num_speculative_tokens = m`` lookahead slots is a verification of ``m`` drafts (fewer
when ``max_tokens`` is nearer, as the real verifier does). The model draws how many are accepted
(``a``, from a uniform that is a hash of the context, so runs repeat); the step emits ``a + 1``
tokens in the engine's format (``SequenceOutput.spec_tokens``), which are the next ``a + 1``
tokens the hash chain above gives -- the very tokens decoding without speculation samples, so
output never depends on speculation. The shadow cache gets the accepted drafts' tokens at
positions ``L .. L+a-1`` and a marker that is no token (-2) in the rejected drafts' slots: a
later read of one of those before it is rewritten (a missed rollback of
``num_computed_tokens``) is a ``KVCacheCorruption``.

LoRA: a slot written for a group running with an adapter holds the token tagged with the
adapter's id (``kv_entry``), as real K/V depends on the adapter; reading it back for another
adapter (or the base model) is a ``KVCacheCorruption``, so a prefix-cache block shared across
adapters is caught, and sampled tokens depend on the adapter as a real model's would.

Time: each step advances ``clock`` (a ``VirtualClock``) by ``cost_model.step_cost(step_shape(req))``
(the same ``StepShape`` the profiler measures the real worker by; its ``loras`` counts the
step's distinct adapters); a
verification adds its ``m`` extra query tokens (``num_verify_tokens``) and the step the
proposer's ``m * draft_step_s``.
"""

from __future__ import annotations

from kvserve.lora_request import LoRARequest
from kvserve.sequence import CompletionSequenceGroupOutput, ExecuteModelRequest, SequenceOutput
from kvserve.sim.acceptance import AcceptanceModel
from kvserve.sim.cost_model import RANGED, CostModel, VirtualClock
from kvserve.sim.step_shape import step_shape

_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
#: Shadow-cache content of a rejected draft's slot: no token id, so reading it is corruption.
REJECTED_DRAFT = -2
#: Salt of the hash that draws a verification's acceptance.
_ACCEPT_SALT = 0x5BEC


class KVCacheCorruption(AssertionError):
    """The shadow cache read back something other than the sequence's tokens."""


class InvalidExecuteRequest(AssertionError):
    """The request violates an executor invariant (bad chunk, block maps, positions)."""


def kv_entry(token: int, lora_int_id: int) -> int:
    """The shadow-cache content of a slot holding ``token``'s K/V computed with adapter
    ``lora_int_id`` (0 = the base model: the token id itself)."""
    return token if lora_int_id == 0 else token + (lora_int_id << 32)


def _describe_entry(entry: int | None) -> str:
    """A shadow-cache slot in words (for corruption messages)."""
    if entry is None or entry < 0:
        return repr(entry)
    lora, token = entry >> 32, entry & 0xFFFFFFFF
    return f"token {token}" + (f" of adapter {lora}" if lora else "")


def token_hash(tokens, salt: int = 0) -> int:
    """64-bit FNV-1a-style hash of a token-id sequence (stable across processes)."""
    h = _FNV_OFFSET ^ (salt * 0x9E3779B97F4A7C15 & _MASK)
    for t in tokens:
        h = ((h ^ (t & _MASK)) * _FNV_PRIME) & _MASK
    return h


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: FNV's high bits barely depend on a short input, and the
    acceptance draw reads them (as a uniform in [0, 1))."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class SimulatedExecutor:
    """Executor with a cost model instead of a model.

    Args:
        vocab_size: sampled ids are in ``[0, vocab_size)``.
        cost_model: step latency model (default: ``CostModel()``).
        eos_token_id: never sampled unless ``allow_eos`` (then it appears wherever the hash
            lands on it).
        block_size: tokens per block (from ``cache_config`` when given; default 16).
        cache_config: takes ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``,
            ``sliding_window`` from it.
        max_model_len: when set, a position >= it is an invalid request.
        check_kv: keep the shadow cache and sample from it (False: O(1) per row, sampled from
            (length, last token) -- for long trace replays).
        strict: raise ``KVCacheCorruption`` as soon as a read-back differs from the sequence.
        clock: a ``VirtualClock`` to advance (a new one at 0.0 by default).
        acceptance: how many drafts a verification accepts (speculative decoding; see the
            module docstring). ``None``: decodes that reserve lookahead slots still decode one
            token (nothing is accepted).

    Attributes:
        clock: the virtual clock; ``num_steps``, ``busy_time_s``: totals;
        ``num_lora_adapter_steps``: the steps' distinct LoRA adapters, summed;
        ``num_scheduled_groups``: the steps' scheduled groups, summed;
        ``lora_slot_steps``: adapter slot occupancy, ``{groups: slot-steps}`` (one count per
        step and adapter in it, keyed by how many of the step's groups run with that adapter).
            ``num_extrapolated_steps``: steps larger than any the cost model was profiled on
            (``CostModel.outside_range``), ``extrapolated_time_s`` their summed cost;
            ``largest``: the largest of each ``RANGED`` count over all steps.
    """

    def __init__(
        self,
        vocab_size: int,
        cost_model: CostModel | None = None,
        eos_token_id: int | None = None,
        *,
        block_size: int | None = None,
        cache_config=None,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int | None = None,
        sliding_window: int | None = None,
        max_model_len: int | None = None,
        check_kv: bool = True,
        strict: bool = True,
        allow_eos: bool = False,
        clock: VirtualClock | None = None,
        acceptance: AcceptanceModel | None = None,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.cost_model = cost_model or CostModel()
        self.eos_token_id = eos_token_id
        if cache_config is not None:
            block_size = block_size or cache_config.block_size
            num_gpu_blocks = num_gpu_blocks if num_gpu_blocks is not None else cache_config.num_gpu_blocks
            num_cpu_blocks = num_cpu_blocks if num_cpu_blocks is not None else cache_config.num_host_blocks()
            sliding_window = sliding_window or cache_config.sliding_window
        self.block_size = block_size or 16
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.sliding_window = sliding_window
        self.max_model_len = max_model_len
        self.check_kv = check_kv
        self.strict = strict
        self.allow_eos = allow_eos
        self.clock = clock if clock is not None else VirtualClock()
        self.acceptance = acceptance
        self.gpu: dict[int, list[int | None]] = {}
        self.cpu: dict[int, list[int | None]] = {}
        self.num_steps = 0
        self.num_extrapolated_steps = 0  # steps past the cost model's profiled shapes
        self.extrapolated_time_s = 0.0
        self.largest: dict[str, float] = dict.fromkeys(RANGED, 0)
        self.busy_time_s = 0.0
        self.num_lora_adapter_steps = 0  # sum over steps of the step's distinct adapters
        self.num_scheduled_groups = 0
        self.lora_slot_steps: dict[int, int] = {}
        self.requests: list[ExecuteModelRequest] = []  # kept only when record=True
        self.record = False
        self.loras: dict[int, LoRARequest] = {}  # "loaded" adapters: there are no weights

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (the executor interface; nothing is read from its path).
        False if its id was registered already."""
        new = lora_request.lora_int_id not in self.loras
        self.loras[lora_request.lora_int_id] = lora_request
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not registered."""
        return self.loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        """Ids of the registered adapters."""
        return set(self.loras)

    # ------------------------------------------------------------------ helpers
    def _block(self, pool: dict[int, list[int | None]], n: int) -> list[int | None]:
        b = pool.get(n)
        if b is None:
            b = pool[n] = [None] * self.block_size
        return b

    def _check_range(self, what: str, n: int, limit: int | None) -> None:
        if not isinstance(n, int) or n < 0 or (limit is not None and n >= limit):
            raise InvalidExecuteRequest(f"{what} block {n!r} out of range (pool of {limit})")

    def _validate_maps(self, req: ExecuteModelRequest) -> None:
        out_vals = list(req.blocks_to_swap_out.values())
        for g, c in req.blocks_to_swap_out.items():
            self._check_range("swap-out source gpu", g, self.num_gpu_blocks)
            self._check_range("swap-out target cpu", c, self.num_cpu_blocks)
        if len(set(out_vals)) != len(out_vals):
            raise InvalidExecuteRequest(f"two GPU blocks swap out to one CPU block: {req.blocks_to_swap_out}")
        in_vals = list(req.blocks_to_swap_in.values())
        for c, g in req.blocks_to_swap_in.items():
            self._check_range("swap-in source cpu", c, self.num_cpu_blocks)
            self._check_range("swap-in target gpu", g, self.num_gpu_blocks)
        if len(set(in_vals)) != len(in_vals):
            raise InvalidExecuteRequest(f"two CPU blocks swap in to one GPU block: {req.blocks_to_swap_in}")
        clash = set(out_vals) & set(req.blocks_to_swap_in)
        if clash:
            raise InvalidExecuteRequest(
                f"CPU blocks {sorted(clash)} are written by swap-out and read by swap-in in the same step"
            )
        dsts: list[int] = []
        for src, ds in req.blocks_to_copy.items():
            self._check_range("copy source", src, self.num_gpu_blocks)
            for d in ds:
                self._check_range("copy target", d, self.num_gpu_blocks)
            dsts.extend(ds)
        if len(set(dsts)) != len(dsts) or set(dsts) & set(req.blocks_to_copy):
            raise InvalidExecuteRequest(f"copy targets repeat or are also sources: {req.blocks_to_copy}")

    def _sample(self, tokens_read: list[int], salt: int) -> int:
        tok = token_hash(tokens_read, salt) % self.vocab_size
        if not self.allow_eos and self.eos_token_id is not None and tok == self.eos_token_id:
            tok = (tok + 1) % self.vocab_size
        return tok

    # ------------------------------------------------------------------ the step
    def execute_model(self, req: ExecuteModelRequest) -> list[CompletionSequenceGroupOutput]:
        """Validate, apply block moves, write the scheduled tokens into the shadow cache and
        return one output per metadata entry (no samples where ``do_sample`` is False).

        Raises:
            InvalidExecuteRequest: a violated request invariant.
            KVCacheCorruption: (``strict``) the cache does not hold the sequence's tokens.
        """
        if self.record:
            self.requests.append(req)
        bs = self.block_size
        self._validate_maps(req)
        # -- validate the rows and plan the writes
        writes: dict[tuple, int] = {}
        verify_tokens = draft_steps = 0
        num_drafts: dict[int, int] = {}  # metadata index -> drafts verified per sequence
        for mi, meta in enumerate(req.seq_group_metadata_list):
            chunk = meta.token_chunk_size
            m = 0 if meta.is_prompt else meta.num_speculative_tokens
            if m < 0:
                raise InvalidExecuteRequest(f"{meta.request_id}: num_speculative_tokens {m} < 0")
            if chunk < 1:
                raise InvalidExecuteRequest(
                    f"{meta.request_id}: token_chunk_size {chunk} < 1 (zero-token prefill)"
                )
            if not meta.seq_data:
                raise InvalidExecuteRequest(f"{meta.request_id}: no sequence to run")
            for sid, data in meta.seq_data.items():
                c = data.get_num_computed_tokens()
                n = data.get_len()
                if c + chunk > n:
                    raise InvalidExecuteRequest(
                        f"{meta.request_id}/seq {sid}: chunk {chunk} from {c} passes the sequence length {n}"
                    )
                if not meta.is_prompt and (chunk != 1 or c + 1 != n):
                    raise InvalidExecuteRequest(
                        f"{meta.request_id}/seq {sid}: decode with chunk {chunk}, computed {c}, len {n}"
                    )
                if meta.is_prompt and meta.do_sample != (c + chunk == n):
                    raise InvalidExecuteRequest(
                        f"{meta.request_id}/seq {sid}: do_sample={meta.do_sample} "
                        f"but chunk ends at {c + chunk} of {n}"
                    )
                if self.max_model_len is not None and c + chunk + m > self.max_model_len:
                    raise InvalidExecuteRequest(
                        f"{meta.request_id}/seq {sid}: position {c + chunk + m - 1} "
                        f">= max_model_len {self.max_model_len}"
                    )
                table = meta.block_tables.get(sid)
                if table is None or len(table) * bs < c + chunk + m:
                    raise InvalidExecuteRequest(
                        f"{meta.request_id}/seq {sid}: block table "
                        f"{table} too short for positions < {c + chunk + m}"
                    )
                # min/max first (C speed: long replays check every table every step); the
                # per-entry check only to name the offending block
                if table and (
                    min(table) < 0 or (self.num_gpu_blocks is not None and max(table) >= self.num_gpu_blocks)
                ):
                    for b in table:
                        self._check_range("block table", b, self.num_gpu_blocks)
                if self.check_kv:
                    toks = data.get_token_ids()
                    lora = meta.lora_int_id
                    for pos in range(c, c + chunk):
                        key = (table[pos // bs], pos % bs)
                        entry = kv_entry(toks[pos], lora)
                        prev = writes.get(key)
                        if prev is not None and prev != entry:
                            raise InvalidExecuteRequest(
                                f"{meta.request_id}/seq {sid}: slot {key} written with two different "
                                f"tokens (or adapters) in one step (missing copy-on-write)"
                            )
                        writes[key] = entry
            if m and meta.do_sample:
                mt = meta.sampling_params.max_tokens
                out_len = max(d.get_output_len() for d in meta.seq_data.values())
                if mt is not None:  # drafts past max_tokens could never be emitted
                    m = min(m, mt - out_len - 1)
                if m >= 1:
                    num_drafts[mi] = m
                    verify_tokens += m * len(meta.seq_data)
                    draft_steps = max(draft_steps, m)
        # -- block moves, in the documented order
        if self.check_kv:
            for g, c in req.blocks_to_swap_out.items():
                self.cpu[c] = list(self._block(self.gpu, g))
            for c, g in req.blocks_to_swap_in.items():
                self.gpu[g] = list(self._block(self.cpu, c))
            for src, ds in req.blocks_to_copy.items():
                content = list(self._block(self.gpu, src))
                for d in ds:
                    self.gpu[d] = list(content)
            for (b, slot), tok in writes.items():
                self._block(self.gpu, b)[slot] = tok
        # -- sample
        results: list[CompletionSequenceGroupOutput] = []
        for mi, meta in enumerate(req.seq_group_metadata_list):
            out = CompletionSequenceGroupOutput()
            if meta.do_sample and mi in num_drafts:
                m = num_drafts[mi]
                reads = {}
                for sid in sorted(meta.seq_data):
                    data = meta.seq_data[sid]
                    end = data.get_num_computed_tokens() + meta.token_chunk_size
                    reads[sid] = (
                        self._read_context(
                            meta.request_id, sid, data, meta.block_tables[sid], end, meta.lora_int_id
                        ),
                        end,
                    )
                # A group's sequences advance in lockstep: all emit as many as the one that
                # accepted fewest (as the real verifier does).
                a = min(self._num_accepted(read, m) for read, _ in reads.values())
                for sid, (read, end) in reads.items():
                    sample = self._verify(read, meta.block_tables[sid], end, m, a, sid, meta.lora_int_id)
                    out.samples.append(sample)
                    out.spec_num_draft_tokens += m
                    out.spec_num_accepted_tokens += a
            elif meta.do_sample:
                for sid in sorted(meta.seq_data):
                    data = meta.seq_data[sid]
                    end = data.get_num_computed_tokens() + meta.token_chunk_size
                    read = self._read_context(
                        meta.request_id, sid, data, meta.block_tables[sid], end, meta.lora_int_id
                    )
                    for i in range(max(1, meta.num_samples)):
                        out.samples.append(
                            SequenceOutput(
                                parent_seq_id=sid, output_token=self._sample(read, i), logprob=-1.0
                            )
                        )
            results.append(out)
        # -- time
        shape = step_shape(req)
        shape.verify_tokens = verify_tokens
        self.num_lora_adapter_steps += shape.loras
        self.num_scheduled_groups += len(req.seq_group_metadata_list)
        per_adapter: dict[int, int] = {}
        for meta in req.seq_group_metadata_list:
            if meta.lora_int_id > 0:
                per_adapter[meta.lora_int_id] = per_adapter.get(meta.lora_int_id, 0) + 1
        for n in per_adapter.values():
            self.lora_slot_steps[n] = self.lora_slot_steps.get(n, 0) + 1
        dt = self.cost_model.step_cost(shape)
        for attr in RANGED:
            self.largest[attr] = max(self.largest[attr], getattr(shape, attr))
        if self.cost_model.outside_range(shape):
            self.num_extrapolated_steps += 1
            self.extrapolated_time_s += dt
        if draft_steps and self.acceptance is not None:
            dt += draft_steps * self.acceptance.draft_step_s
        self.clock.advance(dt)
        self.busy_time_s += dt
        self.num_steps += 1
        return results

    def _next_read(self, read: list[int], end: int, token: int, lora_int_id: int = 0) -> list[int]:
        """The read-back key ``_read_context`` gives at ``end + 1`` once ``token`` sits at
        position ``end`` (what the next decode without speculation would hash)."""
        if not self.check_kv:
            return [end + 1, token] + ([lora_int_id] if lora_int_id else [])
        nxt = read + [kv_entry(token, lora_int_id)]
        if self.sliding_window is not None and end + 1 - self.sliding_window > read[0]:
            # the window moved one position: drop the oldest token, bump the start
            nxt = [read[0] + 1] + nxt[2:]
        return nxt

    def _num_accepted(self, read: list[int], m: int) -> int:
        """The acceptance model's count for a verification of ``m`` drafts after ``read``."""
        if self.acceptance is None:
            return 0
        return self.acceptance.num_accepted(_mix64(token_hash(read, _ACCEPT_SALT)) / float(1 << 64), m)

    def _verify(
        self, read: list[int], table: list[int], end: int, m: int, a: int, sid: int, lora_int_id: int = 0
    ) -> SequenceOutput:
        """A verification of ``m`` drafts, ``a`` of them accepted, for the sequence whose
        context up to ``end`` is ``read``: emit ``a + 1`` chain tokens and write the accepted
        drafts (and markers for the rejected ones) into the shadow cache."""
        tokens: list[int] = []
        for j in range(a + 1):
            tok = self._sample(read, 0)
            tokens.append(tok)
            if j < a:
                read = self._next_read(read, end + j, tok, lora_int_id)
        if self.check_kv:
            bs = self.block_size
            for j in range(m):  # draft j+1 sits at position end + j
                pos = end + j
                self._block(self.gpu, table[pos // bs])[pos % bs] = (
                    kv_entry(tokens[j], lora_int_id) if j < a else REJECTED_DRAFT
                )
        first, *rest = [SequenceOutput(parent_seq_id=sid, output_token=t, logprob=-1.0) for t in tokens]
        first.spec_tokens = rest
        first.num_draft_tokens = m
        first.num_accepted_tokens = a
        return first

    def _read_context(
        self, request_id: str, sid: int, data, table: list[int], end: int, lora_int_id: int = 0
    ) -> list[int]:
        """Slot contents (``kv_entry``) of positions [start, end) read back through the block
        table (start > 0 only with a sliding window), checked against the sequence's tokens
        under adapter ``lora_int_id`` when ``strict``."""
        toks = data.get_token_ids()
        if not self.check_kv:
            return [end, toks[end - 1]] + ([lora_int_id] if lora_int_id else [])
        bs = self.block_size
        start = 0 if self.sliding_window is None else max(0, end - self.sliding_window)
        read: list[int] = [start]
        for pos in range(start, end):
            blk = self.gpu.get(table[pos // bs])
            tok = None if blk is None else blk[pos % bs]
            if self.strict and tok != kv_entry(toks[pos], lora_int_id):
                raise KVCacheCorruption(
                    f"{request_id}/seq {sid}: position {pos} (block {table[pos // bs]}, slot "
                    f"{pos % bs}) holds {_describe_entry(tok)}, expected "
                    f"{_describe_entry(kv_entry(toks[pos], lora_int_id))}"
                )
            read.append(-1 if tok is None else tok)
        return read
