"""Sequences, sequence groups and the per-step metadata handed to the executor.

A *request* becomes one ``SequenceGroup``. It starts with a single ``Sequence`` holding the
prompt; when ``n > 1`` the first sampling step forks it into ``n`` sequences that share the
prompt's KV blocks (copy-on-write). All live sequences of a group advance in lockstep, so
they always have the same length.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvserve.lora_request import LoRARequest
from kvserve.sampling_params import SamplingParams


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's shape).

    ``logprob``: natural log of the model's probability; ``rank``: 1 for the most likely token
    at that position; ``decoded_token``: its text when known (else None).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per prompt position: None for the first token, then ``{token_id: Logprob}``.
PromptLogprobs = list[dict[int, Logprob] | None]


class SequenceStatus(enum.IntEnum):
    """Lifecycle of a sequence. Values above ``SWAPPED`` are terminal."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3  # EOS, stop string or stop token id
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # abort_request / client gone
    FINISHED_IGNORED = 6  # rejected by the scheduler (too long / can never fit)
    FINISHED_FAILED = 7  # the engine could not run it (a fault in its step; see group.error)

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status > SequenceStatus.SWAPPED

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        """OpenAI-style finish reason: ``stop``, ``length``, ``abort``, ``ignored`` or ``error``."""
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_IGNORED: "ignored",
            SequenceStatus.FINISHED_FAILED: "error",
        }.get(status)


class SequenceStage(enum.Enum):
    PREFILL = enum.auto()
    DECODE = enum.auto()


