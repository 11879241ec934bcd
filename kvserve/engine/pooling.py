"""The pooling runner of the engine: embedding models served by the same ``LLMEngine``.

A pooling engine (``runner='pooling'``: an encoder such as BERT, or a decoder with
``convert='embed'``) takes ``PoolingParams`` requests only. Each is prefill only: the scheduler
admits whole prompts by token budget (chunked prefill and prefix caching are off, and the step
budget holds the longest prompt), the executor (``worker.pooling_worker.PoolingWorker``) runs
them without a KV cache and returns one vector per request, and the engine ends the request in
that same step (its blocks, which only count the step's tokens, are freed at once; it is never
preempted or swapped).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineArgs
from kvserve.engine.input_processor import PromptType, tokenize_prompt
from kvserve.model_executor.layers.pooler import PoolerConfig, finish_vector, read_pooler_config
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceGroup, SequenceStatus, next_seq_id

if TYPE_CHECKING:
    from kvserve.outputs import RequestOutput

#: an ``LLMEngine`` (the type is not imported: ``llm_engine`` imports this module)
LLMEngine = Any

logger = logging.getLogger(__name__)

#: Default step budget (tokens) of a pooling engine: prompts are never chunked, so it is also
#: raised to ``max_model_len`` when that is longer. 4,096 rows keep a small encoder's largest
#: activation (rows x intermediate size, float32) under glibc's 32 MiB mmap threshold, so its
#: buffers are reused from the heap step after step (``worker.cpu_malloc``).
POOLING_BATCHED_TOKENS = 4096


def resolve_runner(args: EngineArgs, hf_config, where: str) -> str:
    """``"pooling"`` or ``"generate"`` for ``args.runner`` on this checkpoint.

    ``auto``: pooling for an encoder-only architecture or with ``convert='embed'``; a
    ``pooling`` runner on a decoder converts it to embeddings.

    Raises:
        ValueError: ``runner='generate'`` on an encoder-only model (naming the checkpoint).
    """
    from kvserve.model_executor.models.registry import is_encoder

    encoder = is_encoder(hf_config)
    if args.runner == "generate":
        if encoder:
            raise ValueError(
                f"model in {where!r} is encoder-only ({', '.join(hf_config.architectures or [])}): it "
                "cannot generate text; use runner='pooling' (or 'auto')."
            )
        return "generate"
    if args.runner == "pooling" or encoder or args.convert == "embed":
        return "pooling"
    return "generate"


def _refuse_settings(args: EngineArgs) -> None:
    """Settings a pooling engine cannot honour, refused by name."""
    bad = {
        "speculative_config": args.speculative_config is not None,
        "enable_lora": args.enable_lora,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": bool(args.enable_chunked_prefill),
        "enable_sleep_mode": args.enable_sleep_mode,
        "quantization": args.quantization not in (None, "none"),
        "tensor_parallel_size": args.tensor_parallel_size != 1,
        "data_parallel_size": args.data_parallel_size != 1,
    }
    for name, on in bad.items():
        if on:
            raise ValueError(
                f"{name}={getattr(args, name)!r} is not supported with runner='pooling' "
                "(pooling runs whole prompts on one engine, without a KV cache)."
            )


def build_pooling_engine(cls: type[LLMEngine], args: EngineArgs, model_dir: Path, hf_config) -> LLMEngine:
    """A pooling ``LLMEngine`` (see the module doc) for the checkpoint in ``model_dir``.

    ``max_model_len`` defaults to the smaller of ``max_position_embeddings`` and the
    sentence-transformers ``max_seq_length``.

    Raises:
        ValueError: a setting ``_refuse_settings`` names, a ``max_model_len`` over the model's
            positions, an unsupported pooler or architecture.
    """
    from kvserve.model_executor.model_loader import load_model
    from kvserve.model_executor.models.registry import is_encoder
    from kvserve.transformers_utils.tokenizer import load_tokenizer
    from kvserve.worker.pooling_worker import PoolingWorker

    _refuse_settings(args)
    encoder = is_encoder(hf_config)
    pooler = read_pooler_config(model_dir, hf_config, encoder, args.pooler_overrides())
    model_max = int(hf_config.max_position_embeddings)
    default_len = min(model_max, pooler.max_seq_length or model_max)
    max_len = args.max_model_len or default_len
    budget = max(args.max_num_batched_tokens or POOLING_BATCHED_TOKENS, max_len)
    pargs = dataclasses.replace(
        args,
        max_model_len=max_len,
        enable_chunked_prefill=False,
        max_num_batched_tokens=budget,
        watermark=0.0,
        # bookkeeping only (no KV tensors): a full step's tokens, and a partial block a sequence
        num_gpu_blocks=-(-budget // args.block_size) + args.max_num_seqs + 1,
        num_cpu_blocks=0,
    )
    model_config, cache_config, scheduler_config = pargs.create_configs(model_max)
    model_config.model = str(model_dir)
    cache_config.num_gpu_blocks = pargs.num_gpu_blocks
    cache_config.num_cpu_blocks = 0
    device = model_config.resolved_device()
    model = load_model(model_dir, model_config.resolved_dtype(), device, hf_config)
    worker = PoolingWorker(model, pooler, device)
    tokenizer = load_tokenizer(model_dir)
    logger.info(
        "pooling model %s: %s pooling%s, max_model_len %d",
        model_dir,
        pooler.pooling_type,
        ", normalized" if pooler.normalize else "",
        max_len,
    )
    return cls(
        model_config,
        cache_config,
        scheduler_config,
        executor=worker,
        tokenizer=tokenizer,
        vocab_size=hf_config.vocab_size,
        eos_token_id=None,
        pooler_config=pooler,
    )


def check_pooling_params(params: PoolingParams, pooler: PoolerConfig, hidden_size: int) -> None:
    """``params`` against the model.

    Raises:
        ValueError: naming the field: a bad field (``PoolingParams.verify``), ``dimensions``
            on a model without Matryoshka truncation, or not one of its dimensions.
    """
    params.verify()
    d = params.dimensions
    if d is None:
        return
    dims = pooler.matryoshka_dimensions
    if dims is None:
        raise ValueError(
            f"dimensions={d}: this model does not support Matryoshka truncation "
            f"(its embeddings have {hidden_size} dimensions); leave dimensions unset."
        )
    if d > hidden_size or d not in dims:
        allowed = f"1..{hidden_size}" if len(dims) == hidden_size else ", ".join(map(str, dims))
        raise ValueError(f"dimensions={d} is not supported by this model; supported: {allowed}.")


def pooled_prompt_ids(
    engine: LLMEngine, prompt: PromptType, params: PoolingParams
) -> tuple[str | None, list[int]]:
    """The prompt's text and token ids after ``truncate_prompt_tokens``, checked against the
    model. Raises ValueError naming the field and the limit (an empty prompt, ids outside the
    vocabulary, more tokens than ``max_model_len`` without ``truncate_prompt_tokens``)."""
    max_len = engine.scheduler_config.max_model_len
    text, ids = tokenize_prompt(prompt, engine.tokenizer)
    k = params.truncate_prompt_tokens
    if k is not None:
        k = max_len if k == -1 else k
        if k > max_len:
            raise ValueError(f"truncate_prompt_tokens={k} is greater than max_model_len={max_len}.")
        ids = ids[-k:]
    if len(ids) > max_len:
        raise ValueError(
            f"input has {len(ids)} tokens > max_model_len {max_len}; shorten it or set "
            "truncate_prompt_tokens to keep its last tokens."
        )
    vocab = engine.vocab_size
    if vocab is not None and any(t < 0 or t >= vocab for t in ids):
        bad = next(t for t in ids if t < 0 or t >= vocab)
        raise ValueError(f"prompt_token_ids holds {bad}, outside the vocabulary [0, {vocab}).")
    return text, ids


def add_pooling_request(
    engine: LLMEngine,
    request_id: str,
    prompt: PromptType,
    params: PoolingParams,
    arrival_time: float | None,
    priority: int,
    tenant: str | None,
) -> None:
    """Queue one pooling request on a pooling engine (``LLMEngine.add_request`` checked the
    id, priority and tenant). Raises ValueError as ``check_pooling_params`` /
    ``pooled_prompt_ids``; nothing is queued then."""
    assert engine.pooler_config is not None
    check_pooling_params(params, engine.pooler_config, engine.hidden_size)
    text, ids = pooled_prompt_ids(engine, prompt, params)
    seq = Sequence(next_seq_id(), ids, engine.cache_config.block_size, eos_token_id=None, prompt=text)
    group = SequenceGroup(
        request_id,
        [seq],
        SamplingParams(max_tokens=1, detokenize=False),
        arrival_time=engine.clock() if arrival_time is None else arrival_time,
        priority=priority,
        tenant=tenant,
    )
    group.pooling_params = params
    engine._groups[request_id] = group
    engine._max_tokens[request_id] = 1
    engine.stats.on_request_added(len(ids))
    engine.scheduler.add_seq_group(group)


def finish_pooled(engine: LLMEngine, group: SequenceGroup, pooled, now: float) -> RequestOutput:
    """End a pooling group whose prompt ran this step: its vector (truncated to
    ``dimensions``, normalised as the request or the model says) in the final output; its
    blocks freed."""
    params: PoolingParams = group.pooling_params
    assert engine.pooler_config is not None
    group.metrics.first_token_time = now
    group.metrics.last_token_time = now
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        engine.scheduler.free_seq(seq)
    normalize = engine.pooler_config.normalize if params.normalize is None else params.normalize
    out = engine._finish_request(group)
    out.pooled = finish_vector(pooled, params.dimensions, normalize)
    return out
