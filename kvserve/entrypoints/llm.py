"""The offline batch API: ``LLM.generate`` and ``LLM.chat``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import cast

from kvserve.config import EngineArgs
from kvserve.engine.input_processor import PromptType, tokenize_prompt
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.beam_search import BeamSearch, BeamSearchOutput
from kvserve.entrypoints.chat_template import check_template_kwargs, load_chat_template
from kvserve.entrypoints.vllm_compat import translate_llm_kwargs
from kvserve.field_limits import check_request_size, check_tenant
from kvserve.lora_request import LoRARequest
from kvserve.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def _prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    """One prompt or a sequence of prompts, as a list of prompts. A list of ints is one prompt
    of token ids, not a batch."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [cast(PromptType, prompts)]
    return list(cast(Seq[PromptType], prompts))


class LLM:
    """Generate completions for many prompts in one continuous batch.

    ``LLM(**engine_args)`` takes the settings of ``kvserve.config.EngineArgs`` by name
    (``model``, ``dtype``, ``device``, ``block_size``, ``num_gpu_blocks``, ... ), and vLLM's
    ``LLM`` keywords with the fate ``vllm_compat`` gives their flag (``swap_space`` ->
    ``swap_space_gib``, ``trust_remote_code`` ignored with a log line, ``cpu_offload_gb=4``
    refused). With no ``model`` it runs the embedded SmolLM2-135M-Instruct.
    ``chat_template`` (vLLM's keyword: a file or an inline Jinja2 template) is the template
    ``chat`` renders with unless a call names its own. ``llm.llm_engine`` is the engine.

    Raises:
        ValueError: unknown or refused setting, invalid value, a model path without weights,
            or a ``chat_template`` that does not load.
    """

    def __init__(self, model: str | None = None, chat_template: str | None = None, **kwargs):
        # read before the engine loads, so a bad template fails fast
        self._chat_template = (
            None if chat_template is None else load_chat_template(chat_template, "chat_template")
        )
        kwargs = translate_llm_kwargs({"model": model, **kwargs}, set(EngineArgs.field_names()))
        args = EngineArgs(**kwargs)
        self._dp = None
        if args.data_parallel_size > 1:
            # replicas on Ray; llm_engine is then the front engine (tokenizer, validation)
            from kvserve.distributed import start_data_parallel_engine

            self._dp = start_data_parallel_engine(args)
            self.llm_engine = self._dp.engine
        else:
            self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()
        self._model_name = "default" if model is None else str(model)

    def shutdown(self) -> None:
        """Stop the data-parallel replicas and the engine's tensor-parallel worker processes
        (``tensor_parallel_size > 1``); idempotent, and done at interpreter exit anyway. The
        ``LLM`` cannot generate afterwards."""
        if self._dp is not None:
            self._dp.shutdown()
        self.llm_engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and put the weights away until ``wake_up`` (needs
        ``enable_sleep_mode=True``): level 1 offloads them to host memory (on CPU they stay
        where they are, already in host memory), level 2 drops them. ``generate`` raises
        ``EngineSleepingError`` meanwhile.

        Raises:
            ValueError: sleep mode is off, a level other than 1 or 2, or already asleep.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` put away: ``tags`` among ``"weights"`` and ``"kv_cache"``
        (None: both). The prefix cache starts empty; level 2's weights are read from the
        checkpoint again.

        Raises:
            ValueError: sleep mode is off, or an unknown tag.
        """
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are put away (``sleep``)."""
        return self.llm_engine.is_sleeping

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` ``generate`` and ``chat`` use when given none: the model's
        generation_config.json defaults (``generation_config``), else ``SamplingParams()``."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        tenant: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; returns one ``RequestOutput`` per prompt, in order.

        ``prompts``: a string, ``{"prompt_token_ids": [...]}``, or a list of those.
        ``sampling_params``: one for all, or a list with one per prompt; None:
        ``get_default_sampling_params()`` (the model's generation_config.json defaults).
        ``lora_request``: one adapter for all prompts, or a list with one entry (a
        ``LoRARequest`` or None for the base model) per prompt; needs ``enable_lora=True``.
        ``tenant``: who the prompts are served for (the ``fair`` policy shares service between
        tenants), one name for all or a list with one entry per prompt; None = the default
        tenant. ``priority``: one int for all prompts or a list with one per prompt (lower
        first; needs the ``priority`` or ``fair`` policy unless 0).
        A prompt the scheduler can never run (too long for ``prompt_limit`` or the KV cache)
        comes back finished with ``finish_reason == "ignored"`` and ``error`` saying why; a
        request whose step failed inside the engine comes back with ``outcome == "failed"``
        (``finish_reason == "error"``, ``error`` naming it), and the others are unaffected.

        Raises:
            ValueError: for any invalid prompt or params (an adapter that does not load, a
                ``lora_request`` or ``tenant`` list of the wrong length or while LoRA is off, a
                ``tenant`` that is not a string, list or None, a tenant over ``MAX_TENANT_CHARS``
                characters, a non-zero ``priority`` unless the policy is ``priority`` or
                ``fair``); then nothing is queued.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts."
                )
        # only finished requests are returned: their final output is the whole completion,
        # whatever output_kind asks of a stream (a DELTA request would lose its earlier text)
        final_only: dict[int, SamplingParams] = {}
        for i, p in enumerate(params_list):
            if isinstance(p, SamplingParams) and p.output_kind != RequestOutputKind.FINAL_ONLY:
                if id(p) not in final_only:
                    final_only[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                params_list[i] = final_only[id(p)]
        if priority is None or (isinstance(priority, int) and not isinstance(priority, bool)):
            priorities = [priority or 0] * len(prompts)  # one int applies to every prompt
        elif isinstance(priority, (list, tuple)):
            priorities = list(priority)
        else:
            raise ValueError(
                f"priority must be an int or a list of ints (one per prompt), got {type(priority).__name__}."
            )
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts.")
        policy = self.llm_engine.scheduler_config.policy
        # another policy never reads it: refused, not accepted and ignored (as vLLM does); a
        # value that is not an int is left to the engine's check, which names the range
        first = next((p for p in priorities if isinstance(p, int) and p), 0)
        if policy not in ("priority", "fair") and first:
            raise ValueError(
                f"priority {first} needs the 'priority' or 'fair' policy; this LLM runs {policy!r} "
                "(LLM(scheduling_policy='priority'), or leave priority out)."
            )
        loras = self._lora_list(lora_request, len(prompts))
        if tenant is None or isinstance(tenant, str):
            tenants: list[str | None] = [tenant] * len(prompts)
        elif isinstance(tenant, (list, tuple)):
            tenants = list(tenant)
            if len(tenants) != len(prompts):
                raise ValueError(f"tenant has {len(tenants)} entries for {len(prompts)} prompts.")
        else:
            raise ValueError(
                f"tenant must be a string, a list of strings (one per prompt) or None, got {type(tenant).__name__}."
            )
        for t in tenants:
            check_tenant("tenant", t)
        engine = self.llm_engine
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        if self._dp is not None:
            from kvserve.distributed.dp_engine import run_batch

            return run_batch(self._dp, list(zip(ids, prompts, params_list, priorities, tenants)), use_tqdm)
        added = []
        try:
            for rid, prompt, params, prio, lora, ten in zip(
                ids, prompts, params_list, priorities, loras, tenants
            ):
                engine.add_request(rid, prompt, params, priority=prio, lora_request=lora, tenant=ten)
                added.append(rid)
        except Exception:
            engine.abort_request(added)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        return self._run_engine(ids, use_tqdm)

    def _lora_list(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One ``lora_request`` entry per prompt. Raises ValueError: a list of the wrong
        length, an entry that is not a ``LoRARequest``, or an adapter while LoRA is off."""
        if lora_request is None:
            return [None] * n
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts.")
        for x in loras:
            if x is not None and not isinstance(x, LoRARequest):
                raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(x).__name__}.")
        if any(x is not None for x in loras) and self.llm_engine.lora_config is None:
            raise ValueError(
                "lora_request was given but LoRA is not enabled; create the LLM with enable_lora=True."
            )
        return loras

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search (transformers' rule, see ``kvserve.entrypoints.beam_search``) for each
        prompt, all prompts' beams batched together; returns one ``BeamSearchOutput`` per
        prompt (hypotheses best first). Each step submits every live beam as a one-token
        request that reuses its parent's KV blocks (``SamplingParams.cache_prefix``), with or
        without ``enable_prefix_caching``.

        Raises:
            ValueError: an invalid prompt, a beam the engine rejected (e.g. too long), or
                prompts x ``beam_width`` (or their prefill cost) past the request size caps
                (``field_limits.check_request_size``, naming ``best_of``, the beam width).
        """
        prompts = _prompt_list(prompts)
        engine = self.llm_engine
        searches = []
        for prompt in prompts:
            _, ids = tokenize_prompt(prompt, engine.tokenizer)
            room = engine.scheduler_config.max_model_len - len(ids)
            if room < 1:
                raise ValueError(
                    f"prompt has {len(ids)} tokens, which leaves no room in max_model_len "
                    f"({engine.scheduler_config.max_model_len})."
                )
            searches.append(BeamSearch(ids, params, engine.eos_token_id, min(params.max_tokens, room)))
        check_request_size([len(s.prompt_token_ids) for s in searches], best_of=params.beam_width)
        while True:
            requests = [(s, i, ids) for s in searches for i, ids in enumerate(s.pending())]
            if not requests:
                break
            params_1 = searches[0].sampling_params()
            outs = self.generate(
                [{"prompt_token_ids": ids} for _, _, ids in requests], params_1, use_tqdm=use_tqdm
            )
            tops: dict[int, list] = {}
            for (s, _, _), out in zip(requests, outs):
                if out.outcome != "finished":
                    raise ValueError(f"beam search: a beam's step ended {out.outcome}: {out.error}")
                logprobs = out.outputs[0].logprobs
                assert logprobs is not None, "beam steps always ask for logprobs"
                tops.setdefault(id(s), []).append(logprobs[0])
            for s in searches:
                if id(s) in tops:
                    s.advance(tops[id(s)])
        tok = engine.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        results = [s.output(decode) for s in searches]
        for prompt, result in zip(prompts, results):
            for seq in result.sequences:
                seq.orig_prompt = prompt
        return results

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Like ``generate`` for chat conversations (lists of ``{"role", "content"}``),
        rendered with the tokenizer's chat template (transformers ``apply_chat_template``), or
        ``chat_template`` (a file or an inline Jinja2 template, ``load_chat_template``; None:
        the one given to ``LLM(chat_template=)``, else the tokenizer's) with
        ``chat_template_kwargs`` as extra template variables (e.g. ``{"enable_thinking":
        False}``); ``lora_request`` as in ``generate``, one per conversation. ``tools``
        (OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}``
        entries) are passed to the template as the server passes a request's ``tools``; the
        output is not parsed for calls.

        Raises:
            ValueError: an invalid ``chat_template``, a reserved ``chat_template_kwargs`` key
                (``check_template_kwargs``), a ``tools[i]`` entry of the wrong shape, or no
                template at all (neither given nor the tokenizer's, naming the model).
        """
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        if chat_template is None:
            template = self._chat_template
        else:
            template = load_chat_template(chat_template, "chat_template")
        extra = check_template_kwargs(chat_template_kwargs, "chat_template_kwargs")
        if tools:
            extra["tools"] = _template_tools(tools)
        tok = self.get_tokenizer()
        if template is None and not getattr(tok, "chat_template", None):
            # a base model (e.g. a pretrained GGUF) ships none; transformers' own error would not
            # name the model nor the keyword that fixes it
            raise ValueError(
                f"model {self._model_name!r} has no chat template (its tokenizer sets none): pass "
                "chat_template= (a file or an inline Jinja2 template) to LLM() or chat(), or give "
                "plain prompts to generate()."
            )
        prompts = []
        for conv in messages:
            render = dict(add_generation_prompt=add_generation_prompt, chat_template=template, **extra)
            ids = tok.apply_chat_template(conv, tokenize=True, **render)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            # the rendered text rides along as the output's ``prompt`` (vLLM's shape)
            text = tok.apply_chat_template(conv, tokenize=False, **render)
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ------------------------------------------------------------------ pooling models
    def encode(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        tenant: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt on a pooling model (``runner='pooling'``): one vector each
        (``outputs.data``, a float32 tensor), in prompt order.

        Raises:
            ValueError: a generation model; a prompt or ``pooling_params`` the model refuses
                (naming the field and the limit; nothing of the batch runs then).
        """
        params = pooling_params or PoolingParams()
        prompt_list = _prompt_list(prompts)
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompt_list]
        added: list[str] = []
        try:
            for rid, prompt in zip(ids, prompt_list):
                engine.add_request(rid, prompt, dataclasses.replace(params), tenant=tenant)
                added.append(rid)
        except BaseException:
            engine.abort_request(added)
            with contextlib.suppress(Exception):
                engine.step()
            raise
        return [PoolingRequestOutput.from_request_output(o) for o in self._run_engine(ids, use_tqdm)]

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
        tenant: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed each prompt: ``outputs.embedding`` (a list of floats) per prompt, in order.

        Raises:
            ValueError: as ``encode``, or a request that ended without a vector (its error).
        """
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, tenant=tenant)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        text_1: PromptType | Seq[PromptType],
        text_2: PromptType | Seq[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        tenant: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs: one text against many (``text_1`` one prompt), or pairwise (equal
        lengths); ``outputs.score`` per pair. On an embedding model, the cosine similarity of
        the two embeddings (a bi-encoder's score); on a cross-encoder, the pair read as one
        sequence (``[CLS] text_1 [SEP] text_2 [SEP]``) and its logit through the model's
        activation (sigmoid by default, as sentence-transformers' ``CrossEncoder.predict``).
        ``truncate_prompt_tokens`` (``-1``: ``max_model_len``) shortens an over-long input as
        ``/score`` does: on a cross-encoder the pair's longer text first, on an embedding model
        each text to its last tokens (as ``embed``).

        Raises:
            ValueError: lists of different lengths (other than one against many), an empty
                list, a cross-encoder's text that is not a string, or as ``embed``.
        """
        import torch.nn.functional as F

        a, b = _prompt_list(text_1), _prompt_list(text_2)
        if not a or not b:
            raise ValueError("score needs at least one text on each side.")
        if len(a) == 1 and len(b) > 1:
            a = a * len(b)
        if len(a) != len(b):
            raise ValueError(
                f"text_1 has {len(a)} texts and text_2 {len(b)}; give one, or as many as text_2."
            )
        pooler = self.llm_engine.pooler_config
        if pooler is not None and pooler.task == "score":
            return self._cross_score(a, b, truncate_prompt_tokens, use_tqdm, tenant)
        params = PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self.encode(a + b, params, use_tqdm=use_tqdm, tenant=tenant)
        vecs = []
        for o in outs:
            if o.outputs is None:
                raise ValueError(o.error or f"request {o.request_id} has no embedding ({o.outcome})")
            vecs.append(o.outputs.data)
        n = len(a)
        result = []
        for i in range(n):
            s = float(F.cosine_similarity(vecs[i], vecs[n + i], dim=0))
            ids = list(outs[i].prompt_token_ids) + list(outs[n + i].prompt_token_ids)
            result.append(
                ScoringRequestOutput(f"{outs[i].request_id}-{outs[n + i].request_id}", ids, ScoringOutput(s))
            )
        return result

    def _cross_score(
        self,
        a: list[PromptType],
        b: list[PromptType],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        tenant: str | None,
    ) -> list[ScoringRequestOutput]:
        """``score`` on a cross-encoder: each pair one request (see ``engine.pooling.pair_prompt``)."""
        from kvserve.engine.pooling import pair_prompt

        engine = self.llm_engine
        prompts = [pair_prompt(engine, x, y, truncate_prompt_tokens) for x, y in zip(a, b)]
        outs = self.encode(prompts, PoolingParams(task="score"), use_tqdm=use_tqdm, tenant=tenant)
        result = []
        for o in outs:
            if o.outputs is None:
                raise ValueError(o.error or f"request {o.request_id} has no score ({o.outcome})")
            result.append(
                ScoringRequestOutput(
                    o.request_id, list(o.prompt_token_ids), ScoringOutput(float(o.outputs.data[0]))
                )
            )
        return result

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        final = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        n_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        n_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0
                        if elapsed:
                            bar.set_postfix(out_tok_s=f"{n_tokens / elapsed:.1f}")
        except BaseException:
            # (a scheduler fault, or KeyboardInterrupt) leave the engine usable: nothing of this
            # call stays queued or holds KV blocks.
            engine.abort_request([i for i in ids if i not in final])
            with contextlib.suppress(Exception):
                engine.step()  # hands out the abort outputs
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]


def _template_tools(tools: list[dict]) -> list[dict]:
    """``tools`` as the chat template sees them (the server's shape: each entry checked by the
    request schema, unset fields left out).

    Raises:
        ValueError: naming ``tools[i]`` and what is wrong with it.
    """
    from pydantic import ValidationError

    from kvserve.entrypoints.openai.protocol import ChatTool

    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        try:
            out.append(ChatTool.model_validate(t).model_dump(exclude_none=True))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ValueError(
                f"tools[{i}]{'.' + where if where else ''}: {first['msg']} "
                '(expected {"type": "function", "function": {"name": ..., "parameters": {...}}})'
            ) from None
    return out
