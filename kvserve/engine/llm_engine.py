"""The synchronous engine: one ``step()`` is one iteration of continuous batching."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvserve.config import (
    CacheConfig,
    EngineArgs,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.fault_isolation import RequestFault, bisect_failures
from kvserve.engine.input_processor import (
    PromptType,
    bad_words_token_ids,
    tokenize_prompt,
    truncate_prompt,
    validate_request,
)
from kvserve.engine.kv_capacity import KVCapacity
from kvserve.engine.metrics import EngineStats
from kvserve.engine.stop_checker import StopChecker, max_stop_len
from kvserve.field_limits import LIMITS, check_tenant
from kvserve.lora_request import LoRARequest
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.sequence import (
    BlockMoveError,
    CompletionSequenceGroupOutput,
    ExecuteModelRequest,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
    next_seq_id,
)

if TYPE_CHECKING:
    from kvserve.core.scheduler import SchedulerOutputs
    from kvserve.structured_output import StructuredOutputManager

logger = logging.getLogger("kvserve.engine")


class _ShutDownExecutor:
    """What ``LLMEngine.executor`` is after ``shutdown``: every use but ``shutdown`` raises."""

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str):
        raise RuntimeError(f"the engine was shut down (executor.{name} is gone)")


class EngineSleepingError(RuntimeError):
    """A request reached an engine in sleep mode's sleep (``LLMEngine.sleep``): it is refused,
    not queued, until ``wake_up``."""


class RequestsInFlightError(ValueError):
    """``LLMEngine.sleep`` while requests are in flight (their KV cache would be lost)."""


#: What ``LLMEngine.wake_up`` can bring back separately (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")


def load_generation_defaults(args: EngineArgs, model_dir) -> dict[str, Any]:
    """The default sampling parameters of ``args.generation_config`` for the model in
    ``model_dir`` (``transformers_utils.generation_config.generation_defaults``), logged once
    with the file they come from.

    Raises:
        ValueError: a bad ``generation_config`` setting, file or value (naming it).
    """
    from kvserve.transformers_utils.generation_config import generation_defaults

    defaults, path = generation_defaults(args.generation_config, model_dir, args.generation_overrides())
    if defaults:
        logger.info(
            "default sampling parameters (requests that leave them out): %s, from %s",
            ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
            path or "override_generation_config",
        )
    elif args.generation_config != "vllm":
        logger.info("default sampling parameters: kvserve's own (the model has no generation_config.json)")
    return defaults


def _output_len(group: SequenceGroup) -> int:
    """Tokens the group has generated (its samples advance together under speculation)."""
    return max((seq.get_output_len() for seq in group.get_seqs()), default=0)


def _is_grammar_error(e: BaseException) -> bool:
    """A constrained request's matcher failed (``structured_output.GrammarError``)."""
    from kvserve.structured_output.manager import GrammarError

    return isinstance(e, GrammarError)