class SequenceData:
    """Token ids of one sequence and how many of them have their KV in the cache.

    ``num_computed_tokens`` counts tokens whose K/V have been written to the cache (or
    found there by prefix caching). The tokens to feed next are
    ``get_token_ids()[num_computed_tokens : num_computed_tokens + chunk]``. Recompute
    preemption resets it to 0: the re-prefill covers prompt + outputs, but outputs stay
    outputs (they are never moved into the prompt).
    """

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None):
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL
        self.cumulative_logprob = 0.0
        #: Recompute preemptions so far: each freed every block of the sequence, so state kept
        #: about its K/V elsewhere (the draft model's) is void once this changes.
        self.num_recomputes = 0

    def append_token_id(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_at(self, i: int) -> int:
        """``get_token_ids()[i]`` for ``0 <= i < get_len()``."""
        p = len(self.prompt_token_ids)
        return self.output_token_ids[i - p] if i >= p else self.prompt_token_ids[i]

    def token_range(self, lo: int, hi: int) -> list[int]:
        """``get_token_ids()[lo:hi]`` for ``0 <= lo``, without concatenating the prompt and
        output lists."""
        prompt, out = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        if hi <= lo:  # empty, like the slice (and no negative index into the outputs)
            return []
        if lo >= p:
            return out[lo - p : hi - p]
        if hi <= p:
            return prompt[lo:hi]
        return prompt[lo:] + out[: hi - p]

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """Record that ``num_new_computed_tokens`` more tokens now have K/V in the cache."""
        self._num_computed_tokens += num_new_computed_tokens
        assert self._num_computed_tokens <= self.get_len(), (self._num_computed_tokens, self.get_len())
        if self.get_num_uncomputed_tokens() == 0:
            self._stage = SequenceStage.DECODE

    def set_num_computed_tokens(self, num: int) -> None:
        """Set the computed count directly (prefix-cache hit at allocation)."""
        assert 0 <= num <= self.get_len()
        self._num_computed_tokens = num

    def reset_state_for_recompute(self) -> None:
        """Forget the cached K/V (recompute preemption): everything gets prefilled again."""
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL
        self.num_recomputes += 1

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self._num_computed_tokens

    @property
    def stage(self) -> SequenceStage:
        return self._stage

    def copy(self) -> SequenceData:
        new = SequenceData(self.prompt_token_ids, self.output_token_ids)
        new._num_computed_tokens = self._num_computed_tokens
        new._stage = self._stage
        new.cumulative_logprob = self.cumulative_logprob
        new.num_recomputes = self.num_recomputes
        return new


class Sequence:
    """One sample of a request: its tokens, status, and detokenization state.

    ``block_size`` is in tokens; ``n_blocks`` is how many KV blocks its tokens span.
    ``lora_int_id`` is the adapter its K/V are computed with (0 = the base model; set from
    the group, with ``lora_request``, None for the base model or a sequence outside a group):
    the prefix cache keys its blocks by both. ``kv_salt`` is anything else its K/V depend on
    beyond tokens and adapter (a LongRoPE model's long prompts: ``LLMEngine.long_prompt_after``),
    None when nothing: the prefix cache keys by it too.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        block_size: int,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        lora_int_id: int = 0,
    ):
        self.seq_id = seq_id
        self.data = SequenceData(prompt_token_ids)
        self.lora_int_id = lora_int_id
        self.lora_request: LoRARequest | None = None
        self.kv_salt: Hashable | None = None
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.prompt = prompt
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # matched stop string or stop token id
        # Incremental detokenization state (owned by the engine's detokenizer); a fork starts
        # a fresh stream primed with the tokens so far.
        self.output_text = ""
        self.decode_stream: Any = None  # tokenizers.decoders.DecodeStream, made on first decode
        # Per generated token: {token_id: logprob} (sampled token included) when requested.
        self.output_logprobs: list[dict[int, Logprob]] = []

    # -- lengths -----------------------------------------------------------------
    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    @property
    def n_blocks(self) -> int:
        return (self.get_len() + self.block_size - 1) // self.block_size

    def append_token_id(
        self, token_id: int, logprob: float = 0.0, top_logprobs: dict[int, Logprob] | None = None
    ) -> None:
        self.data.append_token_id(token_id, logprob)
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self.status)

    def is_prefill(self) -> bool:
        return self.data.stage == SequenceStage.PREFILL

    def fork(self, new_seq_id: int) -> Sequence:
        """A child with the same tokens and text so far (shares KV via ``block_manager.fork``)."""
        child = Sequence(
            new_seq_id,
            self.data.prompt_token_ids,
            self.block_size,
            self.eos_token_id,
            self.prompt,
            lora_int_id=self.lora_int_id,
        )
        child.lora_request = self.lora_request
        child.kv_salt = self.kv_salt
        child.data = self.data.copy()
        child.status = self.status
        child.output_text = self.output_text
        child.output_logprobs = list(self.output_logprobs)
        return child

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


#: Preemption records kept per request: the first ones (``num_preemptions`` counts them all).
MAX_PREEMPTION_RECORDS = 16


@dataclass(frozen=True)
class PreemptionRecord:
    """One preemption of a request.

    Attributes:
        time: when it was preempted (seconds, the engine's clock).
        mode: ``"recompute"`` or ``"swap"`` (the mode used, after any fallback).
        num_recomputed_tokens: recompute: tokens whose computed KV it dropped, summed over the
            live sequences (they are prefilled again; the prefix cache may serve some back);
            0 for a swap.
        num_swapped_blocks: swap: distinct device blocks copied out to host memory (and back
            in when it resumes); 0 for a recompute.
    """

    time: float
    mode: str
    num_recomputed_tokens: int = 0
    num_swapped_blocks: int = 0


@dataclass
class RequestMetrics:
    """Wall-clock (or virtual-clock, in the simulator) timestamps of a request, in seconds.

    TTFT = first_token_time - arrival_time; queue time = first_scheduled_time - arrival_time;
    TPOT = (finished_time - first_token_time) / (output tokens - 1). ``preemptions``: the
    first ``MAX_PREEMPTION_RECORDS`` records of its preemptions (``num_preemptions`` counts
    them all).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    preemptions: list[PreemptionRecord] = field(default_factory=list)

    def add_preemption(self, record: PreemptionRecord, count: bool = True) -> None:
        """Keep ``record`` while fewer than ``MAX_PREEMPTION_RECORDS`` are, and count it as a
        preemption unless ``count`` is False (a swapped request turned into a recomputed one:
        one preemption, two records)."""
        if count:
            self.num_preemptions += 1
        if len(self.preemptions) < MAX_PREEMPTION_RECORDS:
            self.preemptions.append(record)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


_seq_counter = itertools.count()


def next_seq_id() -> int:
    """Process-wide unique sequence id."""
    return next(_seq_counter)


class SequenceGroup:
    """All sequences of one request plus its sampling params, metrics and RNG state.

    Attributes:
        request_id: caller's id (unique among live requests).
        seqs_dict: seq_id -> Sequence (1 until the first sample; then ``n``).
        priority: integer, lower value is served first under the ``priority`` policy.
        generator: a ``torch.Generator`` when ``sampling_params.seed`` is set (created by
            the engine; the scheduler never touches it).
        lora_request: the LoRA adapter the request runs with (None = the base model); its
            sequences get its ``lora_int_id``.
        tenant: who the request is served for (the OpenAI ``user`` field, ``LLM.generate``'s
            ``tenant``); the ``fair`` policy shares service between tenants. None = the one
            shared default tenant.
    """

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ):
        self.request_id = request_id
        self.lora_request = lora_request
        self.tenant = tenant
        for seq in seqs:
            seq.lora_int_id = self.lora_int_id
            seq.lora_request = lora_request
        self.seqs_dict: dict[int, Sequence] = {s.seq_id: s for s in seqs}
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.priority = priority
        self.generator: Any = None  # torch.Generator when sampling_params.seed is set
        # Set when the scheduler ignores the group: a message naming the length and the limit.
        self.ignored_reason: str | None = None
        # Set when the engine ends the group because its step failed (FINISHED_FAILED).
        self.error: str | None = None
        # Prompt tokens found in the prefix cache at the first admission (None before it).
        self.num_cached_tokens: int | None = None
        # True once the initial single sequence has been forked into ``n`` samples.
        self.forked = sampling_params.n == 1
        # Prompt logprobs collected so far (``sampling_params.prompt_logprobs``): entry ``i`` is
        # prompt token ``i``'s; filled chunk by chunk, complete at ``len == prompt length``.
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        # Speculative decoding: drafted / accepted tokens over the request's life, and whether
        # it speculates not now (set by the engine while its acceptance is low: see
        # LLMEngine._account_speculation). The scheduler reserves no lookahead slots for a
        # disabled group.
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        # decode steps it had lookahead slots in but verified no drafts (skipped by reason in
        # EngineStats.spec_skipped_by_reason)
        self.spec_num_skipped_steps = 0
        self.spec_decode_disabled = False
        # The low-acceptance rule's state: drafted / accepted in the current window, pauses
        # so far, and the output length at which the current pause ends.
        self.spec_window_draft_tokens = 0
        self.spec_window_accepted_tokens = 0
        self.spec_num_pauses = 0
        self.spec_resume_at: int | None = None
        # Set for a pooling request (``kvserve.pooling_params.PoolingParams``): prefill only,
        # it ends with its vector in the step that computes its prompt.
        self.pooling_params: Any = None

    # -- queries -------------------------------------------------------------------
    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 when the request runs the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).data.prompt_token_ids

    @property
    def prompt(self) -> str | None:
        return next(iter(self.seqs_dict.values())).prompt

    def prompt_logits_needed_from(self) -> int | None:
        """The first prompt position whose logits are still needed for prompt logprobs (position
        ``p`` scores prompt token ``p + 1``), or None when none are asked for or all are in.

        The block manager reuses no prefix-cache blocks at or past this position, so those
        positions are computed (a cache hit has no logits)."""
        pl = self.prompt_logprobs
        if pl is None or len(pl) >= len(self.prompt_token_ids):
            return None
        return len(pl) - 1

    def add_prompt_logprobs(self, start: int, entries: list[dict[int, Logprob]]) -> None:
        """Record the prompt logprobs of prompt tokens ``start ..`` (entries already held,
        e.g. recomputed after a preemption, are skipped)."""
        pl = self.prompt_logprobs
        if pl is None:
            return
        for i, entry in enumerate(entries, start):
            if i == len(pl):
                pl.append(entry)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [s for s in self.seqs_dict.values() if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs_dict.values() if not s.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs_dict.values())

    def is_prefill(self) -> bool:
        """True while the live sequences still have prompt (or recompute) tokens to compute."""
        return any(s.is_prefill() for s in self.get_unfinished_seqs())

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this group will have running at once (for the seq budget)."""
        if not self.forked:
            return self.sampling_params.n
        return self.num_unfinished_seqs()

    def get_num_uncomputed_tokens(self) -> int:
        """Tokens still to prefill, summed over live sequences."""
        return sum(s.data.get_num_uncomputed_tokens() for s in self.get_unfinished_seqs())

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """Per live sequence (all live sequences advance by the same chunk)."""
        for s in self.get_unfinished_seqs():
            s.data.update_num_computed_tokens(num_new_computed_tokens)

    def add(self, seq: Sequence) -> None:
        seq.lora_int_id = self.lora_int_id
        seq.lora_request = self.lora_request
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        del self.seqs_dict[seq_id]

    def maybe_set_first_scheduled_time(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, seqs={list(self.seqs_dict.values())})"


@dataclass
class SequenceGroupMetadata:
    """What the executor needs to run one scheduled group for one step.

    For each sequence in ``seq_data`` the tokens fed are
    ``seq_data[id].get_token_ids()[c : c + token_chunk_size]`` with
    ``c = seq_data[id].get_num_computed_tokens()``; their positions are ``c ..``; their K/V go
    to the slots given by ``block_tables[id]`` (block numbers, ``block_size`` tokens each) and
    attention reads positions ``0 .. c + token_chunk_size - 1`` through the same table.

    ``do_sample`` is False for a prefill chunk that does not reach the end of the sequence.
    With ``prompt_logprobs_from`` set, the executor also returns the prompt logprobs of the
    chunk's positions ``>= prompt_logprobs_from`` (``CompletionSequenceGroupOutput``).
    When ``is_prompt`` and the group has not been forked yet (``num_samples > 1``), the single
    sequence's last-position logits are sampled ``num_samples`` times.

    ``token_bitmask`` is set by the engine (never the scheduler) for a group under a
    structured-output constraint: an object whose ``rows()`` gives the int32 bitmask
    ``[len(seq_data), ceil(vocab / 32)]`` of the tokens each sequence may sample next, and
    whose ``verify_masks(drafts)`` gives the masks of a speculative verify chunk.

    ``lora_request`` (set by the scheduler from the group) is the adapter every sequence of the
    group runs with; None = the base model.
    """

    request_id: str
    is_prompt: bool
    seq_data: dict[int, SequenceData]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int
    do_sample: bool = True
    num_samples: int = 1
    generator: Any = None
    computed_block_nums: list[int] | None = None
    # First prompt position whose logits the executor must turn into prompt logprobs
    # (``SequenceGroup.prompt_logits_needed_from``); None: none.
    prompt_logprobs_from: int | None = None
    token_bitmask: Any = None
    # Speculative decoding: lookahead slots the scheduler reserved for this decode, i.e. the
    # most tokens that may be proposed and verified for each of its sequences this step
    # (0 = plain decode). Positions ``len - 1 .. len - 1 + num_speculative_tokens`` have slots.
    num_speculative_tokens: int = 0
    lora_request: LoRARequest | None = None
    # A pooling group's ``PoolingParams`` (its ``token_type_ids`` reach the encoder); None else.
    pooling_params: Any = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 without one."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0


@dataclass
class SequenceOutput:
    """One sampled token for one sequence: ``parent_seq_id`` is the sequence it extends.

    Speculative decoding (a verified step) emits several tokens for one sequence: this object
    carries the first (``output_token``, ``logprob``, ``top_logprobs``) and ``spec_tokens`` the
    ones after it, in order, each a ``SequenceOutput`` with the same ``parent_seq_id`` and an
    empty ``spec_tokens``. Emitted tokens = ``[self] + spec_tokens``: the accepted drafts, then
    the target's own token (the correction of the first rejected draft, or the bonus token
    when all were accepted), so ``len(spec_tokens) == num_accepted_tokens``. (The samples of an
    ``n > 1`` group stay in lockstep: each is cut to the group's shortest run, so its last token
    may be an accepted draft; ``num_accepted_tokens`` counts what it emits.)
    ``num_draft_tokens``: drafts verified for this sequence this step (0 = not speculated);
    ``num_accepted_tokens``: how many of them the verifier accepted (a prefix). The engine
    appends them one by one and stops at the first that ends the sequence (nothing after a
    stop is emitted), then rolls ``num_computed_tokens`` back to the last accepted position.
    """

    parent_seq_id: int
    output_token: int
    logprob: float = 0.0
    top_logprobs: dict[int, Logprob] | None = None
    spec_tokens: list[SequenceOutput] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def emitted(self) -> list[SequenceOutput]:
        """All tokens this output emits, in order (``[self] + spec_tokens``)."""
        return [self, *self.spec_tokens] if self.spec_tokens else [self]


@dataclass
class CompletionSequenceGroupOutput:
    """Samples of one scheduled group in one step (empty when ``do_sample`` was False), and
    the prompt logprobs of prompt tokens ``prompt_logprobs_start ..`` computed this step.

    ``spec_num_draft_tokens`` / ``spec_num_accepted_tokens``: the step's drafted and accepted
    tokens summed over the group's samples (0 / 0 when it did not speculate).
    ``spec_num_eligible_seqs``: the group's sequences that had lookahead slots this step
    (could have been given drafts), 0 when it had none; ``spec_skipped``: of those, the ones
    that verified no drafts, by reason (``SpecDecodeWorker._skip_reason``).
    ``error``: set (no samples) when the group's step cannot be used, e.g. its logits held a
    NaN or an infinity; the engine ends the group ``failed`` with this reason."""

    samples: list[SequenceOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs_start: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_eligible_seqs: int = 0
    spec_skipped: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    #: a pooling group's vector (float32 tensor ``[dim]``), set instead of samples
    pooled: Any = None


class BlockMoveError(RuntimeError):
    """Raised by an executor when applying a step's swaps or copies failed (before any
    forward): the engine then cannot tell which KV blocks hold what."""


@dataclass
class ExecuteModelRequest:
    """One step of work for the executor.

    ``blocks_to_swap_in``: CPU block -> GPU block; ``blocks_to_swap_out``: GPU -> CPU;
    ``blocks_to_copy``: source GPU block -> destination GPU blocks. Apply swap-out, then
    swap-in, then copy, then run the forward.
    """

    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0
