"""``POST /v1/completions``.

A request with several prompts (a list of strings or of token-id lists) becomes one engine
request per prompt, each with ``n`` samples; choice ``index = prompt_index * n + sample``.
Streaming sends, per choice, the growth of ``CompletionOutput.text`` (the engine already holds
back text that may turn out to be the start of a stop string), so the concatenated deltas equal
the non-streamed text.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

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
)
from kvserve.entrypoints.openai.structured_outputs import structured_outputs_from_request
from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams


def sampling_kwargs(req, max_tokens: int | None, logprobs: int | None) -> dict:
    """SamplingParams keyword arguments from the fields completions and chat share
    (``null`` means the default)."""

    def pick(value, default):
        return default if value is None else value

    return dict(
        n=pick(req.n, 1),
        max_tokens=max_tokens,
        temperature=pick(req.temperature, 1.0),
        top_p=pick(req.top_p, 1.0),
        top_k=pick(req.top_k, -1),
        min_p=pick(req.min_p, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0),
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
        structured_outputs=structured_outputs_from_request(req),
    )


class OpenAIServingCompletion(OpenAIServing):
    """Handler of ``/v1/completions`` (see ``OpenAIServing`` for the admission order)."""

    endpoint = "completions"

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        """Validate, queue and answer one completions request (JSON or an SSE stream)."""
        self.check_model(req.model)
        n = 1 if req.n is None else req.n
        if req.best_of is not None and req.best_of != n:
            raise APIError(
                f"best_of must equal n ({n}) when set (beam search is not supported), got {req.best_of}.",
                400,
                param="best_of",
                code="invalid_value",
            )
        if req.suffix:
            raise APIError("suffix is not supported.", 400, param="suffix", code="unsupported")
        if req.echo and req.logprobs is not None:
            raise APIError(
                "logprobs together with echo=true is not supported (prompt logprobs are not computed).",
                400,
                param="echo",
                code="unsupported",
            )
        params = self.make_sampling_params(sampling_kwargs(req, req.max_tokens, req.logprobs))
        await self.compile_constraint(params)
        prompts = self._split_prompts(req.prompt)
        subs = [await self.prepare_prompt(p, params) for p in prompts]
        reservation = self.check_capacity(len(subs))
        rec = self.new_record("cmpl", n, subs)
        priority = req.priority or 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self.respond(
            raw_request,
            bool(req.stream),
            lambda: self._stream(req, params, subs, rec, priority, include_usage, reservation),
            lambda: self._full(req, params, subs, rec, priority, reservation),
            rec,
            reservation,
        )

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
        return list(prompt)  # a batch of strings or of token-id lists

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
            async for idx, out in self.generate_all(subs, params, priority, reservation):
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
                choices.append(
                    CompletionChoice(
                        index=idx * params.n + c.index,
                        text=prefix + c.text,
                        logprobs=self._logprobs(c, 0, len(c.token_ids), 0)
                        if params.logprobs is not None
                        else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(
            id=rec.request_id, model=self.model_name, choices=choices, usage=rec.usage()
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
        done = set()

        def chunk(choices, usage=None) -> str:
            return sse(
                CompletionStreamResponse(
                    id=rec.request_id, created=created, model=self.model_name, choices=choices, usage=usage
                )
            )

        async def events():
            async for idx, out in self.generate_all(subs, params, priority, reservation):
                rec.observe(idx, out)
                if out.finished and out.outcome in ("rejected", "failed"):
                    raise self.rejected_error(out)
                for c in out.outputs:
                    ci = idx * params.n + c.index
                    if ci in done:
                        continue
                    first = ci not in sent_chars
                    start_chars, start_toks = sent_chars.get(ci, 0), sent_tokens.get(ci, 0)
                    delta = c.text[start_chars:]
                    if first and req.echo:
                        delta = self._echo_text(subs[idx]) + delta
                    new_tokens = len(c.token_ids) > start_toks
                    want_lp = params.logprobs is not None and new_tokens
                    if not delta and c.finish_reason is None and not want_lp:
                        continue
                    lp = (
                        self._logprobs(c, start_toks, len(c.token_ids), start_chars)
                        if params.logprobs is not None
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

    def _logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int) -> CompletionLogprobs:
        """Legacy logprobs of tokens ``[start, end)`` of a completion."""
        lp = CompletionLogprobs()
        entries = c.logprobs or []
        offset = text_offset
        for tid, top in zip(c.token_ids[start:end], entries[start:end]):
            s = self.token_str(tid)
            lp.tokens.append(s)
            lp.token_logprobs.append(finite(top.get(tid)) if top else None)
            alts: dict[str, float] = {}
            for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1]):
                ts = self.token_str(t)
                if ts not in alts:
                    alts[ts] = finite(v)
            lp.top_logprobs.append(alts)
            lp.text_offset.append(offset)
            offset += len(s)
        return lp