class LLMEngine:
    """Continuous-batching engine: a ``Scheduler`` plus an executor (real model or simulator).

    Data flow per ``step()`` (see DESIGN.md): ``Scheduler.schedule()`` -> executor swaps /
    copies blocks and runs one forward over all scheduled tokens and samples -> the engine
    appends tokens (forking ``n > 1`` groups after their first sample), detokenizes, checks
    stop conditions, frees finished sequences and returns ``RequestOutput``s.

    Args:
        executor: object with ``execute_model(ExecuteModelRequest) ->
            List[CompletionSequenceGroupOutput]`` (``kvserve.worker.worker.Worker`` or
            ``kvserve.sim.executor.SimulatedExecutor``).
        tokenizer: a transformers tokenizer, or None (token ids only; text stays "").
        clock: seconds; ``time.time`` for real runs, the simulator's virtual clock otherwise.
        vocab_size: for validating token ids (None = no check).
        eos_token_id: the model's end-of-sequence id (None = no EOS).
        speculative_config: speculative decoding settings (the executor verifies; the engine
            appends every emitted token, counts drafts and switches a request's speculation
            off when its acceptance stays low), or None.
        lora_config: multi-LoRA limits when LoRA is enabled (the executor then has
            ``add_lora`` / ``remove_lora`` / ``list_loras``), or None.
        enable_sleep_mode: allow ``sleep`` / ``wake_up`` (the executor then has ``sleep(level)``
            and ``wake_up(tags)``).
        preemption_cost: the scheduler's price of recompute against swap under
            ``--preemption-mode auto`` (``kvserve.core.preemption.PreemptionCost``; the
            simulator passes its cost model's), or None: the built-in default.
        pooler_config: set for a pooling engine (``kvserve.engine.pooling``): it takes
            ``PoolingParams`` requests only, and ends each with its vector
            (``RequestOutput.pooled``) in the step that runs its prompt; None: generation.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        executor,
        tokenizer=None,
        clock: Callable[[], float] = time.time,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        generation_defaults: dict[str, Any] | None = None,
        long_prompt_after: int | None = None,
        enable_sleep_mode: bool = False,
        preemption_cost=None,
        pooler_config=None,
    ):
        from kvserve.core.scheduler import Scheduler

        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.executor = executor
        self.tokenizer = tokenizer
        # ids at or past it decode to nothing (``validate_request``: logit_bias keys)
        self.tokenizer_size = len(tokenizer) if tokenizer is not None else None
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.speculative_config = speculative_config
        self.lora_config = lora_config
        #: SamplingParams fields a request takes when it leaves them out (the model's
        #: generation_config.json: ``EngineArgs.generation_config``)
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})
        #: LongRoPE models: prompts longer than this get K/V rotated with the long factors from
        #: their first token (``RotaryEmbedding``), so their blocks are salted apart in the
        #: prefix cache (``Sequence.kv_salt``); None for other models.
        self.long_prompt_after = long_prompt_after
        self.enable_sleep_mode = enable_sleep_mode
        #: Sleep mode: the parts put away (``SLEEP_TAGS`` members; empty while awake) and the
        #: level of the last ``sleep``.
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self.scheduler = Scheduler(
            scheduler_config, cache_config, lora_config, clock=clock, preemption_cost=preemption_cost
        )
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stop_checker = StopChecker(scheduler_config.max_model_len)
        self.stats = EngineStats()
        # request_id -> live group; request_id -> effective max_tokens. Emptied as requests end.
        self._groups: dict[str, SequenceGroup] = {}
        self._max_tokens: dict[str, int] = {}
        # request_id -> the n its caller asked for, when it samples best_of > n sequences
        self._return_n: dict[str, int] = {}
        # seq_id -> (characters, tokens) of its completion already returned (DELTA outputs)
        self._delta_sent: dict[int, tuple[int, int]] = {}
        # lora_int_id -> [the LoRARequest its live groups run with, how many]: an id may be
        # read again from its path once evicted, so a request giving it another adapter
        # would change (or fail) the ones already queued with it
        self._live_loras: dict[int, list] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._structured: StructuredOutputManager | None = None
        self._structured_lock = threading.Lock()  # the server compiles on a worker thread
        self.pooler_config = pooler_config
        #: ``"pooling"`` (embeddings, scores) or ``"generate"``: the requests it takes
        self.runner = "generate" if pooler_config is None else "pooling"
        if tokenizer is not None and executor is not None and pooler_config is None:
            # The grammar engine's tokenizer view, built on a background thread now rather than
            # by the first constrained request (which would stall the requests behind it). Not
            # on a data-parallel front engine (no executor): its replicas compile.
            self.structured_output.compiler.warm_up()

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler and per-sequence matchers (built on first use: the grammar
        engine's tokenizer view walks the whole vocabulary).

        Raises:
            ValueError: the engine has no tokenizer (token ids only).
        """
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine has none.")
            from kvserve.structured_output import GrammarCompiler, StructuredOutputManager

            with self._structured_lock:
                if self._structured is None:
                    vocab = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
                    self._structured = StructuredOutputManager(
                        GrammarCompiler(self.tokenizer, vocab, self.eos_token_id)
                    )
        return self._structured

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model named by ``args.model`` (default: SmolLM2-135M-Instruct) and build
        the engine. Raises ValueError for an unknown path, a directory without weights, or an
        invalid setting."""
        from kvserve.core.policy import PolicyFactory
        from kvserve.model_executor.config_checks import context_length, read_hf_config
        from kvserve.model_executor.layers.rotary_embedding import get_rope_parameters, longrope_threshold
        from kvserve.model_executor.model_loader import gguf_file_for, resolve_model_dir
        from kvserve.ops import quant
        from kvserve.transformers_utils.hf_config import get_sliding_window
        from kvserve.transformers_utils.tokenizer import load_tokenizer, tokenizer_overflow
        from kvserve.worker.worker import Worker

        # a .gguf runs its own blocks unless the settings need float weights (see there)
        quantization, gguf_float_reason = args.resolve_quantization(quant.available())
        if gguf_float_reason is not None:  # said before a first conversion, which takes a while
            dtype = ModelConfig(dtype=args.dtype, device=args.device).resolved_dtype()
            logger.info(
                "GGUF weights: dequantized to %s (because %s)",
                str(dtype).removeprefix("torch."),
                gguf_float_reason,
            )
        model_dir = resolve_model_dir(args.model, quantization)
        hf_config = read_hf_config(model_dir)  # refuses impossible values, naming the field
        from kvserve.model_executor.model_loader import check_architecture, check_fallback_settings

        check_architecture(hf_config, args.model_impl, model_dir)  # (before reading its limits)
        from kvserve.engine.pooling import build_pooling_engine, resolve_runner

        if resolve_runner(args, hf_config, str(model_dir)) == "pooling":
            return build_pooling_engine(cls, args, model_dir, hf_config)  # samples nothing
        generation_defaults = load_generation_defaults(args, model_dir)  # a bad file fails before the load
        if args.quantization == "none":
            from kvserve.model_executor.quantized_checkpoint import quant_method_of

            method = quant_method_of(hf_config)
            if method is not None:
                raise ValueError(
                    f"quantization='none' asks for float weights, but the checkpoint in {str(model_dir)!r} "
                    f"is quantized (quant_method {method!r}); leave quantization unset to run it."
                )
        # a window every layer uses, else None (Qwen2's unused window, or layers that differ:
        # the block manager must then keep every block for the global layers)
        sliding_window = get_sliding_window(hf_config)
        model_config, cache_config, scheduler_config = args.create_configs(
            context_length(hf_config, model_dir), sliding_window
        )
        PolicyFactory.from_config(scheduler_config)  # a bad policy setting fails before the load
        model_config.quantization = quantization
        # quantized GGUF: the weights stay in the file (model_dir holds config and tokenizer)
        model_config.model = str(gguf_file_for(args.model)) if quantization == "gguf" else str(model_dir)
        spec_config = args.create_speculative_config()
        parallel_config = args.create_parallel_config()
        # the transformers fallback's limits, before the parallel checks read native-only fields
        check_fallback_settings(
            hf_config,
            args.model_impl,
            model_dir,
            quantization,
            tensor_parallel_size=parallel_config.tensor_parallel_size,
            enable_lora=args.enable_lora,
        )
        parallel_config.verify_with_model(
            hf_config, model_config.resolved_device(), quantization=quantization
        )
        lora_config = args.create_lora_config()
        worker = Worker(
            model_config, cache_config, scheduler_config, parallel_config, lora_config=lora_config
        )
        if quantization == "gguf":
            from kvserve.model_executor.model_loader import quantized_weight_types

            types = ", ".join(
                f"{t}: {n} weight{'s' if n > 1 else ''}"
                for t, n in quantized_weight_types(worker.model).items()
            )
            logger.info(
                "GGUF weights: running the file's quantized blocks (%s) from %s",
                types or "none of its weights is of a quantized type",
                model_config.model,
            )
        try:
            num_gpu_blocks, num_cpu_blocks = worker.determine_num_blocks()
            cache_config.num_gpu_blocks, cache_config.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
            cache_config.resolve_kv_offload_blocks(worker.bytes_per_block())
            worker.init_cache(num_gpu_blocks, cache_config.num_host_blocks())
            logger.info(
                "KV cache: %d blocks of %d tokens (%d tokens, %s, %d bytes a block), %d host blocks",
                num_gpu_blocks,
                cache_config.block_size,
                num_gpu_blocks * cache_config.block_size,
                cache_config.cache_dtype
                if cache_config.cache_dtype != "auto"
                else str(worker.dtype).removeprefix("torch."),
                worker.bytes_per_block(),
                cache_config.num_host_blocks(),
            )
            if cache_config.kv_offload_dir is not None:
                worker.open_disk_tier(
                    cache_config.kv_offload_dir, int(cache_config.kv_offload_disk_gib * 2**30)
                )
            worker.warm_up()
        except BaseException:
            worker.shutdown()  # tensor-parallel peers must not outlive a failed start
            raise
        executor: Any = worker
        if spec_config is not None:
            from kvserve.spec_decode.spec_decode_worker import SpecDecodeWorker, build_proposer

            executor = SpecDecodeWorker(worker, build_proposer(spec_config, worker), spec_config)
        tokenizer = load_tokenizer(model_dir)
        overflow = tokenizer_overflow(tokenizer, hf_config, model_dir)
        if overflow is not None:
            logger.warning("%s", overflow)
        eos = hf_config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            eos = tokenizer.eos_token_id
        engine = cls(
            model_config,
            cache_config,
            scheduler_config,
            executor=executor,
            tokenizer=tokenizer,
            vocab_size=hf_config.vocab_size,
            eos_token_id=eos,
            speculative_config=spec_config,
            lora_config=lora_config,
            generation_defaults=generation_defaults,
            long_prompt_after=longrope_threshold(get_rope_parameters(hf_config)),
            enable_sleep_mode=args.enable_sleep_mode,
        )
        if cache_config.kv_offload_dir is not None:
            engine._warm_disk_tier()
        return engine

    def _warm_disk_tier(self) -> None:
        """Fill the host tier from the disk tier's files (most recently used first, as many
        as the tier holds)."""
        bm = self.scheduler.block_manager
        keys = self.executor.read_disk_tier(bm.host_tier_blocks)
        placed = bm.adopt_tier_blocks(keys)
        self.executor.fill_host_blocks(placed)
        logger.info("disk tier: %d of %d valid block files entered the host tier", len(placed), len(keys))

    def _save_new_tier_blocks(self) -> None:
        """Hand blocks that entered the host tier to the disk tier, before the next block moves
        can overwrite them."""
        if self.cache_config.kv_offload_dir is None:
            return
        blocks = self.scheduler.block_manager.take_new_tier_blocks()
        if blocks:
            self.executor.save_host_blocks(blocks)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> None:
        """Validate and queue a request (it joins ``waiting``).

        ``lora_request``: the adapter it runs with (None: the base model); an adapter not
        loaded yet is loaded and validated here, so a bad one fails this call only.
        ``tenant``: who it is served for (``SequenceGroup.tenant``; the ``fair`` policy shares
        service between tenants); None (or "") = the shared default tenant.
        ``params``: ``SamplingParams`` on a generation engine, ``PoolingParams`` on a pooling
        one (``runner``); the other kind is refused.

        Raises:
            ValueError: duplicate live request id, empty prompt, token ids outside the vocab,
                ``n > max_num_seqs``, prompt + max_tokens > max_model_len (see
                ``validate_request``), a ``structured_outputs`` constraint that does not
                compile (naming its field), a ``lora_request`` that is not a ``LoRARequest``, given
                while LoRA is off, whose adapter does not load (naming the path or the limit),
                or whose ``lora_int_id`` live requests use with another name or path;
                a ``tenant`` that is not a string of at most ``MAX_TENANT_CHARS`` characters.
                Nothing is queued when it raises.
            RuntimeError: the engine was shut down.
            EngineSleepingError: the engine is asleep (``sleep``).
        """
        if isinstance(self.executor, _ShutDownExecutor):
            raise RuntimeError("the engine was shut down; it takes no new requests")
        if self.asleep:
            raise EngineSleepingError(self._sleeping_message())
        if lora_request is not None:
            self._check_lora_request(lora_request)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request.")
        if self.runner == "pooling" or isinstance(params, PoolingParams):
            if self.runner != "pooling":
                raise ValueError(
                    "this model is a generation model: it takes no pooling (embedding, score) "
                    "requests; start it with runner='pooling' to serve embeddings."
                )
            if not isinstance(params, PoolingParams):
                raise ValueError(
                    "this model is a pooling model (runner='pooling'): it serves embeddings and "
                    f"scores, not text generation (got {type(params).__name__})."
                )
            LIMITS["priority"].check("priority", priority)
            check_tenant("tenant", tenant)
            from kvserve.engine.pooling import add_pooling_request

            return add_pooling_request(self, request_id, prompt, params, arrival_time, priority, tenant)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}.")
        LIMITS["priority"].check("priority", priority)
        check_tenant("tenant", tenant)
        tenant = tenant or None  # an empty name is no name: the shared default tenant
        text, prompt_ids = tokenize_prompt(prompt, self.tokenizer)
        prompt_ids = truncate_prompt(prompt_ids, params, self.scheduler_config.max_model_len)
        max_tokens = self.validate(prompt_ids, params)
        return_n = None
        if params.best_of is not None and params.best_of > params.n:
            # best_of sequences run as an n = best_of request; the n best are returned
            return_n = params.n
            tokenized = params.bad_words_token_ids
            params = dataclasses.replace(params, n=params.best_of, best_of=None)
            params.bad_words_token_ids = tokenized
        if lora_request is not None:
            self._check_lora_id(lora_request)
            self.executor.add_lora(lora_request)  # checked above
        seq = Sequence(
            next_seq_id(),
            prompt_ids,
            self.cache_config.block_size,
            eos_token_id=self.eos_token_id,
            prompt=text,
        )
        if self.long_prompt_after is not None and len(prompt_ids) > self.long_prompt_after:
            seq.kv_salt = ("longrope", "long")
        if params.structured_outputs is not None:
            # Compiled here, on the caller's thread (the server compiles before queueing, so
            # this is a cache hit), never inside a step.
            self.structured_output.add_sequence(seq.seq_id, params.structured_outputs)
        group = SequenceGroup(
            request_id,
            [seq],
            params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            lora_request=lora_request,
            tenant=tenant,
        )
        if params.seed is not None:
            import torch

            group.generator = torch.Generator(device=self._device()).manual_seed(params.seed)
        self._groups[request_id] = group
        self._max_tokens[request_id] = max_tokens
        if return_n is not None:
            self._return_n[request_id] = return_n
        if lora_request is not None:
            self._live_loras.setdefault(lora_request.lora_int_id, [lora_request, 0])[1] += 1
        self.stats.on_request_added(len(prompt_ids))
        self.scheduler.add_seq_group(group)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (validated) so requests can use it; False if it was loaded already.

        Raises:
            ValueError: LoRA is not enabled, ``lora_request`` is not a ``LoRARequest``, the
                adapter is invalid (a missing file names the path, a too large rank
                ``max_lora_rank``), or live requests use its ``lora_int_id`` with another
                name or path.
        """
        self._check_lora_request(lora_request)
        self._check_lora_id(lora_request)
        return bool(self.executor.add_lora(lora_request))

    def _check_lora_request(self, lora_request) -> None:
        """Raises ValueError unless ``lora_request`` is a ``LoRARequest`` and LoRA is enabled."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if self.lora_config is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} given but LoRA is not enabled "
                "(start the engine with enable_lora=True, --enable-lora)."
            )

    def _check_lora_id(self, lora_request: LoRARequest) -> None:
        """Raises ValueError when live requests run with ``lora_request.lora_int_id`` under
        another name or path (the adapter cache alone cannot tell once it evicted the id)."""
        live = self._live_loras.get(lora_request.lora_int_id)
        if live is not None and live[0] != lora_request:
            known, n = live
            raise ValueError(
                f"lora_request.lora_int_id={lora_request.lora_int_id} is in use by {n} live "
                f"request(s) with {known.lora_name!r} from {known.lora_path!r}; use another id "
                f"for {lora_request.lora_name!r} ({lora_request.lora_path!r})."
            )

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if it was not loaded. (A live request using it reloads it
        from its path when it is next scheduled.) Raises ValueError when LoRA is off."""
        if self.lora_config is None:
            raise ValueError("LoRA is not enabled (enable_lora=False).")
        return bool(self.executor.remove_lora(lora_int_id))

    def list_loras(self) -> set[int]:
        """Ids of the loaded adapters (empty when LoRA is off)."""
        if self.lora_config is None:
            return set()
        return set(self.executor.list_loras())

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort live requests (any queue). Their blocks are freed at once; one final output
        per request, with ``finish_reason="abort"``, is returned by the next ``step()``.
        Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort_seq_group(ids):
            self._pending_outputs.append(self._finish_request(group))

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        """Whether some part (weights, KV cache) is put away: requests are refused."""
        return bool(self.asleep)

    def _sleeping_message(self) -> str:
        return (
            f"the engine is asleep (sleep mode, level {self.sleep_level}; "
            f"{' and '.join(sorted(self.asleep))} put away): wake it up first (POST /wake_up, LLM.wake_up())."
        )

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep while idle: the prefix cache is emptied and the executor
        frees the KV cache; level 1 offloads the weights to host memory (on CPU they already
        are there and stay), level 2 drops them (``wake_up`` reads them from the checkpoint
        again). New requests are refused (``EngineSleepingError``) until ``wake_up``.

        Raises:
            ValueError: sleep mode is off (``enable_sleep_mode``), ``level`` is not 1 or 2, the
                engine is asleep already.
            RequestsInFlightError: (a ValueError) requests are in flight: they must finish or
                be aborted first (their KV cache would be lost).
        """
        if not self.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)."
            )
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}.")
        if self.asleep:
            raise ValueError(f"the engine is asleep already (level {self.sleep_level}); wake_up() first.")
        if self.has_unfinished_requests():
            raise RequestsInFlightError(
                f"cannot sleep with {self.get_num_unfinished_requests()} request(s) in flight (their KV "
                "cache would be lost); let them finish or abort them first."
            )
        if not self.scheduler.reset_prefix_cache():  # the blocks' contents go with the cache
            raise ValueError("cannot sleep: KV blocks are still held; let the requests finish first.")
        self.executor.sleep(level)
        self.asleep = set(SLEEP_TAGS)
        self.sleep_level = level
        logger.info(
            "sleep mode: asleep at level %d (KV cache freed, weights %s)", level, self._weights_fate(level)
        )

    def _weights_fate(self, level: int) -> str:
        if level == 2:
            return "dropped"
        return "kept in host memory" if self._device() == "cpu" else "offloaded to host memory"

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Bring back what ``sleep`` put away: ``tags`` among ``SLEEP_TAGS`` (``weights``,
        ``kv_cache``; None: both). The engine takes requests again once both are back. The KV
        cache comes back empty (so does the prefix cache); weights dropped at level 2 are read
        from the checkpoint. A no-op while awake.

        Raises:
            ValueError: sleep mode is off, or an unknown tag.
        """
        if not self.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode)."
            )
        wanted = tuple(SLEEP_TAGS if tags is None else tags)
        bad = [t for t in wanted if t not in SLEEP_TAGS]
        if bad or not wanted:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {list(wanted)}.")
        todo = tuple(t for t in SLEEP_TAGS if t in wanted and t in self.asleep)
        if not todo:
            return
        self.executor.wake_up(todo)
        self.asleep -= set(todo)
        logger.info(
            "sleep mode: %s back%s", " and ".join(todo), "; awake" if not self.asleep else ", still asleep"
        )
        if not self.asleep:
            self.sleep_level = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps (its executor lost a tensor-parallel peer
        rank, or its ranks went out of step), or None while it can."""
        fn = getattr(self.executor, "dead_reason", None)
        return fn() if fn is not None else None

    # ------------------------------------------------------------------ the step
    def shutdown(self) -> None:
        """Release the executor: its processes (the tensor-parallel peer ranks), and its weights
        and KV cache once nothing else holds them; idempotent. The engine runs no step
        afterwards (one raises ``RuntimeError``). Also done at interpreter exit.

        Why drop the executor: objects that outlive the engine (an HTTP app's route closures,
        which FastAPI keeps in a process-wide cache) would otherwise keep the model in memory
        for the life of the process."""
        if not isinstance(self.executor, _ShutDownExecutor):
            try:
                self._save_new_tier_blocks()  # the last step's demotions, then the writer drains
            except Exception:
                logger.exception("disk tier: saving the last host-tier blocks failed")
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()
        self.executor = _ShutDownExecutor()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model iteration; returns outputs of every request that got a
        new token, finished, was aborted since the last step, or was ignored (rejected).

        A fault in one request's part of the step (preparing its inputs, the forward, sampling,
        appending its tokens) ends only the request(s) at fault (found by re-running the batch
        in halves, ``fault_isolation``), with outcome ``"failed"`` (``"rejected"`` when its
        input no longer passes validation); the rest of the step completes as if they had not
        been scheduled, and their blocks are freed. Only a fault of the scheduler itself
        propagates.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        seq_group_metadata_list, sched_out = self.scheduler.schedule()
        self._save_new_tier_blocks()  # before this step's moves may reuse their host blocks
        faults: dict[int, BaseException] = {}
        scheduled = sched_out.scheduled_seq_groups
        if not sched_out.is_empty():
            t0 = self.clock()
            # Constrained rows: their bitmask is filled on a worker thread during the forward.
            masks = None
            if self._structured is not None and self._structured.num_live:
                masks = self._structured.prepare_step(seq_group_metadata_list)
            results, faults = self._execute(seq_group_metadata_list, sched_out)
            for i, result in enumerate(results):
                if result is not None and result.error is not None:
                    # e.g. non-finite logits: its samples are missing, and the K/V it wrote
                    # are not to be trusted (never entered in the prefix cache)
                    lora = scheduled[i].seq_group.lora_request
                    why = (
                        result.error
                        if lora is None
                        else f"{result.error} with LoRA adapter {lora.lora_name!r}"
                    )
                    faults[i] = RequestFault(why)
                    results[i] = None
            if masks is not None and self._structured is not None:
                try:
                    masks.wait()  # no matcher advances while the fill may still read it
                except Exception:
                    logger.exception("step %d: computing grammar masks failed", self.stats.num_steps)
                # A matcher that failed while filling its mask ends its own group only (its row
                # allowed EOS alone; the batch's forward and sampling went on).
                for i, err in self._structured.faults(seq_group_metadata_list).items():
                    if i not in faults:
                        faults[i] = err
                        results[i] = None
            step_s = self.clock() - t0
            self.stats.on_step(step_s)
            self.scheduler.observe_step(sched_out, step_s)
            self.stats.num_batched_tokens += sched_out.num_batched_tokens
            if faults:
                # The failed groups' chunks were not computed (or not trusted): never advance
                # them or enter their blocks in the prefix cache.
                sched_out = dataclasses.replace(
                    sched_out,
                    scheduled_seq_groups=[s for i, s in enumerate(scheduled) if i not in faults],
                )
            self.scheduler.mark_computed(sched_out)
        else:
            results = []
        now = self.clock()
        for i, (ssg, meta, result) in enumerate(zip(scheduled, seq_group_metadata_list, results)):
            group = ssg.seq_group
            if group.is_finished():
                continue
            if i in faults:
                outputs.append(self._fail_request(group, faults[i]))
                continue
            if result is not None and result.prompt_logprobs:
                if self.detokenizer is not None and group.sampling_params.detokenize:
                    for entry in result.prompt_logprobs:
                        if entry is not None:
                            self.detokenizer.decode_logprobs(entry)
                group.add_prompt_logprobs(result.prompt_logprobs_start, result.prompt_logprobs)
            if not meta.do_sample or result is None:
                continue
            if result.pooled is not None:  # a pooling request ends with its prompt's step
                from kvserve.engine.pooling import finish_pooled

                outputs.append(finish_pooled(self, group, result.pooled, now))
                continue
            try:
                self._process_samples(group, result, now)
                if group.is_finished():
                    out = self._finish_request(group)
                elif group.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                    continue
                else:
                    out = self._make_output(group)
            except Exception as e:  # e.g. detokenizing or a stop check of this request
                if not _is_grammar_error(e):  # the request's constraint: one line, no traceback
                    logger.exception("request %s: processing its samples failed", group.request_id)
                out = self._fail_request(group, e)
            outputs.append(out)
        for group in sched_out.ignored_seq_groups:
            out = self._finish_request(group)
            logger.warning(
                "request %s %s: %s",
                group.request_id,
                "rejected" if out.outcome == "rejected" else "ended",
                group.ignored_reason,
            )
            outputs.append(out)
        self.scheduler.free_finished_seq_groups()
        self.stats.record_queues(now, self.scheduler)
        return outputs

    def _execute(
        self, metas: list[SequenceGroupMetadata], sched_out: SchedulerOutputs
    ) -> tuple[list[CompletionSequenceGroupOutput | None], dict[int, BaseException]]:
        """Run the step on the executor; on an exception, find the groups at fault.

        Returns one result per metadata entry (``None`` for a faulty one) and the faults by
        index. Retries carry no block moves: the executor applied them before the forward that
        raised (``BlockMoveError`` says it did not), and applying a swap-out again would copy
        blocks that the failed forward may have written. The K/V a failed forward wrote for a
        retried group are written again by its retry, and a faulty group's blocks are freed
        without entering the prefix cache, so no stale K/V is ever read.
        """
        lookahead = sched_out.num_lookahead_slots
        # Seeded requests draw from their own generator; a failed attempt may have advanced it.
        rng_states = {i: md.generator.get_state() for i, md in enumerate(metas) if md.generator is not None}
        try:
            return list(
                self.executor.execute_model(
                    ExecuteModelRequest(
                        seq_group_metadata_list=metas,
                        blocks_to_swap_in=sched_out.blocks_to_swap_in,
                        blocks_to_swap_out=sched_out.blocks_to_swap_out,
                        blocks_to_copy=sched_out.blocks_to_copy,
                        num_lookahead_slots=lookahead,
                    )
                )
            ), {}
        except BlockMoveError as e:
            logger.exception("step %d: block moves failed", self.stats.num_steps)
            self.scheduler.block_manager.drop_tier_moves()
            self._fail_swapped_out(sched_out, e)
            return [None] * len(metas), dict.fromkeys(range(len(metas)), e)
        except Exception as e:
            logger.exception(
                "step %d failed for a batch of %d groups; re-running it in halves to find the fault",
                self.stats.num_steps,
                len(metas),
            )
            first_error = e

        def restore(idx: list[int]) -> None:
            for i in idx:
                state = rng_states.get(i)
                if state is not None:
                    metas[i].generator.set_state(state)

        retry_masks = []

        def run(sub: list[SequenceGroupMetadata]) -> list[CompletionSequenceGroupOutput]:
            if self._structured is not None and any(md.token_bitmask is not None for md in sub):
                # The step's one mask fill covers every constrained row, so a fill that raised
                # would fail them all: each attempt fills its own rows again (no matcher has
                # advanced since), which leaves a fill fault with the rows that cause it.
                masks = self._structured.prepare_step(sub)
                if masks is not None:
                    retry_masks.append(masks)
            return self.executor.execute_model(
                ExecuteModelRequest(seq_group_metadata_list=sub, num_lookahead_slots=lookahead)
            )

        try:
            return bisect_failures(run, metas, first_error, before_attempt=restore)
        finally:
            for masks in retry_masks:  # no matcher advances while a fill may still read it
                with contextlib.suppress(Exception):
                    masks.wait()

    def _fail_swapped_out(self, sched_out: SchedulerOutputs, error: BaseException) -> None:
        """After failed block moves, end the groups swapped out this step (their CPU copies
        may not hold their K/V); their final outputs go out with the next step."""
        moved = set(sched_out.blocks_to_swap_out.values())
        if not moved:
            return
        bm = self.scheduler.block_manager
        for g in list(self.scheduler.swapped):
            if any(bm.has_blocks(s) and moved & set(bm.get_block_table(s)) for s in g.get_unfinished_seqs()):
                self._pending_outputs.append(self._fail_request(g, error))

    def _fail_request(self, group: SequenceGroup, error: BaseException) -> RequestOutput:
        """End a group whose step failed: ``"rejected"`` with the validation message when its
        own input no longer passes validation (e.g. params changed after ``add_request``),
        else ``"failed"`` with an error naming the request id. Frees its blocks; returns its
        final output."""
        reason = self._input_fault(group)
        if reason is not None:
            status = SequenceStatus.FINISHED_IGNORED
            group.ignored_reason = reason
        else:
            status = SequenceStatus.FINISHED_FAILED
            if isinstance(error, RequestFault) or _is_grammar_error(error):
                group.error = f"request {group.request_id} failed: {error}"
            else:
                group.error = (
                    f"internal error while running request {group.request_id}: "
                    f"{type(error).__name__}: {error}"
                )
        logger.error(
            "request %s %s: %s", group.request_id, "rejected" if reason else "failed", reason or group.error
        )
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = status
        self.scheduler.abort_seq_group(group.request_id)  # out of its queue, blocks freed
        return self._finish_request(group)

    def _input_fault(self, group: SequenceGroup) -> str | None:
        """The validation error of the group's own input now, or None when it is valid."""
        if group.pooling_params is not None:
            return None  # checked at add_request; nothing of it changes while it runs
        try:
            group.sampling_params._verify()
            self.validate(group.prompt_token_ids, group.sampling_params)
        except ValueError as e:
            return str(e)
        return None

    def _process_samples(
        self, group: SequenceGroup, result: CompletionSequenceGroupOutput, now: float
    ) -> None:
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        samples = result.samples
        if not group.forked:
            # First sample of an n > 1 request: fork the prompt sequence into n sequences
            # that share its KV blocks (copy-on-write on their first divergent token).
            parent = group.get_unfinished_seqs()[0]
            targets = [parent]
            for _ in samples[1:]:
                child = parent.fork(next_seq_id())
                group.add(child)
                self.scheduler.fork_seq(parent, child)
                if self._structured is not None:
                    self._structured.fork(parent.seq_id, child.seq_id)
                targets.append(child)
            group.forked = True
        else:
            targets = [group.seqs_dict[s.parent_seq_id] for s in samples]
        max_tokens = self._max_tokens[group.request_id]
        num_emitted = 0
        num_drafts_kept = 0  # emitted beyond one token per sequence: accepted drafts
        advanced = False
        for seq, sample in zip(targets, samples):
            emitted = sample.emitted()
            appended = 0
            for tok in emitted:
                appended += 1
                self._append_token(group, seq, tok, max_tokens)
                if seq.is_finished():
                    break  # nothing after a stop is emitted
            num_emitted += appended
            num_drafts_kept += max(0, appended - 1)
            if seq.is_finished():
                self.scheduler.free_seq(seq)
                if self._structured is not None:
                    self._structured.free(seq.seq_id)
            elif appended > 1:
                # The verify chunk computed the K/V of the accepted drafts (the tokens appended
                # before the last); the last one's slot holds a rejected draft (or nothing) and
                # is overwritten when it is fed next step.
                seq.data.update_num_computed_tokens(appended - 1)
                advanced = True
        if num_drafts_kept:
            self.scheduler.on_accepted_drafts(group, num_drafts_kept)
        if advanced:
            # Blocks the accepted drafts completed enter the prefix cache (and are deduplicated)
            # now, before the next step is scheduled, as blocks a plain decode completes do.
            self.scheduler.block_manager.mark_blocks_as_computed(group)
        self.stats.on_tokens(num_emitted)
        if result.spec_num_eligible_seqs:
            self.stats.on_draft_opportunities(result.spec_num_eligible_seqs)
            if result.spec_skipped:
                self.stats.on_draft_skips(result.spec_skipped)
                group.spec_num_skipped_steps += sum(result.spec_skipped.values())
            for seq in group.get_unfinished_seqs():
                self.scheduler.block_manager.release_lookahead(seq)
        if result.spec_num_draft_tokens:
            self._account_speculation(group, result, samples)
        elif group.spec_decode_disabled:
            self._maybe_resume_speculation(group)

    def _append_token(self, group: SequenceGroup, seq: Sequence, sample, max_tokens: int) -> None:
        """Append one emitted token to ``seq``: structured-output matcher, detokenizer, stop
        checks (the sequence may finish here)."""
        params = group.sampling_params
        seq.append_token_id(
            sample.output_token,
            sample.logprob,
            sample.top_logprobs if params.logprobs is not None else None,
        )
        grammar_done = False
        if self._structured is not None:
            grammar_done = self._structured.accept_token(seq.seq_id, sample.output_token)
        new_text = ""
        if self.detokenizer is not None and params.detokenize:
            new_text = self.detokenizer.decode_last_token(seq, params.skip_special_tokens)
            if params.logprobs is not None and sample.top_logprobs is not None:
                self.detokenizer.decode_logprobs(sample.top_logprobs)
        self.stop_checker.maybe_stop(seq, params, new_text, max_tokens)
        if grammar_done and not seq.is_finished():
            # The constraint is complete: only EOS could follow, so end here (a step saved;
            # with ignore_eos the EOS would not end it at all).
            seq.status = SequenceStatus.FINISHED_STOPPED

    def _account_speculation(
        self, group: SequenceGroup, result: CompletionSequenceGroupOutput, samples
    ) -> None:
        """Count the step's drafts (request and engine) and apply the low-acceptance rule."""
        group.spec_num_draft_tokens += result.spec_num_draft_tokens
        group.spec_num_accepted_tokens += result.spec_num_accepted_tokens
        group.spec_window_draft_tokens += result.spec_num_draft_tokens
        group.spec_window_accepted_tokens += result.spec_num_accepted_tokens
        for sample in samples:
            if sample.num_draft_tokens:
                self.stats.on_speculation(sample.num_draft_tokens, sample.num_accepted_tokens)
        cfg = self.speculative_config
        if (
            cfg is None
            or cfg.disable_below_acceptance_rate <= 0
            or group.spec_window_draft_tokens < cfg.acceptance_window
        ):
            return
        # Judged per window of acceptance_window drafts (then counted afresh), so a request
        # that accepted well early and stops accepting pauses within one window.
        low = (
            group.spec_window_accepted_tokens
            < cfg.disable_below_acceptance_rate * group.spec_window_draft_tokens
        )
        group.spec_window_draft_tokens = group.spec_window_accepted_tokens = 0
        if low:
            # Paused, not ended: what a request generates changes (an answer that starts
            # in its own words may go on to quote its input, or to repeat itself), so it
            # speculates again after acceptance_window * 2**pauses more output tokens and is
            # judged afresh; a request that never accepts wastes O(log length) windows.
            group.spec_decode_disabled = True
            group.spec_resume_at = _output_len(group) + cfg.acceptance_window * 2**group.spec_num_pauses
            group.spec_num_pauses += 1

    @staticmethod
    def _maybe_resume_speculation(group: SequenceGroup) -> None:
        """End a low-acceptance pause once the group has generated past its end."""
        if group.spec_resume_at is not None and _output_len(group) >= group.spec_resume_at:
            group.spec_decode_disabled = False
            group.spec_resume_at = None

    # ------------------------------------------------------------------ outputs
    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        hold = max(0, max_stop_len(params) - 1)
        completions = []
        seqs = sorted(group.get_seqs(), key=lambda s: s.seq_id)
        return_n = self._return_n.get(group.request_id)
        if return_n is not None:
            # best_of: the n highest cumulative logprobs (so far, while it runs); ties keep order
            seqs = sorted(seqs, key=lambda s: -s.data.cumulative_logprob)[:return_n]
        delta = params.output_kind == RequestOutputKind.DELTA
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if hold and not seq.is_finished():
                # Never show characters that may turn out to be the start of a stop string.
                text = text[: max(0, len(text) - hold)]
            token_ids = list(seq.get_output_token_ids())
            logprobs = list(seq.output_logprobs) if params.logprobs is not None else None
            if delta:
                # only what the previous outputs did not carry
                sent_chars, sent_tokens = self._delta_sent.get(seq.seq_id, (0, 0))
                self._delta_sent[seq.seq_id] = (len(text), len(token_ids))
                text, token_ids = text[sent_chars:], token_ids[sent_tokens:]
                if logprobs is not None:
                    logprobs = logprobs[sent_tokens:]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.data.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=SequenceStatus.get_finished_reason(seq.status),
                    stop_reason=seq.stop_reason,
                    lora_request=group.lora_request,
                )
            )
        finished = group.is_finished()
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=group.metrics,
            error=group.error or group.ignored_reason,
            num_cached_tokens=group.num_cached_tokens or 0,
            prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            spec_num_draft_tokens=group.spec_num_draft_tokens,
            spec_num_accepted_tokens=group.spec_num_accepted_tokens,
            spec_num_skipped_steps=group.spec_num_skipped_steps,
            lora_request=group.lora_request,
        )

    def _finish_request(self, group: SequenceGroup) -> RequestOutput:
        """Final output of a request; forgets it (every per-request map is emptied here)."""
        group.metrics.finished_time = self.clock()
        out = self._make_output(group)
        if self._structured is not None:
            for seq in group.get_seqs():
                self._structured.free(seq.seq_id)
        free_seqs = getattr(self.executor, "free_seqs", None)
        if free_seqs is not None:  # a speculating executor's per-sequence proposer state
            free_seqs([seq.seq_id for seq in group.get_seqs()])
        if self._groups.pop(group.request_id, None) is not None and group.lora_request is not None:
            live = self._live_loras.get(group.lora_request.lora_int_id)
            if live is not None:
                live[1] -= 1
                if live[1] <= 0:
                    del self._live_loras[group.lora_request.lora_int_id]
        self._max_tokens.pop(group.request_id, None)
        self._return_n.pop(group.request_id, None)
        for seq in group.get_seqs():
            self._delta_sent.pop(seq.seq_id, None)
        self.stats.on_request_finished(group, out)
        return out

    # ------------------------------------------------------------------ introspection
    def get_kv_cache_stats(self) -> dict:
        """``num_gpu_blocks``, ``num_free_gpu_blocks``, ``num_cpu_blocks``,
        ``num_free_cpu_blocks`` (cached blocks nothing references count as free),
        ``gpu_cache_usage``, prefix-cache queries/hits/hit rate, ``num_preemptions``."""
        return self.scheduler.get_kv_cache_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block nothing references. Returns False if blocks are in use."""
        return self.scheduler.reset_prefix_cache()

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """``validate_request`` against this engine's vocabulary and limits; returns the
        effective max_tokens. Raises ValueError naming the field and the limit."""
        sc = self.scheduler_config
        if params.bad_words and params.bad_words_token_ids is None:
            # tokenized once per params object (the server validates before queueing)
            params.bad_words_token_ids = bad_words_token_ids(
                params.bad_words, self.tokenizer, self.vocab_size
            )
        return validate_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=sc.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            tokenizer_size=self.tokenizer_size,
            kv_capacity=self.kv_capacity(),
        )

    def kv_capacity(self) -> KVCapacity | None:
        """The KV pool as admission sees it (usable blocks: the pool minus the watermark), or
        None where the cache need not hold a whole sequence: a sliding window on every layer
        (``cache_config.sliding_window``) lets the block manager drop the blocks behind it.
        Models whose windows differ per layer keep every block, so they are checked."""
        if self.cache_config.sliding_window is not None:
            return None
        bm = self.scheduler.block_manager
        total, watermark = bm.num_total_gpu_blocks, bm.watermark_blocks
        return KVCapacity(total - watermark, bm.block_size, total, watermark)

    def check_admissible(self, prompt_len: int) -> str | None:
        """Why a prompt of ``prompt_len`` tokens can never be scheduled (exceeds
        ``prompt_limit`` or needs more KV blocks than the cache holds), or None. Lets the
        server answer 400 before queueing instead of returning an ignored request."""
        limit = self.scheduler.prompt_limit
        if prompt_len > limit:
            return f"prompt has {prompt_len} tokens > prompt_limit {limit}"
        # Same rule as the scheduler's admission: the pool minus the watermark.
        bm = self.scheduler.block_manager
        total, watermark = bm.num_total_gpu_blocks, bm.watermark_blocks
        needed = -(-prompt_len // self.cache_config.block_size)
        if needed > total - watermark:
            return (
                f"prompt needs {needed} KV blocks > {total - watermark} usable blocks in the cache "
                f"({total} blocks, watermark {watermark})"
            )
        return None

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (a pooling model's embedding dimension)."""
        return int(self.executor.model.config.hidden_size)

    def _device(self) -> str:
        try:
            return self.model_config.resolved_device()
        except Exception:
            return "cpu"
