"""OpenAI request and response schemas (pydantic)."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.tokenizer.messages import call_arguments

# What msgpack and torch can carry to the engine; add_request stays the semantic validator.
INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
WireInt = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Seed = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]       # int64, as vLLM
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
TopK = Annotated[int, Field(ge=-1, le=TOKEN_ID_MAX)]               # -1 disables


class _Strict(BaseModel):
    """Strict JSON types ("10" is not an int); unknown fields (user, metadata, ...) ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or {"json_schema": {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def schema_text(self) -> str | None:
        """The schema as text (None for "text"); InvalidRequest (400) without a schema object."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON schema object",
                                 param="response_format")
        return json.dumps(schema)


class _GenerationRequest(_Strict):

    model: str | None = None
    n: WireInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: TopK = -1
    min_p: float = 0.0
    min_tokens: WireInt = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # stream migration (server/resume.py)
    return_token_ids: bool = False
    resume_token_ids: list[TokenId] | None = None
    # prefill/decode disaggregation, SGLang's names (docs/disaggregation.md)
    bootstrap_host: str | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    bootstrap_room: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    response_format: ResponseFormat | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequest for an unsupported field; the engine checks ranges."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params = SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias))
        schema = self.response_format.schema_text() if self.response_format is not None else None
        return params if schema is None else dataclasses.replace(params, json_schema=schema)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    # Token arrays before lists of strings in the union.
    prompt: str | list[TokenId] | list[list[TokenId]] | list[str]
    max_tokens: WireInt | None = 16
    echo: bool = False
    logprobs: WireInt | None = None
    suffix: str | None = None
    best_of: WireInt | None = None

    def prompt_items(self) -> list[str | list[int]]:
        """`prompt` (a string, strings, token ids or lists of them) as a list of texts or token ids."""
        raw = self.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]
        return list(raw)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A call in a client's assistant message; `arguments` (JSON object text or an object) kept as the object chat
    templates read (C60, tokenizer/messages.py call_arguments); other text is a 400 naming the field."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments", mode="before")
    @classmethod
    def _parse_arguments(cls, value: Any) -> Any:
        return call_arguments(value) if isinstance(value, str) else value


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message; fields beyond the typed ones are kept for the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """Every field sent, content as one string (text parts joined), call arguments as objects (FunctionCall)."""
        msg = self.model_dump(exclude_none=True)
        msg["content"] = self.text()
        return msg


# OpenAI's characters plus ".:/" (MCP names); nothing that breaks a tool-call format.
FunctionName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:/-]+$")]


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: WireInt | None = None
    max_completion_tokens: WireInt | None = None
    logprobs: bool = False
    top_logprobs: WireInt | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class PromptTokensDetails(BaseModel):
    """OpenAI's, plus `cached_tokens_host` (loaded from the host tier) when that tier is on."""

    model_config = ConfigDict(extra="allow")
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI usage, plus spec_* counts summed over choices under speculative decoding (as SGLang)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """content is None when the reply is only tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatStreamChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # on the finish chunk, as ChatChoice's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixserve"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} -> ((id, bias), ...); InvalidRequest for a key that is not a token id."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 12:
            raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                 param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)
