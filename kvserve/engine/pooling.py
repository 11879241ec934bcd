"""The pooling runner of the engine: embedding models served by the same ``LLMEngine``.

A pooling engine (``runner='pooling'``: an encoder such as BERT, or a decoder with
``convert='embed'``) takes ``PoolingParams`` requests only. Each is prefill only: the scheduler
admits whole prompts by token budget (chunked prefill and prefix caching are off, and the step
budget holds the longest prompt), the executor (``worker.pooling_worker.PoolingWorker``) runs
them without a KV cache and returns one vector per request, and the engine ends the request in
that same step (its blocks, which only count the step's tokens, are freed at once; it is never
preempted or swapped).

A cross-encoder (``BertForSequenceClassification``) is a pooling engine with the ``score``
task: a request is a text pair tokenized as one sequence (``pair_prompt``) and ends with its
relevance score (``layers.pooler.finish_score``) where an embedding model ends with a vector.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineArgs
from kvserve.engine.input_processor import PromptType, tokenize_prompt
from kvserve.model_executor.layers.pooler import (
    PoolerConfig,
    finish_score,
    finish_vector,
    read_pooler_config,
)
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
    from kvserve.model_executor.config_checks import context_length
    from kvserve.model_executor.model_loader import load_model
    from kvserve.model_executor.models.registry import is_cross_encoder, is_encoder
    from kvserve.transformers_utils.tokenizer import load_tokenizer
    from kvserve.worker.pooling_worker import PoolingWorker

    _refuse_settings(args)
    encoder = is_encoder(hf_config)
    pooler = read_pooler_config(
        model_dir, hf_config, encoder, args.pooler_overrides(), cross_encoder=is_cross_encoder(hf_config)
    )
    model_max = context_length(hf_config, model_dir)
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
        "pooling model %s (%s): %s pooling%s, max_model_len %d",
        model_dir,
        pooler.task,
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
        ValueError: naming the field: a bad field (``PoolingParams.verify``), a ``task`` the
            model does not serve (``score`` on an embedding model, ``embed`` / ``encode`` on a
            cross-encoder), ``normalize`` on a cross-encoder, ``dimensions`` on a model
            without Matryoshka truncation, or not one of its dimensions.
    """
    params.verify()
    if pooler.task == "score" and params.task != "score":
        raise ValueError(
            f"task={params.task!r}: this model is a cross-encoder; it scores text pairs (LLM.score, "
            "/score, /rerank) and has no embeddings."
        )
    if pooler.task != "score" and params.task == "score":
        raise ValueError(
            "task='score' needs a cross-encoder (a sequence-classification model); this model "
            "embeds: score pairs by the cosine of their embeddings (LLM.score)."
        )
    if pooler.task == "score" and params.normalize is not None:
        raise ValueError("normalize does not apply to a cross-encoder's score; leave it unset.")
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


def _truncation_length(k: int, max_len: int) -> int:
    """The tokens ``truncate_prompt_tokens=k`` keeps (``-1``: ``max_len``).

    Raises:
        ValueError: ``k`` greater than ``max_len`` (naming both).
    """
    k = max_len if k == -1 else k
    if k > max_len:
        raise ValueError(f"truncate_prompt_tokens={k} is greater than max_model_len={max_len}.")
    return k


def pooled_prompt_ids(
    engine: LLMEngine, prompt: PromptType, params: PoolingParams
) -> tuple[str | None, list[int]]:
    """The prompt's text and token ids after ``truncate_prompt_tokens``, checked against the
    model. An empty text is pooled over the tokens the tokenizer adds around it (BERT: ``[CLS]
    [SEP]``, as sentence-transformers embeds it), so one empty chunk does not fail a batch.
    Raises ValueError naming the field and the limit (an empty prompt on a tokenizer that adds
    no tokens, ids outside the vocabulary, more tokens than ``max_model_len`` without
    ``truncate_prompt_tokens``)."""
    max_len = engine.scheduler_config.max_model_len
    text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
    if text == "" and engine.tokenizer is not None:
        prompt = {"prompt": "", "prompt_token_ids": engine.tokenizer("").input_ids}
    text, ids = tokenize_prompt(prompt, engine.tokenizer)
    k = params.truncate_prompt_tokens
    if k is not None:
        k = _truncation_length(k, max_len)
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


