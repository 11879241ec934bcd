"""Pydantic models of the OpenAI-compatible HTTP API (requests, responses, errors).

Request models type-check strictly: a JSON ``2.5`` or ``"10"`` is never silently turned into an
integer, a string is never turned into a number. Every numeric field carries the range of
``kvserve.field_limits.LIMITS`` as pydantic constraints (the same limits ``SamplingParams``
checks offline, so a value the engine cannot represent, e.g. ``top_k = 2**63``, is a 400 naming
the field and the limit); finer rules (``top_k != 0``, ``min_tokens <= max_tokens``) and the
engine's own limits (vocabulary, ``max_model_len``, ``max_num_seqs``) are checked after.

Unknown fields: every request model forbids fields it does not declare, so a field kvserve does
not implement is a 400 naming it (never a 200 that silently ignores it). A field is accepted
only when it is declared on the model: implemented, or one of ``HARMLESS_FIELDS`` (accepted
and ignored because they never change the tokens generated).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

from kvserve.field_limits import LIMITS, MAX_TENANT_CHARS, tenant_name_problem

#: A finite JSON number (int or float), never a string, a bool, NaN or Infinity.
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def _bounds(name: str, integer: bool) -> Any:
    """The pydantic ``Field`` constraints of numeric field ``name``: the range of
    ``LIMITS[name]``. ``integer`` states the field's kind as its annotation declares it
    (``StrictInt`` or ``Number``); raises TypeError when it disagrees with ``LIMITS``, so the
    static annotation and the shared limit cannot drift apart."""
    limit = LIMITS[name]
    if limit.integer != integer:
        raise TypeError(f"{name}: LIMITS says integer={limit.integer}, the annotation {integer}")
    return Field(**limit.pydantic_bounds())


def _int(name: str) -> Any:
    """Metadata of an integer field: ``Annotated[StrictInt, _int(name)]``."""
    return _bounds(name, integer=True)


def _num(name: str) -> Any:
    """Metadata of a real-valued field: ``Annotated[Number, _num(name)]``."""
    return _bounds(name, integer=False)


TokenId = Annotated[StrictInt, _int("token_id")]

#: ``prompt`` of /v1/completions: text, a batch of texts, token ids, or a batch of token-id lists.
PromptInput = StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]


#: Fields accepted and ignored (per route): they are about billing, logging, storage or
#: routing on OpenAI's side and never change the tokens generated. Any other field that a model
#: below does not declare is a 400 naming it.
HARMLESS_FIELDS: dict[str, tuple[str, ...]] = {
    "completions": (),
    "chat": (
        "safety_identifier",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    ),
}


def _tenant_name(value: str) -> str:
    problem = tenant_name_problem("user", value)
    if problem is not None:
        raise ValueError(problem)
    return value


#: ``user``: the tenant the request is served for (``SequenceGroup.tenant``; the ``fair``
#: scheduling policy shares service between tenants), at most ``MAX_TENANT_CHARS`` characters,
#: no control characters (it becomes a /metrics label and a request-log field).
User = Annotated[StrictStr, Field(max_length=MAX_TENANT_CHARS), AfterValidator(_tenant_name)]


class _Request(BaseModel):
    # A field not declared here is unknown: 400 naming it (see the module docstring).
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: StrictBool | None = False


class JsonSchemaSpec(_Request):
    """``response_format.json_schema``: ``{"name", "description", "schema", "strict"}`` (any
    other key is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` object (exactly one of the constraint kinds)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | dict[str, Any] | None = None
    disable_any_whitespace: StrictBool | None = False
    whitespace_pattern: StrictStr | None = None
    # an unknown key (a misspelt kind, an option kvserve lacks) is a 400 naming it
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingFields(_Request):
    """Fields shared by completions and chat (OpenAI ones, then kvserve / vLLM extras)."""

    model: StrictStr | None = None
    n: Annotated[StrictInt, _int("n")] | None = 1
    temperature: Annotated[Number, _num("temperature")] | None = None
    top_p: Annotated[Number, _num("top_p")] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, _int("seed")] | None = None
    presence_penalty: Annotated[Number, _num("presence_penalty")] | None = 0.0
    frequency_penalty: Annotated[Number, _num("frequency_penalty")] | None = 0.0
    logit_bias: dict[str, Annotated[Number, _num("logit_bias")]] | None = None
    user: User | None = None  # the tenant
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # extras
    top_k: Annotated[StrictInt, _int("top_k")] | None = None
    min_p: Annotated[Number, _num("min_p")] | None = None
    repetition_penalty: Annotated[Number, _num("repetition_penalty")] | None = None
    ignore_eos: StrictBool | None = False
    min_tokens: Annotated[StrictInt, _int("min_tokens")] | None = 0
    stop_token_ids: list[TokenId] | None = None
    priority: Annotated[StrictInt, _int("priority")] | None = 0
    include_stop_str_in_output: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True
    prompt_logprobs: Annotated[StrictInt, _int("prompt_logprobs")] | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[TokenId] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, _int("truncate_prompt_tokens")] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``.

    ``max_tokens`` defaults to the model's ``max_new_tokens`` (generation_config.json), else
    16 (the OpenAI default for this endpoint); ``null`` means "up to
    ``max_model_len``". ``logprobs`` is the number of top alternatives per token (0..20); with
    ``echo`` the prompt's tokens come first in the logprobs too (the first one's logprob null).
    ``prompt_logprobs`` (vLLM's) adds ``choices[i].prompt_logprobs``. ``use_beam_search``
    runs beam search of width ``best_of`` (or ``n``) and returns the ``n`` best beams; without
    it, ``best_of > n`` samples ``best_of`` completions and returns the ``n`` with the highest
    cumulative logprob (not streamed).
    """

    prompt: PromptInput
    max_tokens: Annotated[StrictInt, _int("max_tokens")] | None = 16
    logprobs: Annotated[StrictInt, _int("logprobs")] | None = None
    echo: StrictBool | None = False
    best_of: Annotated[StrictInt, _int("best_of")] | None = None
    suffix: StrictStr | None = None
    # vLLM's beam search fields: beam width = best_of (or n); the n best beams are returned
    use_beam_search: StrictBool | None = False
    length_penalty: Annotated[Number, _num("length_penalty")] | None = 1.0


class TextContentPart(_Request):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: StrictStr
    text: StrictStr | None = None


class MessageFunctionCall(_Request):
    """``function`` of a tool call in the history: the name and the arguments as JSON text."""

    name: StrictStr
    arguments: StrictStr


class MessageToolCall(_Request):
    """A tool call of an earlier assistant message (as a response's ``tool_calls`` gave it)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Request):
    """One conversation message. ``content`` may be a string or a list of text parts; an
    assistant message may carry ``tool_calls``, a ``tool`` message the ``tool_call_id`` it
    answers.

    OpenAI's other assistant-message fields (``refusal``, ``audio``, ``function_call``,
    ``annotations``) are accepted only empty (``null``, or ``[]`` for ``annotations``), the
    shape a client gets back from a response and sends along in the history: a value in them
    would be part of the conversation the template never shows, so it is a 400 naming it
    (see ``ChatMessage.unused_fields``). Any other key is a 400 naming it."""

    role: StrictStr
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    def unused_fields(self) -> list[str]:
        """The OpenAI message fields set to a value kvserve would not show the model."""
        return [
            name
            for name in ("refusal", "audio", "function_call", "annotations")
            if getattr(self, name) not in (None, [])
        ]


class FunctionDefinition(_Request):
    """A tool's ``function``: its name, description and JSON schema of the arguments."""

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(_Request):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


#: Most messages in one conversation. Validating and rendering each message holds the GIL, so
#: an unbounded conversation stalls every other connection; past the cap a request is a 400
#: naming ``messages`` and the cap, before any template rendering or tokenization.
MAX_CHAT_MESSAGES = 10_000
Messages = Annotated[list[ChatMessage], Field(max_length=MAX_CHAT_MESSAGES)]


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; when both are absent,
    generation may run to ``max_model_len``. ``top_logprobs`` (0..20) needs ``logprobs=true``.
    ``tools`` / ``tool_choice`` / ``parallel_tool_calls``: see ``tools.plan_tools``.
    ``chat_template`` (only on a server started with ``--trust-request-chat-template``) and
    ``chat_template_kwargs`` (extra template variables, e.g. ``{"enable_thinking": false}``):
    see ``OpenAIServingChat.template_for``.
    """

    messages: Messages
    max_tokens: Annotated[StrictInt, _int("max_tokens")] | None = None
    max_completion_tokens: Annotated[StrictInt, _int("max_completion_tokens")] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, _int("top_logprobs")] | None = None
    add_generation_prompt: StrictBool | None = True
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # harmless (HARMLESS_FIELDS["chat"]): accepted, never used
    safety_identifier: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """Body of ``POST /tokenize``: either ``prompt`` or chat ``messages`` (rendered as a chat
    completion's are, ``chat_template`` and ``chat_template_kwargs`` included)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Messages | None = None
    add_special_tokens: StrictBool | None = True
    add_generation_prompt: StrictBool | None = True
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    """Body of ``POST /detokenize``."""

    model: StrictStr | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Request):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's names): serve the PEFT adapter in
    directory ``lora_path`` under the model name ``lora_name``."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """Body of ``POST /v1/unload_lora_adapter``: stop serving the adapter ``lora_name``."""

    lora_name: StrictStr = Field(min_length=1)


# ---------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def system_fingerprint() -> str:
    """``system_fingerprint`` of every completion and chunk: the server and its version
    (``kvserve-0.1.0``), as vLLM sends ``vllm-<version>-...``."""
    import kvserve  # at call time: the package may still be loading when this module is imported

    return f"kvserve-{kvserve.__version__}"


class _VLLMResponseFields(BaseModel):
    """Top-level fields vLLM's completion and chat answers always carry, null here: kvserve has
    no service tiers, KV or encoder-cache transfer between servers, or per-request metrics
    object; clients written against vLLM may index them."""

    service_tier: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None


class UsageInfo(BaseModel):
    """Token counts: ``prompt_tokens`` counts each prompt once (not once per ``n``).
    ``*_details``: null (OpenAI's breakdowns; vLLM sends them null too, and leaves them out of
    a stream's usage chunk)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: None = None
    completion_tokens_details: None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per returned token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's log-probability at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs``: None for the first prompt token, then ``{token_id: Logprob}``.
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One choice of a completion; ``index = prompt_index * n + sample_index``.
    ``token_ids``, ``prompt_token_ids``, ``routed_experts``: vLLM's fields, null here (as in
    vLLM when not asked for)."""

    #: fields a stream chunk carries even when null (``serving_engine.stream_dict``), as vLLM's do
    NULL_IN_STREAM: ClassVar[frozenset[str]] = frozenset(
        {"logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids"}
    )

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: None = None
    prompt_token_ids: None = None
    routed_experts: None = None


class CompletionResponse(_VLLMResponseFields):
    """Response of a non-streamed ``/v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = Field(default_factory=system_fingerprint)


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed ``/v1/completions`` (``choices`` empty on the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = Field(default_factory=system_fingerprint)


class TopLogprob(BaseModel):
    """An alternative token and its log-probability."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    """A generated token with its log-probability and the top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """``choices[i].logprobs`` of chat."""

    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    """``tool_calls[i].function``: the name and the arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice (``tool_calls`` when the model called tools).
    ``reasoning_content`` / ``reasoning``: the model's thinking, split off by the server's
    ``--reasoning-parser`` (both names carry the same text: vLLM's earlier and current field)."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    # OpenAI's and vLLM's message fields for what kvserve never produces: always null
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: None = None  # vLLM's, null unless asked for (kvserve never returns them)
    routed_experts: None = None  # vLLM's (mixture-of-experts routing), null


class ChatCompletionResponse(_VLLMResponseFields):
    """Response of a non-streamed ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = Field(default_factory=system_fingerprint)
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: None = None  # vLLM's, null unless asked for (kvserve never returns them)
    prompt_text: None = None


class DeltaFunctionCall(BaseModel):
    """A piece of a streamed tool call's function: the name once, then argument text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call piece: ``index`` of the call; ``id`` and ``type`` on its first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """The ``delta`` of a chat stream chunk: the role first, then reasoning, content or tool
    call pieces (``reasoning_content`` and ``reasoning`` carry the same text)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice in a chat stream chunk."""

    NULL_IN_STREAM: ClassVar[frozenset[str]] = frozenset(
        {"logprobs", "finish_reason", "stop_reason", "token_ids"}
    )

    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion."""

    NULL_IN_STREAM: ClassVar[frozenset[str]] = frozenset({"prompt_token_ids", "prompt_text"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = Field(default_factory=system_fingerprint)
    prompt_token_ids: None = None
    prompt_text: None = None


class ModelPermission(BaseModel):
    """An entry of a model card's ``permission`` (OpenAI's legacy shape, which vLLM still
    sends): what a client may do with the model; fixed values."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex[:16]}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    #: a LoRA adapter's base model (None for the base model itself)
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])
    #: the default sampling parameters of requests that leave them out (from the model's
    #: generation_config.json; ``--generation-config``); None for an adapter's card
    generation_defaults: dict[str, float | int] | None = None
    #: what the model serves: ``generate`` (completions, chat) or ``embed`` (embeddings,
    #: pooling, score, rerank)
    task: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: None = None  # vLLM's, null unless asked for (kvserve never returns them)


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str


class ResponsesFunctionTool(_Request):
    """One ``tools`` entry of ``/v1/responses``: ``{"type": "function", "name", "description",
    "parameters", "strict"}`` (the function's fields flat, not under ``function``)."""

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponsesTextFormat(_Request):
    """``text.format`` of ``/v1/responses``: ``text``, ``json_object``, or ``json_schema`` with
    its ``name`` / ``schema`` / ``description`` / ``strict`` flat."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponsesText(_Request):
    """``text`` of ``/v1/responses``: its ``format`` (``verbosity`` is accepted, unused)."""

    format: ResponsesTextFormat | None = None
    verbosity: StrictStr | None = None


class ResponsesRequest(_Request):
    """Body of ``POST /v1/responses`` (OpenAI's Responses API), run as a chat completion:
    ``instructions`` is a system message, ``input`` a string (one user message) or a list of
    message / ``function_call`` / ``function_call_output`` items, ``previous_response_id``
    continues a stored conversation. Fields left out here are a 400 naming them."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, _int("max_tokens")] | None = None
    temperature: Annotated[Number, _num("temperature")] | None = None
    top_p: Annotated[Number, _num("top_p")] | None = None
    seed: Annotated[StrictInt, _int("seed")] | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponsesText | None = None
    stream: StrictBool | None = False
    store: StrictBool | None = True
    # harmless: accepted, never change the tokens generated
    metadata: dict[str, Any] | None = None
    user: User | None = None  # the tenant (passed on to the chat request)
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    truncation: Literal["disabled"] | None = None


# ---------------------------------------------------------------------- pooling routes
class EmbeddingRequest(_Request):
    """Body of ``POST /v1/embeddings`` (and ``POST /pooling``): ``input`` is a text, a list of
    texts, a token-id list or a list of them (each one embedding, in order).
    ``encoding_format``: ``float`` (lists of numbers) or ``base64`` (the float32 little-endian
    bytes). ``dimensions``: the first ``dimensions`` components (Matryoshka models only).
    ``truncate_prompt_tokens``: keep an over-long input's last tokens (else it is a 400).
    ``normalize`` (vLLM's): L2-normalise, over the model's setting."""

    model: StrictStr | None = None
    input: PromptInput
    encoding_format: StrictStr | None = "float"
    dimensions: StrictInt | None = None
    user: User | None = None
    truncate_prompt_tokens: StrictInt | None = None
    normalize: StrictBool | None = None
    priority: StrictInt | None = None


class ScoreRequest(_Request):
    """Body of ``POST /score``: ``text_1`` against each ``text_2`` (one text against many, or
    pairwise lists of equal length); the score is the cosine similarity of their embeddings."""

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    user: User | None = None
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt | None = None


class RerankRequest(_Request):
    """Body of ``POST /rerank``: ``documents`` ordered by the cosine similarity of their
    embedding to the ``query``'s; ``top_n`` of them (all when left out or 0)."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt | None = None
    return_documents: StrictBool | None = True
    user: User | None = None
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt | None = None


class EmbeddingData(BaseModel):
    """One embedding of ``/v1/embeddings`` (``object`` ``"embedding"``) or ``/pooling``
    (``"pooling"``, the vector in ``data``)."""

    index: int
    object: str = "embedding"
    embedding: list[float] | str | None = None
    data: list[float] | str | None = None


class EmbeddingResponse(BaseModel):
    """The answer of ``/v1/embeddings`` and ``/pooling``."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[dict[str, Any]]
    usage: UsageInfo


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    """The answer of ``/score``."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankResult(BaseModel):
    index: int
    document: dict[str, str] | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    """The answer of ``/rerank``: ``results`` by descending ``relevance_score``."""

    id: str
    model: str
    usage: UsageInfo
    results: list[RerankResult]
