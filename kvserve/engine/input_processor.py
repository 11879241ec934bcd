"""Turns a user prompt into validated token ids before anything is queued."""

from __future__ import annotations

import operator

from kvserve.engine.kv_capacity import KVCapacity
from kvserve.field_limits import check_request_size
from kvserve.sampling_params import SamplingParams

PromptType = str | dict | list[int]


def tokenize_prompt(prompt: PromptType, tokenizer) -> tuple:
    """Returns ``(prompt_text or None, prompt_token_ids)``.

    Accepts a string, ``{"prompt": str}``, ``{"prompt_token_ids": [int, ...]}`` or a list of
    token ids (as vLLM does).

    Raises:
        ValueError: unknown prompt type, a text prompt without a tokenizer, or 0 tokens after
            tokenization ("prompt must contain at least 1 token"). An empty string is rejected
            even when the tokenizer would add a BOS token, so that ``""`` behaves the same on
            every model.
    """
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
            ids = list(ids)
        elif "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'.")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, list(prompt)
    else:
        raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}.")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}.")
        if text == "":
            raise ValueError("prompt must contain at least 1 token; got an empty string.")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead.")
        ids = tokenizer(text).input_ids
    if len(ids) == 0:
        raise ValueError("prompt must contain at least 1 token; got 0 prompt token ids.")
    try:
        ids = [operator.index(t) for t in ids]  # ints (numpy ints too), never floats or bools
        if any(isinstance(t, bool) for t in ids):
            raise TypeError
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers.") from None
    return text, ids


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last ``params.truncate_prompt_tokens`` ids (-1: the last ``max_model_len``);
    the ids unchanged when it is None.

    Raises:
        ValueError: naming ``truncate_prompt_tokens`` when it exceeds ``max_model_len``.
    """
    k = params.truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or an integer in [1, {max_model_len}] (max_model_len), got {k}."
        )
    return prompt_token_ids[-k:]


def bad_words_token_ids(bad_words: list[str], tokenizer, vocab_size: int | None) -> list[list[int]]:
    """The token sequences ``bad_words`` ban: each word tokenized without special tokens as
    given (leading spaces stripped) and with one leading space, the second kept when it differs
    from the first (a word inside a sentence usually tokenizes with its space).

    Raises:
        ValueError: naming ``bad_words``: no tokenizer, or a word with a token id outside
            ``[0, vocab_size)``.
    """
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this engine has none.")
    out: list[list[int]] = []
    for word in bad_words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in out:
                out.append(ids)
    if vocab_size is not None:
        bad = sorted({t for ids in out for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(
                f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:5]}."
            )
    return out


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int | None,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int | None = None,
    tokenizer_size: int | None = None,
    kv_capacity: KVCapacity | None = None,
) -> int:
    """Checks one request against the model and engine limits; returns effective max_tokens.

    ``tokenizer_size``: ``len(tokenizer)`` (None: no tokenizer). A ``logit_bias`` key must be
    a token both the model and the tokenizer have, ``[0, min(vocab_size, tokenizer_size))``:
    a model whose vocabulary is padded past its tokenizer's (or a tokenizer with added tokens
    the model lacks) has ids that decode to nothing, so a bias pushing one made empty text.

    ``kv_capacity``: the KV pool (None: not checked, e.g. a model whose every layer slides a
    window, whose cache never holds a whole sequence). The cache is a second context limit:
    the request's sequences at prompt + max_tokens must fit it (``KVCapacity.blocks_needed``),
    else it could only ever be cut short. It is checked when the prompt alone fits the pool; a
    longer prompt is the scheduler's admission's to refuse (the request ends ``rejected``).

    ``max_tokens=None`` resolves to ``max_model_len - prompt_len`` (generation runs to the end
    of the context and finishes with ``length``), capped at what the KV cache holds after the
    prompt for the request's sequences (``KVCapacity.max_new_tokens``).

    Raises:
        ValueError: naming the field and the limit: token ids outside ``[0, vocab_size)``,
            ``logit_bias`` keys outside the tokens both model and tokenizer have,
            ``n`` (or ``best_of``) ``> max_num_seqs`` or ``> max_num_batched_tokens`` (its
            sequences decode a token each per step: a wider group would never fit a step and
            hang), ``allowed_token_ids`` outside the vocabulary, ``truncate_prompt_tokens``
            above ``max_model_len``,
            prompt + max_tokens > max_model_len, prompt + max_tokens (per sequence) past the
            KV cache (naming ``max_tokens``; ``n`` / ``best_of`` when not one token each
            fits), stop ids outside the vocabulary,
            ``top_k`` above the vocabulary size, ``min_tokens`` above the effective max_tokens
            (``max_model_len - prompt_len`` when ``max_tokens`` is None), and the request size
            caps of ``field_limits.check_request_size`` for this one prompt (``n`` past
            ``MAX_REQUEST_SEQUENCES``, prompt-logprob entries past
            ``MAX_PROMPT_LOGPROB_ENTRIES``, prefill cost past ``MAX_REQUEST_PREFILL_COST``).
    """
    prompt_len = len(prompt_token_ids)
    if vocab_size is not None:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size}); got {bad[:5]}.")
        bad = [t for t in params.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}.")
        if params.top_k > vocab_size:
            raise ValueError(
                f"top_k must be -1 (disable) or an integer in [1, {vocab_size}] (the vocabulary "
                f"size), got {params.top_k}."
            )
    sizes = [v for v in (vocab_size, tokenizer_size) if v is not None]
    if sizes and params.logit_bias:
        limit = min(sizes)
        bad = sorted(t for t in params.logit_bias if t >= limit)
        if bad:
            which = "the model's vocabulary" if limit == vocab_size else "the tokenizer's vocabulary"
            if len(set(sizes)) > 1:
                which = f"tokens both the model (vocab_size {vocab_size}) and its tokenizer ({tokenizer_size}) have"
            raise ValueError(f"logit_bias must be token ids in [0, {limit}) ({which}); got {bad[:5]}.")
    if vocab_size is not None and params.allowed_token_ids is not None:
        bad = sorted({t for t in params.allowed_token_ids if t >= vocab_size})
        if bad:
            raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}.")
    if params.truncate_prompt_tokens not in (None, -1) and params.truncate_prompt_tokens > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or an integer in [1, {max_model_len}] (max_model_len), "
            f"got {params.truncate_prompt_tokens}."
        )
    # best_of > n runs best_of sequences: the same limits, named by the field that set them
    width, name = params.num_sequences, "best_of" if params.num_sequences > params.n else "n"
    if width > max_num_seqs:
        raise ValueError(f"{name} must be <= max_num_seqs ({max_num_seqs}), got {width}.")
    if max_num_batched_tokens is not None and width > max_num_batched_tokens:
        raise ValueError(f"{name} must be <= max_num_batched_tokens ({max_num_batched_tokens}), got {width}.")
    if prompt_len >= max_model_len:  # the prompt itself is too long, whatever max_tokens says
        raise ValueError(
            f"prompt has {prompt_len} tokens, which leaves no room to generate within "
            f"max_model_len {max_model_len}."
        )
    check_request_size(
        [prompt_len],
        n=params.n,
        prompt_logprobs=params.prompt_logprobs,
        best_of=width if width > params.n else None,
    )
    cache = kv_capacity
    if cache is not None and -(-prompt_len // cache.block_size) > cache.num_blocks:
        cache = None  # the prompt alone overflows the pool: admission refuses it
    # greedy sequences are the same tokens: the scheduler's recompute shares their full blocks
    same = width > 1 and params.is_greedy
    room = cache.max_new_tokens(prompt_len, width, same) if cache is not None else max_model_len
    if cache is not None and room < 1:  # (one sequence always has room for one token)
        raise ValueError(
            f"{name} ({width}) sequences of a {prompt_len}-token prompt do not fit the KV cache "
            f"({cache.describe()}) with even one generated token each; lower {name}."
        )
    if params.max_tokens is None:
        effective, bound = (
            max_model_len - prompt_len,
            f"max_model_len {max_model_len} - prompt {prompt_len} tokens",
        )
        if cache is not None and room < effective:
            # the rest of the context would outgrow the cache: the default stops where it is full
            effective, bound = room, f"what the KV cache ({cache.describe()}) holds after the prompt"
        if params.min_tokens > effective:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) must be <= the effective max_tokens {effective} "
                f"({bound}; max_tokens is null)."
            )
        return effective
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
            f"{prompt_len + params.max_tokens} > max_model_len ({max_model_len})."
        )
    need = 0 if cache is None else cache.blocks_needed(prompt_len, params.max_tokens, width, same)
    if cache is not None and need > cache.num_blocks:
        total = prompt_len + params.max_tokens
        if width == 1:
            over = (
                f"{total} > {cache.num_tokens + 1} tokens, the longest sequence the KV cache holds "
                "(the last generated token is never cached)"
            )
        else:
            over = f"{total} tokens for each of {name}={width} sequences, {need} KV blocks > what the KV cache holds"
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {over} "
            f"({cache.describe()}); max_tokens can be at most {room} here, or left out."
        )
    return params.max_tokens