def pair_prompt(engine: LLMEngine, text_1: Any, text_2: Any, truncate_prompt_tokens: int | None) -> dict:
    """A cross-encoder's prompt for the pair: the tokenizer's pair encoding (BERT:
    ``[CLS] text_1 [SEP] text_2 [SEP]``) as ``prompt_token_ids`` and its ``token_type_ids``.

    ``truncate_prompt_tokens`` (``-1``: ``max_model_len``) shortens the longer text first, token
    by token, to fit (the tokenizer's ``longest_first``, as sentence-transformers truncates);
    None: an over-long pair is refused when it is queued.

    Raises:
        ValueError: a text that is not a non-empty string (naming ``text_1`` / ``text_2``),
            ``truncate_prompt_tokens`` over ``max_model_len`` or too small for the pair's
            special tokens.
    """
    for name, text in (("text_1", text_1), ("text_2", text_2)):
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"{name} must be a non-empty string for a cross-encoder (it tokenizes the pair "
                f"together); got {type(text).__name__ if not isinstance(text, str) else 'an empty string'}."
            )
    max_len = engine.scheduler_config.max_model_len
    k = truncate_prompt_tokens
    if k is None:
        enc = engine.tokenizer(text_1, text_2, return_token_type_ids=True)
    else:
        k = _truncation_length(k, max_len)
        enc = engine.tokenizer(
            text_1, text_2, return_token_type_ids=True, truncation="longest_first", max_length=k
        )
        if len(enc["input_ids"]) > k:
            raise ValueError(
                f"truncate_prompt_tokens={k} is too small for a pair: it still has "
                f"{len(enc['input_ids'])} tokens after truncation."
            )
    return {
        "prompt_token_ids": list(enc["input_ids"]),
        "token_type_ids": list(enc["token_type_ids"]),
    }


def _token_type_ids(engine: LLMEngine, prompt: PromptType, ids: list[int]) -> list[int] | None:
    """The prompt dict's ``token_type_ids`` cut as ``ids`` was (its last tokens), or None.

    Raises:
        ValueError: not a list of ints as long as the prompt, or a type outside
            ``[0, type_vocab_size)``.
    """
    if not isinstance(prompt, dict) or prompt.get("token_type_ids") is None:
        return None
    types = prompt["token_type_ids"]
    given = prompt.get("prompt_token_ids")
    if not isinstance(types, (list, tuple)) or given is None or len(types) != len(given):
        raise ValueError(
            "token_type_ids must be a list of integers as long as prompt_token_ids (and needs them)."
        )
    limit = int(getattr(engine.executor.model.config, "type_vocab_size", 2))
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit for t in types):
        raise ValueError(f"token_type_ids must hold integers in [0, {limit}) (type_vocab_size).")
    return list(types[len(types) - len(ids) :])


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
    id, priority and tenant); a prompt dict's ``token_type_ids`` go with it. Raises ValueError
    as ``check_pooling_params`` / ``pooled_prompt_ids``, for bad ``token_type_ids``, or for
    ``params.token_type_ids`` set by the caller; nothing is queued then."""
    assert engine.pooler_config is not None
    check_pooling_params(params, engine.pooler_config, engine.hidden_size)
    if params.token_type_ids is not None:
        # the worker trusts them: they come from a checked prompt only
        raise ValueError(
            "token_type_ids belong in the prompt dict ({'prompt_token_ids': [...], "
            "'token_type_ids': [...]}), not in PoolingParams."
        )
    text, ids = pooled_prompt_ids(engine, prompt, params)
    types = _token_type_ids(engine, prompt, ids)
    if types is not None:
        params = dataclasses.replace(params, token_type_ids=types)
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
    ``dimensions``, normalised as the request or the model says), or a cross-encoder's score
    (``[1]``, through its activation), in the final output; its blocks freed."""
    params: PoolingParams = group.pooling_params
    assert engine.pooler_config is not None
    group.metrics.first_token_time = now
    group.metrics.last_token_time = now
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        engine.scheduler.free_seq(seq)
    out = engine._finish_request(group)
    pooler = engine.pooler_config
    if pooler.task == "score":
        out.pooled = finish_score(pooled, pooler.score_activation)
        return out
    normalize = pooler.normalize if params.normalize is None else params.normalize
    out.pooled = finish_vector(pooled, params.dimensions, normalize)
    return out
