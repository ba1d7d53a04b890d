"""The OpenAI-compatible API's shapes: request bodies, responses, streamed chunks and the error object.

Request bodies are strict: a boolean is not a number or a token id, unknown fields are refused by
name, and every numeric bound `SamplingParams` enforces (`sampling.FIELD_BOUNDS`) is written into
the schema. Bounds that depend on the engine (the vocabulary, the context, `max_num_seqs`,
`max_logprobs`, the stop-string limits) are added per server by `bounded_request_models`, so the
OpenAPI schema a client reads is the one the server enforces. What a schema cannot say (a prompt
plus `max_tokens` beyond the context, `min_tokens` above `max_tokens`, a JSON schema or regex that does
not compile) is refused with a 400.

Constrained output (lesson 15) comes in three spellings: vLLM's `structured_outputs` (chat and text
completions), OpenAI's `response_format` (chat) and OpenAI's `tools` with a `tool_choice` that names a
function or is "required" (chat; `tools.py`). A request takes one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from ..sampling import FIELD_BOUNDS, SamplingParams, StructuredOutputsParams
from ..sampling.params import RequestOutputKind


def _integral_float_to_int(value: object) -> object:
    """JSON has one number type: 3.0 is an integer there (a boolean stays a boolean and is refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]


def _only_false(value: object) -> object:
    if value is not False:
        raise ValueError("only false is supported")
    return value


Unsupported = Annotated[Literal[False], BeforeValidator(_only_false)]  # a flag we accept only when off


def json_int(**bounds: float) -> Any:
    """A JsonInt within `bounds` (ge, gt, le, lt); the bounds come first, so the schema shows them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float_to_int)]


def _bounded(name: str) -> Any:
    """Field() keyword arguments with the bounds SamplingParams enforces for `name`."""
    bounds = FIELD_BOUNDS[name]
    limits: dict[str, float] = {}
    if bounds.low is not None:
        limits["gt" if bounds.low_open else "ge"] = bounds.low
    if bounds.high is not None:
        limits["le"] = bounds.high
    return limits


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


JsonSchema = dict[str, Any]  # a JSON schema, checked when it is compiled (a 400 naming the field if it does not)


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request field: exactly one constraint (`StructuredOutputsParams`)."""

    json_: JsonSchema | str | None = Field(None, alias="json")  # BaseModel has a method named json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON as an encoder writes it by default (unlike vLLM's default): false allows any whitespace between tokens
    disable_any_whitespace: bool = True

    def params(self) -> StructuredOutputsParams:
        """The constraint; InvalidRequestError naming `structured_outputs.<field>` when it is malformed."""
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object or None,
                                       disable_any_whitespace=self.disable_any_whitespace)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # OpenAI's field is `schema`; pydantic's BaseModel has a method of that name, hence the alias
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _SamplingFields(_Strict):
    """OpenAI's sampling fields and vLLM's extra ones, with SamplingParams' bounds."""

    model: str | None = None
    n: json_int(**_bounded("n")) = 1
    temperature: float = Field(1.0, **_bounded("temperature"))
    top_p: float = Field(1.0, **_bounded("top_p"))
    stop: str | list[str] | None = None
    seed: json_int(**_bounded("seed")) | None = None
    presence_penalty: float = Field(0.0, **_bounded("presence_penalty"))
    frequency_penalty: float = Field(0.0, **_bounded("frequency_penalty"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, passed straight to SamplingParams
    top_k: json_int(**_bounded("top_k")) = -1
    min_p: float = Field(0.0, **_bounded("min_p"))
    repetition_penalty: float = Field(1.0, **_bounded("repetition_penalty"))
    min_tokens: json_int(**_bounded("min_tokens")) = 0
    ignore_eos: bool = False
    stop_token_ids: list[JsonInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: what a server of a disaggregated pair does with the request's KV (serving/kv_agent.py, lesson 18)
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this body: DELTA outputs for a stream, FINAL_ONLY otherwise; `structured`: the
        request's constraint, whichever field gave it (`structured_outputs` unless the caller says otherwise)."""
        if structured is None and self.structured_outputs is not None:
            structured = self.structured_outputs.params()
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured, output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]]
    max_tokens: json_int(**_bounded("max_tokens")) | None = 16  # OpenAI's default for completions
    logprobs: json_int(**_bounded("logprobs")) | None = None
    prompt_logprobs: json_int(**_bounded("prompt_logprobs")) | None = None  # vLLM's extension
    echo: Unsupported = False
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None  # None only for an assistant message that has tool_calls
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, sent back by the client
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: json_int(**_bounded("max_tokens")) | None = None
    max_completion_tokens: json_int(**_bounded("max_tokens")) | None = None
    logprobs: bool = False
    top_logprobs: json_int(**_bounded("logprobs")) | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # with tools, OpenAI's default is "auto" (refused: see tools.py)


class KVTransferInfo(BaseModel):
    """A server's part in KV transfer: its role, and where a consumer receives blocks."""

    kv_role: str
    kv_connector: str
    kv_ip: str | None = None
    kv_port: int | None = None


class PrefixCacheReset(BaseModel):
    """What `POST /reset_prefix_cache` did: the cached blocks it forgot (blocks in use keep their names)."""

    freed_blocks: int


@dataclass(frozen=True)
class EngineLimits:
    """What this server's engine accepts beyond SamplingParams' own bounds."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    max_num_stop_strings: int
    max_stop_string_len: int


def bounded_request_models(limits: EngineLimits) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The two request bodies with this engine's limits written into their fields (and the schema)."""
    token_id = json_int(ge=0, lt=limits.vocab_size)
    stop_string = Annotated[str, Field(min_length=1, max_length=limits.max_stop_string_len)]
    max_tokens = json_int(ge=1, le=max(1, limits.max_model_len - 1))
    logprobs = json_int(ge=0, le=limits.max_logprobs)
    shared: dict[str, Any] = dict(
        n=(json_int(ge=1, le=limits.max_num_seqs), 1),
        stop=(stop_string | Annotated[list[stop_string], Field(max_length=limits.max_num_stop_strings)] | None, None),
        stop_token_ids=(list[token_id] | None, None),
        min_tokens=(json_int(ge=0, le=max(0, limits.max_model_len - 1)), 0),
    )
    prompt_ids = Annotated[list[token_id], Field(min_length=1, max_length=limits.max_model_len - 1)]
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, **shared,
        prompt=(Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                 Field(min_length=1)]
                | prompt_ids | Annotated[list[prompt_ids], Field(min_length=1)], ...),
        max_tokens=(max_tokens | None, 16), logprobs=(logprobs | None, None), prompt_logprobs=(logprobs | None, None))
    chat = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, **shared,
        max_tokens=(max_tokens | None, None), max_completion_tokens=(max_tokens | None, None),
        top_logprobs=(logprobs | None, None))
    return completion, chat


# ------------------------------------------------------------------------------------------ responses
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object; every status other than 200 answers with it."""

    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, float] | None] | None = None  # vLLM's extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first carries its id and name, later ones more of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (the last may carry only `usage`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """One server-sent event of a streamed completion (the last may carry only `usage`)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "llm_runtime"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
