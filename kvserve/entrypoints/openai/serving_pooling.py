"""The pooling routes: ``/v1/embeddings``, ``/pooling``, ``/score``, ``/rerank``.

They run on a pooling engine (``runner='pooling'``) with the generation routes' API key, body
and queue limits, request log, metrics and error bodies. ``/score`` and ``/rerank`` score a
pair by the cosine similarity of its two embeddings on an embedding model (a bi-encoder's
score, as vLLM scores with one), and by the model itself on a cross-encoder (the pair read as
one sequence, ``engine.pooling.pair_prompt``; the logit through its activation). A
cross-encoder has no embeddings: ``/v1/embeddings`` and ``/pooling`` on it are a 400 naming
``model``.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import Request

from kvserve.engine.pooling import check_pooling_params, pair_prompt, pooled_prompt_ids
from kvserve.entrypoints.openai.errors import APIError
from kvserve.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
)
from kvserve.entrypoints.openai.serving_engine import (
    INPUT_ERRORS,
    OpenAIServing,
    RequestRecord,
    SubRequest,
    encode_text,
    input_error,
    run_unless_disconnected,
)
from kvserve.field_limits import MAX_ITEMS
from kvserve.pooling_params import PoolingParams

#: ``encoding_format`` values of ``/v1/embeddings``.
ENCODING_FORMATS = ("float", "base64")


def _encode(vec: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vec.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
    return vec.tolist()


class OpenAIServingPooling(OpenAIServing):
    """Handlers of the pooling routes (see the module doc)."""

    endpoint = "embeddings"

    def require_pooling(self) -> None:
        """400 naming ``model`` unless the engine is a pooling engine."""
        if getattr(self.engine, "runner", "generate") != "pooling":
            raise APIError(
                f"model {self.model_name!r} is a generation model: it serves completions and chat, "
                "not embeddings, pooling, score or rerank (start the server with --runner pooling "
                "and an embedding model).",
                400,
                param="model",
                code="unsupported",
            )

    @property
    def cross_encoder(self) -> bool:
        """Whether the model is a cross-encoder (the ``score`` task)."""
        pooler = getattr(self.engine, "pooler_config", None)
        return pooler is not None and pooler.task == "score"

    def require_embedding(self) -> None:
        """400 naming ``model`` unless the engine is a pooling engine that embeds (not a
        cross-encoder)."""
        self.require_pooling()
        if self.cross_encoder:
            raise APIError(
                f"model {self.model_name!r} is a cross-encoder (task 'score'): it serves /score and "
                "/rerank, not embeddings or pooling.",
                400,
                param="model",
                code="unsupported",
            )

    def _inputs(self, value: Any, param: str) -> list[Any]:
        """A text / token-id list, or a batch of them, as a list of prompts; 400 naming
        ``param`` for an empty one or a batch over the count limit."""
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise APIError(f"{param} must not be empty.", 400, param=param, code="invalid_value")
        limit = MAX_ITEMS["prompt"]  # the batch limit of /v1/completions' prompt
        if len(value) > limit:
            raise APIError(
                f"{param} must have at most {limit} entries, got {len(value)}.",
                400,
                param=param,
                code="invalid_value",
            )
        return list(value)

    def _params(self, **fields: Any) -> PoolingParams:
        params = PoolingParams(**fields)
        try:
            check_pooling_params(params, self.engine.pooler_config, self.engine.hidden_size)
        except ValueError as e:
            field = str(e).split("=", 1)[0].split(" ", 1)[0]
            raise APIError(str(e), 400, param=field, code="invalid_value") from None
        return params

    async def _prepare(self, prompt: Any, params: PoolingParams, param: str) -> SubRequest:
        """Tokenize (off the event loop when long) and check one input; 400 naming ``param``
        (or ``truncate_prompt_tokens``) when the model refuses it."""
        try:
            if isinstance(prompt, str) and prompt and self.tokenizer is not None:
                ids = await self.offload(len(prompt), encode_text, self.tokenizer, prompt, True)
                text, ids = pooled_prompt_ids(
                    self.engine, {"prompt": prompt, "prompt_token_ids": ids}, params
                )
            else:
                text, ids = pooled_prompt_ids(self.engine, prompt, params)
        except ValueError as e:
            raise self._refusal(str(e), param) from None
        except INPUT_ERRORS as e:
            raise input_error(e, param) from None
        return SubRequest("", text, ids)

    @staticmethod
    def _refusal(msg: str, param: str) -> APIError:
        """The 400 for an input the model refuses (``msg``, a ``ValueError``'s text): naming
        ``truncate_prompt_tokens`` when the message is about it, else ``param``."""
        field = "truncate_prompt_tokens" if msg.startswith("truncate_prompt_tokens") else param
        code = "context_length_exceeded" if "max_model_len" in msg and field == param else "invalid_value"
        return APIError(f"{param}: {msg}" if field == param else msg, 400, param=field, code=code)

    async def _prepare_pair(self, a: str, b: str, truncate: int | None, param: str, first: str) -> SubRequest:
        """Tokenize a cross-encoder's pair as one sequence (off the event loop when long) and
        check it; 400 naming ``param`` (or ``truncate_prompt_tokens``) when the model refuses
        it, ``first`` (the route's name of the pair's first text: ``text_1``, ``query``) when
        that text is the one refused."""
        try:
            prompt = await self.offload(len(a) + len(b), pair_prompt, self.engine, a, b, truncate)
            text, ids = pooled_prompt_ids(self.engine, prompt, PoolingParams(task="score"))
        except ValueError as e:
            msg = str(e)
            # pair_prompt names the pair's sides text_1 / text_2; the route's own names go back
            for side, name in (("text_1 ", first), ("text_2 ", param)):
                if msg.startswith(side):
                    raise APIError(
                        name + " " + msg[len(side) :], 400, param=name, code="invalid_value"
                    ) from None
            raise self._refusal(msg, param) from None
        except INPUT_ERRORS as e:
            raise input_error(e, param) from None
        return SubRequest("", text, ids, prompt["token_type_ids"])

    async def _run(
        self,
        raw_request: Request,
        prompts: list[Any],
        params: PoolingParams,
        param: str | list[str],
        prefix: str,
        priority: int | None,
        user: str | None,
        make_body,
        prepare: Callable[[Any, str], Awaitable[SubRequest]] | None = None,
    ):
        """Embed ``prompts`` (all of them or none: the first refused input is the 400) and
        answer ``make_body(rec, vectors)``; ``prepare(prompt, param)`` makes each engine
        request (default: ``_prepare`` with ``params``)."""
        self.require_pooling()
        prio = self.request_priority(priority)
        reservation = self.check_capacity(len(prompts))
        names = param if isinstance(param, list) else [param] * len(prompts)

        async def prepare_all() -> list[SubRequest]:
            if prepare is None:
                return [await self._prepare(p, params, name) for p, name in zip(prompts, names)]
            return [await prepare(p, name) for p, name in zip(prompts, names)]

        try:
            # a batch of long texts keeps the tokenizer pool busy for seconds: a client gone
            # meanwhile stops it at the text being tokenized, not after the whole batch
            subs = await run_unless_disconnected(raw_request, prepare_all())
        except BaseException:
            reservation.release()
            raise
        rec = self.new_record(prefix, 1, subs, headers=raw_request.headers, tenant=user)

        async def full_body() -> dict:
            vecs: list[torch.Tensor | None] = [None] * len(subs)
            try:
                async for idx, out in self.generate_all(subs, params, prio, reservation, tenant=user):  # type: ignore[arg-type]
                    rec.observe(idx, out)
                    if out.finished:
                        if out.pooled is None:
                            raise self.rejected_error(out, names[idx])
                        vecs[idx] = out.pooled
            except APIError:
                raise
            except Exception as e:
                raise self.engine_error(e) from None
            return make_body(rec, vecs)

        return await self.respond(raw_request, False, None, full_body, rec, reservation)

    @staticmethod
    def _usage(rec: RequestRecord) -> UsageInfo:
        return UsageInfo(prompt_tokens=rec.prompt_tokens, completion_tokens=0, total_tokens=rec.prompt_tokens)

    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request, pooling: bool = False):
        """``/v1/embeddings`` (``pooling``: ``/pooling``, the vector in ``data``)."""
        self.require_embedding()
        self.check_model(req.model)
        fmt = req.encoding_format or "float"
        if fmt not in ENCODING_FORMATS:
            raise APIError(
                f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; got {fmt!r}.",
                400,
                param="encoding_format",
                code="invalid_value",
            )
        params = self._params(
            dimensions=req.dimensions,
            normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            task="encode" if pooling else "embed",
        )
        prompts = self._inputs(req.input, "input")

        def body(rec: RequestRecord, vecs: list) -> dict:
            key, obj = ("data", "pooling") if pooling else ("embedding", "embedding")
            data = [{"index": i, "object": obj, key: _encode(v, fmt)} for i, v in enumerate(vecs)]
            return EmbeddingResponse(
                id=rec.request_id, model=rec.model, data=data, usage=self._usage(rec)
            ).model_dump()

        prefix = "pool" if pooling else "embd"
        return await self._run(raw_request, prompts, params, "input", prefix, req.priority, req.user, body)

    def _cross_prepare(self, truncate: int | None, first: str) -> Callable[[Any, str], Awaitable[SubRequest]]:
        """``_run``'s ``prepare`` for a cross-encoder: each prompt a ``(text_1, text_2)`` pair;
        ``first``: the route's name of the first text (``text_1``, ``query``)."""

        async def prepare(pair: Any, param: str) -> SubRequest:
            return await self._prepare_pair(pair[0], pair[1], truncate, param, first)

        return prepare

    def _score_params(self, truncate: int | None) -> PoolingParams:
        """The requests' parameters: a cross-encoder's ``score`` task (``pair_prompt`` cuts a
        pair to ``truncate`` tokens, so the engine's cut of its last tokens changes nothing),
        else normalised embeddings."""
        if self.cross_encoder:
            return self._params(task="score", truncate_prompt_tokens=truncate)
        return self._params(normalize=True, truncate_prompt_tokens=truncate)

    async def create_score(self, req: ScoreRequest, raw_request: Request):
        """``/score``: each ``(text_1, text_2)`` pair's score: the cosine similarity of their
        embeddings, or a cross-encoder's relevance of the pair."""
        self.require_pooling()
        self.check_model(req.model)
        a = self._inputs(req.text_1, "text_1")
        b = self._inputs(req.text_2, "text_2")
        if len(a) == 1 and len(b) > 1:
            a = a * len(b)
        if len(a) != len(b):
            raise APIError(
                f"text_2 has {len(b)} texts and text_1 {len(a)}; text_1 must be one text or as many.",
                400,
                param="text_2",
                code="invalid_value",
            )
        if self.cross_encoder:
            params = self._score_params(req.truncate_prompt_tokens)

            def cross_body(rec: RequestRecord, scores: list) -> dict:
                data = [ScoreData(index=i, score=float(v[0])) for i, v in enumerate(scores)]
                return ScoreResponse(
                    id=rec.request_id, model=rec.model, data=data, usage=self._usage(rec)
                ).model_dump()

            return await self._run(
                raw_request,
                list(zip(a, b)),
                params,
                "text_2",
                "score",
                req.priority,
                req.user,
                cross_body,
                prepare=self._cross_prepare(req.truncate_prompt_tokens, "text_1"),
            )
        params = self._params(normalize=True, truncate_prompt_tokens=req.truncate_prompt_tokens)
        n = len(a)

        def body(rec: RequestRecord, vecs: list) -> dict:
            data = [
                ScoreData(index=i, score=float(F.cosine_similarity(vecs[i], vecs[n + i], dim=0)))
                for i in range(n)
            ]
            return ScoreResponse(
                id=rec.request_id, model=rec.model, data=data, usage=self._usage(rec)
            ).model_dump()

        names = ["text_1"] * n + ["text_2"] * n
        return await self._run(raw_request, a + b, params, names, "score", req.priority, req.user, body)

    async def create_rerank(self, req: RerankRequest, raw_request: Request):
        """``/rerank``: ``documents`` by descending relevance to ``query``: the cosine
        similarity of their embeddings, or a cross-encoder's score of each (query, document)
        pair."""
        self.require_pooling()
        self.check_model(req.model)
        docs = self._inputs(req.documents, "documents")
        top_n = req.top_n or len(docs)
        if top_n < 0:
            raise APIError(f"top_n must be >= 0, got {top_n}.", 400, param="top_n", code="invalid_value")
        params = self._score_params(req.truncate_prompt_tokens)
        cross = self.cross_encoder

        def body(rec: RequestRecord, vecs: list) -> dict:
            if cross:
                scored = [(float(v[0]), i) for i, v in enumerate(vecs)]
            else:
                q = vecs[0]
                scored = [(float(F.cosine_similarity(q, v, dim=0)), i) for i, v in enumerate(vecs[1:])]
            scored.sort(key=lambda t: (-t[0], t[1]))
            results = [
                RerankResult(
                    index=i,
                    document={"text": docs[i]} if req.return_documents else None,
                    relevance_score=s,
                )
                for s, i in scored[:top_n]
            ]
            return RerankResponse(
                id=rec.request_id, model=rec.model, usage=self._usage(rec), results=results
            ).model_dump()

        if cross:
            return await self._run(
                raw_request,
                [(req.query, d) for d in docs],
                params,
                "documents",
                "rerank",
                req.priority,
                req.user,
                body,
                prepare=self._cross_prepare(req.truncate_prompt_tokens, "query"),
            )
        names = ["query"] + ["documents"] * len(docs)
        return await self._run(
            raw_request, [req.query, *docs], params, names, "rerank", req.priority, req.user, body
        )
