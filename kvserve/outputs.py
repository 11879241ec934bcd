"""What the engine returns to callers, per request and per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.lora_request import LoRARequest
from kvserve.sequence import Logprob, PromptLogprobs, RequestMetrics

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]


@dataclass
class CompletionOutput:
    """One completion (of ``n``) of a request.

    Attributes:
        index: 0..n-1.
        text: decoded text so far (stop string removed unless ``include_stop_str_in_output``;
            while streaming, the last ``len(stop) - 1`` characters are held back until they
            cannot be the start of a stop string).
        token_ids: generated token ids (a stop token id, if it fired, is included).
        cumulative_logprob: sum of the sampled tokens' log-probabilities.
        logprobs: per generated token, ``{token_id: Logprob}`` when requested (the top
            ``logprobs`` tokens and the sampled one, each with its rank and ``decoded_token``),
            else None.
        finish_reason: ``None`` while running, then ``"stop"``, ``"length"``, ``"abort"``,
            ``"ignored"`` (rejected: see ``RequestOutput.error``) or ``"error"`` (the engine
            failed to run the request's step: see ``RequestOutput.error``).
        stop_reason: the matched stop string or stop token id, or None (EOS / length).
        lora_request: the adapter that produced it, None for the base model.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or its final state when ``finished``).

    ``outcome`` tells how a finished request ended: ``"finished"`` (stop/length),
    ``"aborted"``, ``"rejected"`` (ignored by the scheduler, or its input turned out invalid
    while it ran; ``error`` says why, naming the field or length and the limit), or
    ``"failed"`` (an internal fault while running its step; ``error`` names the request id and
    the exception; the other requests of that step are unaffected). A request that outgrew the KV cache while generating (its next
    token could not fit even with every other request preempted) is ``"finished"`` with
    ``finish_reason="length"``, its tokens kept, and ``error`` says why it stopped.
    ``num_cached_tokens``: prompt tokens found in the prefix cache when it was first scheduled.
    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set): ``None`` for the
    first prompt token, then per prompt token ``{token_id: Logprob}`` (top-k plus the actual
    token); it fills up while the prompt is prefilled and is complete from the first token on.
    ``lora_request``: the adapter the request ran with (None: the base model). vLLM's
    encoder-decoder and disaggregated-prefill fields (``encoder_prompt``,
    ``encoder_prompt_token_ids``, ``kv_transfer_params``) are present and always None: kvserve
    runs decoder-only models in one engine, and code written for vLLM reads them unchanged.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    #: speculative decoding: decode steps (per sequence) that had lookahead slots but verified
    #: no drafts (the dynamic policy's choice, no proposal, ...; /metrics counts them by reason)
    spec_num_skipped_steps: int = 0
    #: a pooling request's vector (float32 torch tensor ``[dim]``) once it finished; else None
    pooled: Any = None
    lora_request: LoRARequest | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def outcome(self) -> str | None:
        if not self.finished:
            return None
        reasons = {o.finish_reason for o in self.outputs}
        if "ignored" in reasons:
            return "rejected"
        if "error" in reasons:
            return "failed"
        if reasons == {"abort"} or (reasons and "abort" in reasons):
            return "aborted"
        return "finished"


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data``, a float32 torch tensor ``[dim]``."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """The final state of one pooling request (``LLM.encode``).

    ``outputs`` is None when it did not finish (``error`` says why: ``outcome`` is then
    ``"rejected"``, ``"failed"`` or ``"aborted"``).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    error: str | None = None
    outcome: str | None = "finished"

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> PoolingRequestOutput:
        """The pooling view of an engine output (its ``pooled`` vector)."""
        return cls(
            request_id=out.request_id,
            prompt_token_ids=out.prompt_token_ids,
            outputs=PoolingOutput(out.pooled) if out.pooled is not None else None,
            finished=out.finished,
            error=out.error,
            outcome=out.outcome if out.pooled is None else "finished",
        )


@dataclass
class EmbeddingOutput:
    """An embedding: ``embedding``, a list of floats (its length is the model's dimension, or
    the request's ``dimensions``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The final state of one embedding request (``LLM.embed``); ``outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """Raises ValueError (its ``error``) when the request has no vector."""
        if out.outputs is None:
            raise ValueError(out.error or f"request {out.request_id} has no embedding ({out.outcome})")
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.outputs.data.tolist()))


@dataclass
class ScoringOutput:
    """A pair's score: the cosine similarity of two embeddings (in ``[-1, 1]``), or a
    cross-encoder's relevance (its logit through its activation: ``(0, 1)`` for sigmoid)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (``LLM.score``); ``outputs.score``. ``prompt_token_ids``: both texts'
    ids (a cross-encoder's: the pair's one sequence)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
