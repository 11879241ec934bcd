"""``POST /v1/completions``.

A request with several prompts (a list of strings or of token-id lists) becomes one engine
request per prompt, each with ``n`` samples; choice ``index = prompt_index * n + sample``.
Streaming sends, per choice, the growth of ``CompletionOutput.text`` (the engine already holds
back text that may turn out to be the start of a stop string), so the concatenated deltas equal
the non-streamed text. Nothing is sent before a choice's first token: its first chunk carries
that token's text (or, with ``echo`` / logprobs, the prompt and the token's entries).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.beam_search import BeamSearch
from kvserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from kvserve.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    RequestRecord,
    Reservation,
    SubRequest,
    finite,
    sse,
    stream_outputs,
)
from kvserve.entrypoints.openai.structured_outputs import structured_outputs_from_request
from kvserve.field_limits import check_count, check_request_size
from kvserve.lora_request import LoRARequest
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams


def sampling_kwargs(
    req, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None
) -> dict:
    """SamplingParams keyword arguments from the fields completions and chat share
    (``null`` means the default: ``defaults``' value, the model's generation_config.json, where
    it has one for the field, else kvserve's).

    Raises:
        APIError: 400 naming ``stream_options`` when it is set without ``stream=true`` (it
            shapes the stream only; vLLM refuses it the same way), or naming the constraint
            field that ``structured_outputs_from_request`` refuses.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError(
            "stream_options is only allowed with stream=true.",
            400,
            param="stream_options",
            code="invalid_value",
        )

    model = defaults or {}

    def pick(value, default):
        return default if value is None else value

    return dict(
        n=pick(req.n, 1),
        max_tokens=pick(max_tokens, model.get("max_tokens")),
        temperature=pick(req.temperature, model.get("temperature", 1.0)),
        top_p=pick(req.top_p, model.get("top_p", 1.0)),
        top_k=pick(req.top_k, model.get("top_k", -1)),
        min_p=pick(req.min_p, model.get("min_p", 0.0)),
        repetition_penalty=pick(req.repetition_penalty, model.get("repetition_penalty", 1.0)),
        presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=pick(req.include_stop_str_in_output, False),
        ignore_eos=pick(req.ignore_eos, False),
        logprobs=logprobs,
        logit_bias=req.logit_bias,
        min_tokens=pick(req.min_tokens, 0),
        skip_special_tokens=pick(req.skip_special_tokens, True),
        prompt_logprobs=req.prompt_logprobs,
        bad_words=req.bad_words,
        allowed_token_ids=req.allowed_token_ids,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        structured_outputs=structured_outputs_from_request(req),
    )


def check_size(req, prompt_lens: list[int], **fields) -> None:
    """``field_limits.check_request_size`` over all of the request's prompts (``fields``: its
    ``n``, ``prompt_logprobs``, ``best_of``).

    Raises:
        APIError: 400 naming the field and the limit; ``logprobs`` when the prompt logprobs
            come from ``echo`` with ``logprobs`` rather than from ``prompt_logprobs``.
    """
    try:
        check_request_size(prompt_lens, **fields)
    except ValueError as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        if param == "prompt_logprobs" and req.prompt_logprobs is None:
            param, message = "logprobs", f"logprobs with echo (the prompt's logprobs): {message}"
        raise APIError(message, 400, param=param, code="invalid_value") from None


class OpenAIServingCompletion(OpenAIServing):
    """Handler of ``/v1/completions`` (see ``OpenAIServing`` for the admission order)."""

    endpoint = "completions"

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        """Validate, queue and answer one completions request (JSON or an SSE stream)."""
        lora = self.check_model(req.model)
        priority = self.request_priority(req.priority)
        n = 1 if req.n is None else req.n
        if req.use_beam_search:
            return await self.beam_search_completion(req, raw_request, lora)
        if req.best_of is not None and req.best_of < n:
            raise APIError(
                f"best_of must be >= n ({n}), got {req.best_of}.", 400, param="best_of", code="invalid_value"
            )
        if req.best_of is not None and req.best_of > n and req.stream:
            # the n best are known only once all best_of samples have finished
            raise APIError(
                f"best_of ({req.best_of}) > n ({n}) cannot be streamed: the n best samples are known "
                "only at the end; set stream=false or best_of=n.",
                400,
                param="best_of",
                code="unsupported",
            )
        if req.length_penalty is not None and req.length_penalty != 1.0:
            raise APIError(
                f"length_penalty={req.length_penalty} applies to beam search only: set "
                "use_beam_search=true, or leave length_penalty out.",
                400,
                param="length_penalty",
                code="unsupported",
            )
        if req.suffix:
            raise APIError("suffix is not supported.", 400, param="suffix", code="unsupported")
        defaults = self.generation_defaults
        # max_tokens left out (not null) is the model's max_new_tokens where it has one, else 16
        max_tokens = req.max_tokens
        if "max_tokens" not in req.model_fields_set and "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"]
        kwargs = sampling_kwargs(req, max_tokens, req.logprobs, defaults)
        if req.best_of is not None and req.best_of > n:
            kwargs["best_of"] = req.best_of
        if req.echo and req.logprobs is not None:
            # the prompt's tokens and their logprobs come first (OpenAI's echo shape)
            kwargs["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
        params = self.make_sampling_params(kwargs)
        await self.compile_constraint(params)
        prompts = self._split_prompts(req.prompt)
        # best_of > n: every prompt runs best_of sequences
        best_of = params.best_of if params.num_sequences > n else None
        check_size(req, [1] * len(prompts), n=n, best_of=best_of)  # prompts x n, before tokenizing them
        subs = await self.prepare_prompts(raw_request, prompts, params)
        lens = [len(sub.prompt_token_ids) for sub in subs]
        check_size(req, lens, n=n, prompt_logprobs=params.prompt_logprobs, best_of=best_of)
        reservation = self.check_capacity(len(subs))
        rec = self.new_record(
            "cmpl", n, subs, lora, params=params, headers=raw_request.headers, tenant=req.user
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            raw_request,
            bool(req.stream),
            lambda: self._stream(req, params, subs, rec, priority, include_usage, reservation),
            lambda: self._full(req, params, subs, rec, priority, reservation),
            rec,
            reservation,
        )

    async def beam_search_completion(
        self, req: CompletionRequest, raw_request: Request, lora: LoRARequest | None = None
    ) -> Response:
        """``use_beam_search``: beam search of width ``best_of`` (or ``n``) per prompt
        (``kvserve.entrypoints.beam_search``); the ``n`` best hypotheses become the choices.
        Not streamed; only ``max_tokens``, ``ignore_eos``, ``length_penalty``, ``echo``,
        ``skip_special_tokens``, ``priority`` and the prompt shape it; the other sampling and
        output-constraint fields must keep their defaults (else a 400 naming the field)."""
        n = 1 if req.n is None else req.n
        width = req.best_of if req.best_of is not None else n
        if n > width:
            raise APIError(
                f"n ({n}) must be <= best_of ({width}), the beam width.", 400, param="n", code="invalid_value"
            )
        conflicts = {
            "stream": bool(req.stream),
            "logprobs": req.logprobs is not None,
            "prompt_logprobs": req.prompt_logprobs is not None,
            "suffix": bool(req.suffix),
            "max_tokens": req.max_tokens is None,
            "temperature": req.temperature not in (None, 0),
            "top_p": req.top_p not in (None, 1),
            "top_k": req.top_k not in (None, -1),
            "min_p": req.min_p not in (None, 0),
            "stop": bool(req.stop),
            "stop_token_ids": bool(req.stop_token_ids),
            "logit_bias": bool(req.logit_bias),
            "min_tokens": bool(req.min_tokens),
            "presence_penalty": bool(req.presence_penalty),
            "frequency_penalty": bool(req.frequency_penalty),
            "repetition_penalty": req.repetition_penalty not in (None, 1),
            "seed": req.seed is not None,
            "stream_options": req.stream_options is not None,
            # beam search ranks the model's own distribution: an output constraint would not
            # apply, so it is refused rather than ignored
            "response_format": req.response_format is not None
            and (req.response_format.type != "text" or req.response_format.json_schema is not None),
            "structured_outputs": req.structured_outputs is not None,
            "guided_json": req.guided_json is not None,
            "guided_regex": req.guided_regex is not None,
            "guided_choice": req.guided_choice is not None,
            "guided_grammar": req.guided_grammar is not None,
            "guided_whitespace_pattern": req.guided_whitespace_pattern is not None,
            "include_stop_str_in_output": bool(req.include_stop_str_in_output),
            "bad_words": bool(req.bad_words),
            "allowed_token_ids": req.allowed_token_ids is not None,
            "truncate_prompt_tokens": req.truncate_prompt_tokens is not None,
        }
        for name, bad in conflicts.items():
            if bad:
                raise APIError(
                    f"{name} is not supported with use_beam_search=true"
                    + (" (max_tokens must be set)" if name == "max_tokens" else "")
                    + ".",
                    400,
                    param=name,
                    code="unsupported",
                )
        try:
            bparams = BeamSearchParams(
                beam_width=width,
                max_tokens=req.max_tokens or 1,
                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                ignore_eos=bool(req.ignore_eos),
            )
        except ValueError as e:
            message = str(e).replace("beam_width", "best_of (the beam width)")
            raise APIError(message, 400, param="best_of" if "beam_width" in str(e) else None) from None
        probe = self.make_sampling_params(dict(max_tokens=req.max_tokens, logprobs=2 * width))
        prompts = self._split_prompts(req.prompt)
        check_size(req, [1] * len(prompts), best_of=width)  # prompts x best_of, before tokenizing
        subs = await self.prepare_prompts(raw_request, prompts, probe)
        check_size(req, [len(sub.prompt_token_ids) for sub in subs], best_of=width)
        reservation = self.check_capacity(len(subs))
        rec = self.new_record("cmpl", n, subs, lora, headers=raw_request.headers, tenant=req.user)
        eos = self.engine.eos_token_id
        limit = self.engine.scheduler_config.max_model_len
        searches = [
            BeamSearch(
                sub.prompt_token_ids, bparams, eos, min(bparams.max_tokens, limit - len(sub.prompt_token_ids))
            )
            for sub in subs
        ]

        priority = self.request_priority(req.priority)
        skip_special = req.skip_special_tokens is not False
        tok = self.tokenizer

        def decode(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special) if tok is not None and ids else ""

        async def run() -> dict:
            step = 0
            while True:
                beams = [(j, ids) for j, srch in enumerate(searches) for ids in srch.pending()]
                if not beams:
                    break
                step_subs = [
                    SubRequest(f"{rec.request_id}-beam{step}-{b}", None, ids)
                    for b, (_, ids) in enumerate(beams)
                ]
                tops: list[list] = [[] for _ in searches]
                finals: dict[int, Any] = {}
                try:
                    async for idx, out in self.generate_all(
                        step_subs, searches[0].sampling_params(), priority, lora_request=lora, tenant=req.user
                    ):
                        if out.finished:
                            if out.outcome != "finished":
                                raise self.rejected_error(out)
                            finals[idx] = out
                except APIError:
                    raise
                except Exception as e:
                    raise self.engine_error(e) from None
                for b, (j, _) in enumerate(beams):
                    tops[j].append(finals[b].outputs[0].logprobs[0])
                for j, srch in enumerate(searches):
                    if tops[j]:
                        srch.advance(tops[j])
                if rec.first_token_time is None:
                    rec.first_token_time = time.time()  # the first step chose every beam's first token
                step += 1
            choices = []
            for idx, (sub, srch) in enumerate(zip(subs, searches)):
                prefix = self._echo_text(sub) if req.echo else ""
                best = srch.output(decode).sequences[:n]
                # the request log and usage read the returned beams as the request's outputs
                rec.latest[idx] = RequestOutput(
                    request_id=sub.request_id,
                    prompt=sub.prompt_text,
                    prompt_token_ids=sub.prompt_token_ids,
                    outputs=[
                        CompletionOutput(
                            index=i,
                            text=seq.text,
                            token_ids=seq.output_token_ids,
                            cumulative_logprob=seq.cum_logprob,
                            finish_reason=seq.finish_reason,
                        )
                        for i, seq in enumerate(best)
                    ],
                    finished=True,
                )
                for i, seq in enumerate(best):
                    choices.append(
                        CompletionChoice(
                            index=idx * n + i, text=prefix + seq.text, finish_reason=seq.finish_reason
                        )
                    )
            return CompletionResponse(
                id=rec.request_id, model=self.response_model(rec), choices=choices, usage=rec.usage()
            ).model_dump()

        return await self.respond(raw_request, False, None, run, rec, reservation)

    @staticmethod
    def _split_prompts(prompt) -> list:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(
                "prompt must contain at least 1 token; got an empty list.",
                400,
                param="prompt",
                code="invalid_value",
            )
        if isinstance(prompt[0], int):
            return [prompt]
        try:  # a batch of strings or of token-id lists: each becomes an engine request
            check_count("prompt", len(prompt))
        except ValueError as e:
            raise APIError(str(e), 400, param="prompt", code="invalid_value") from None
        return list(prompt)

    async def _full(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        subs: list[SubRequest],
        rec: RequestRecord,
        priority: int,
        reservation: Reservation,
    ) -> dict:
        try:
            async for idx, out in self.generate_all(
                subs, params, priority, reservation, lora_request=rec.lora_request, tenant=req.user
            ):
                rec.observe(idx, out)
                if out.finished and out.outcome in ("rejected", "failed"):
                    raise self.rejected_error(out)
        except APIError:
            raise
        except Exception as e:
            raise self.engine_error(e) from None
        choices = []
        for idx, sub in enumerate(subs):
            out = rec.latest[idx]
            prefix = self._echo_text(sub) if req.echo else ""
            for c in out.outputs:
                lp = None
                if params.logprobs is not None:
                    lp = self._logprobs(c, 0, len(c.token_ids), len(prefix))
                    if req.echo:
                        lp = self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, lp)
                choices.append(
                    CompletionChoice(
                        index=idx * params.n + c.index,
                        text=prefix + c.text,
                        logprobs=lp,
                        prompt_logprobs=self.prompt_logprobs_json(out.prompt_logprobs)
                        if params.prompt_logprobs is not None
                        else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=rec.request_id, model=self.response_model(rec), choices=choices, usage=rec.usage()
        ).model_dump()

    def _stream(
        self,
        req: CompletionRequest,
        params: SamplingParams,
        subs: list[SubRequest],
        rec: RequestRecord,
        priority: int,
        include_usage: bool,
        reservation: Reservation,
    ):
        created = int(time.time())
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        echoes: dict[int, str] = {}  # prompt index -> echoed text
        done = set()

        def chunk(choices, usage=None) -> str:
            return sse(
                CompletionStreamResponse(
                    id=rec.request_id,
                    created=created,
                    model=self.response_model(rec),
                    choices=choices,
                    usage=usage,
                )
            )

        async def events():
            async for idx, out in self.generate_all(
                subs, params, priority, reservation, lora_request=rec.lora_request, tenant=req.user
            ):
                rec.observe(idx, out)
                if out.finished and out.outcome in ("rejected", "failed"):
                    raise self.rejected_error(out)
                for c in stream_outputs(out, params.n):
                    ci = idx * params.n + c.index
                    if ci in done:
                        continue
                    first = ci not in sent_chars
                    start_chars, start_toks = sent_chars.get(ci, 0), sent_tokens.get(ci, 0)
                    delta = c.text[start_chars:]
                    if idx not in echoes:
                        echoes[idx] = self._echo_text(subs[idx]) if req.echo else ""
                    echo = echoes[idx]
                    if first:
                        delta = echo + delta
                    new_tokens = len(c.token_ids) > start_toks
                    want_lp = params.logprobs is not None and new_tokens
                    force = first and (req.echo or req.prompt_logprobs is not None)
                    if not delta and c.finish_reason is None and not want_lp and not force:
                        continue
                    lp = (
                        self._logprobs(c, start_toks, len(c.token_ids), len(echo) + start_chars)
                        if params.logprobs is not None
                        else None
                    )
                    if first and lp is not None and req.echo:
                        lp = self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, lp)
                    prompt_lp = (
                        self.prompt_logprobs_json(out.prompt_logprobs)
                        if first and req.prompt_logprobs is not None
                        else None
                    )
                    sent_chars[ci] = max(start_chars, len(c.text))
                    sent_tokens[ci] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(ci)
                    yield chunk(
                        [
                            CompletionChoice(
                                index=ci,
                                text=delta,
                                logprobs=lp,
                                prompt_logprobs=prompt_lp,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ]
                    )

        usage = (lambda: chunk([], usage=rec.usage())) if include_usage else None
        return self.sse_frame(events(), rec, usage, done, len(subs) * params.n)

    # ------------------------------------------------------------------ pieces
    def _echo_text(self, sub: SubRequest) -> str:
        return sub.prompt_text if sub.prompt_text is not None else self.decode(sub.prompt_token_ids)

    def _echo_logprobs(
        self, prompt_ids: list[int], prompt_logprobs, completion: CompletionLogprobs
    ) -> CompletionLogprobs:
        """OpenAI's echo shape: the prompt's tokens first (the first one's logprob null), then
        ``completion``'s (whose text offsets already count the echoed prompt text)."""
        lp = CompletionLogprobs()
        offset = 0
        for i, tid in enumerate(prompt_ids):
            s = self.token_str(tid)
            entry = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
            lp.tokens.append(s)
            lp.text_offset.append(offset)
            offset += len(s)
            if entry is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(finite(entry[tid].logprob) if tid in entry else None)
            alts: dict[str, float] = {}
            for t, v in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
                ts = self.token_str(t)
                if ts not in alts:
                    alts[ts] = finite(v.logprob)
            lp.top_logprobs.append(alts)
        lp.tokens += completion.tokens
        lp.token_logprobs += completion.token_logprobs
        lp.top_logprobs += completion.top_logprobs
        lp.text_offset += completion.text_offset
        return lp

    def _logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int) -> CompletionLogprobs:
        """Legacy logprobs of tokens ``[start, end)`` of a completion."""
        lp = CompletionLogprobs()
        entries = c.logprobs or []
        offset = text_offset
        for tid, top in zip(c.token_ids[start:end], entries[start:end]):
            s = self.token_str(tid)
            lp.tokens.append(s)
            lp.token_logprobs.append(finite(top[tid].logprob) if top and tid in top else None)
            alts: dict[str, float] = {}
            for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1].logprob):
                ts = self.token_str(t)
                if ts not in alts:
                    alts[ts] = finite(v.logprob)
            lp.top_logprobs.append(alts)
            lp.text_offset.append(offset)
            offset += len(s)
        return lp
