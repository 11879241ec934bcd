"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Request models type-check strictly: a JSON ``2.5`` or ``"10"`` is never silently turned into an
integer, a string is never turned into a number. *Ranges* (``max_tokens >= 1``, ``top_p`` in
``(0, 1]``, ...) are checked by ``SamplingParams`` so that the offline API and the server give
the same messages. Unknown request fields are ignored, as the OpenAI API does for forward
compatibility.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr
from typing_extensions import Annotated

#: A finite JSON number (int or float), never a string, a bool, NaN or Infinity.
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]

#: ``prompt`` of /v1/completions: text, a batch of texts, token ids, or a batch of token-id lists.
PromptInput = Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: Optional[StrictBool] = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat (OpenAI ones, then kvserve / vLLM extras)."""

    model: Optional[StrictStr] = None
    n: Optional[StrictInt] = 1
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = 0.0
    frequency_penalty: Optional[Number] = 0.0
    logit_bias: Optional[Dict[str, Number]] = None
    user: Optional[StrictStr] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    # extras
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: Optional[StrictInt] = 0
    stop_token_ids: Optional[List[StrictInt]] = None
    priority: Optional[StrictInt] = 0
    include_stop_str_in_output: Optional[StrictBool] = False
    skip_special_tokens: Optional[StrictBool] = True


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``.

    ``max_tokens`` defaults to 16 (the OpenAI default for this endpoint); ``null`` means "up to
    ``max_model_len``". ``logprobs`` is the number of top alternatives per token (0..20).
    """

    prompt: PromptInput
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None


class TextContentPart(_Request):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(_Request):
    """One conversation message. ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Optional[Union[StrictStr, List[TextContentPart]]] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; when both are absent,
    generation may run to ``max_model_len``. ``top_logprobs`` (0..20) needs ``logprobs=true``.
    """

    messages: List[ChatMessage]
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: Optional[StrictBool] = True
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None


class TokenizeRequest(_Request):
    """Body of ``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = True
    add_generation_prompt: Optional[StrictBool] = True


class DetokenizeRequest(_Request):
    """Body of ``POST /detokenize``."""

    model: Optional[StrictStr] = None
    tokens: List[StrictInt]


# ---------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class UsageInfo(BaseModel):
    """Token counts: ``prompt_tokens`` counts each prompt once (not once per ``n``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per returned token."""

    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion; ``index = prompt_index * n + sample_index``."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    """Response of a non-streamed ``/v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed ``/v1/completions`` (``choices`` empty on the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    """An alternative token and its log-probability."""

    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatLogprobToken(TopLogprob):
    """A generated token with its log-probability and the top alternatives."""

    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """``choices[i].logprobs`` of chat."""

    content: Optional[List[ChatLogprobToken]] = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice."""

    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    """Response of a non-streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class DeltaMessage(BaseModel):
    """The ``delta`` of a chat stream chunk: the role first, then content pieces."""

    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice in a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: List[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``."""

    tokens: List[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str
