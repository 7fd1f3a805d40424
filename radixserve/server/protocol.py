"""OpenAI request and response schemas (pydantic)."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams

# Wire bounds (issue 11): every integer that crosses to the engine process must be one msgpack
# and torch can hold, or encoding fails after the request was registered. These are
# representability bounds only; the engine's add_request (SamplingParams.validate, the prompt
# and context checks) stays the one semantic validator, vocabulary included.
INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1     # ids index int32/int64 tensors; no vocabulary comes near
WireInt = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]    # counts: n, max_tokens, ...
Seed = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]       # int64, as vLLM; -1 is common
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
TopK = Annotated[int, Field(ge=-1, le=TOKEN_ID_MAX)]               # -1 disables; k > vocab keeps all


class _Strict(BaseModel):
    """Strict JSON types ("10" is not an int, "yes" is not a bool); unknown fields are ignored,
    as OpenAI clients send fields this server has no use for (user, metadata, ...)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions, including the vLLM/SGLang
    extras (top_k, min_p, ...)."""

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
    # extras
    top_k: TopK = -1
    min_p: float = 0.0
    min_tokens: WireInt = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # stream migration (router only, server/resume.py): each stream chunk's token ids, and
    # a stream resumed after output tokens another worker delivered
    return_token_ids: bool = False
    resume_token_ids: list[TokenId] | None = None
    # prefill/decode disaggregation (SGLang's names; the router sets them on both legs):
    # the prefill worker's bootstrap address and the room both legs share (docs/disaggregation.md)
    bootstrap_host: str | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    bootstrap_room: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The SamplingParams of the request (n choices); raises InvalidRequest for an
        unsupported field. Ranges are checked once, by the engine's add_request."""
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
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    # Order matters for the union: token arrays before lists of strings.
    prompt: str | list[TokenId] | list[list[TokenId]] | list[str]
    max_tokens: WireInt | None = 16
    echo: bool = False
    logprobs: WireInt | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A function call in an assistant message the client sends back; `arguments` is the
    JSON text OpenAI gives out (an object is taken as well)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


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
    tool_calls: list[ToolCallIn] | None = None     # assistant: the calls it made
    tool_call_id: str | None = None                # tool: which call this is the result of
    reasoning_content: str | None = None           # assistant: its thinking (some templates show it)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: every field the client sent, content as one
        string, and each tool call's arguments as an object (templates iterate or re-encode
        them; a JSON string would come out quoted twice). Arguments that are not a JSON object
        stay as sent."""
        msg = self.model_dump(exclude_none=True)
        msg["content"] = self.text()
        for call in msg.get("tool_calls", ()):
            args = call["function"]["arguments"]
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    continue
                if isinstance(parsed, dict):
                    call["function"]["arguments"] = parsed
        return msg


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or {"json_schema": {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must match, as text (None for "text"). Raises
        InvalidRequest when a json_schema format has no schema object."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON schema object",
                                 param="response_format")
        return json.dumps(schema)


# A function name: what OpenAI allows plus ".", ":" and "/" (MCP-style names); never spaces,
# quotes or angle brackets, which would break the tool-call formats models write.
FunctionName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:/-]+$")]


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None    # JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: only that function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: WireInt | None = None
    max_completion_tokens: WireInt | None = None
    logprobs: bool = False
    top_logprobs: WireInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True     # false: at most one call per choice
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """As for completions, plus response_format's schema (structured output)."""
        params = super().sampling_params(max_tokens, logprobs, prompt_logprobs)
        schema = self.response_format.schema_text() if self.response_format is not None else None
        return params if schema is None else dataclasses.replace(params, json_schema=schema)


# ---- responses ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    """OpenAI's; with the host KV tier on it also carries `cached_tokens_host`: how many of
    cached_tokens were loaded back from host memory (the rest were on the device)."""

    model_config = ConfigDict(extra="allow")
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI usage; with speculative decoding it also carries (as SGLang's meta_info does)
    spec_verify_steps, spec_draft_tokens, spec_accepted_tokens, spec_accept_length (tokens per
    verify step) and spec_accept_rate (accepted / draft tokens), summed over choices."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI legacy logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")    # token_ids (return_token_ids)
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
    arguments: str          # a JSON object text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """The assistant message: content is None when the reply is only tool calls;
    reasoning_content (--reasoning-parser) and tool_calls are None when there are none."""

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
    model_config = ConfigDict(extra="allow")    # token_ids (return_token_ids)
    index: int
    # any of "role", "content", "reasoning_content", "tool_calls" (a list of {"index", and on a
    # call's first delta "id", "type", then "function": {"name" once, "arguments" fragment}});
    # absent keys stay absent
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


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
    """OpenAI's {"token id": bias} -> ((id, bias), ...); ranges are checked by the engine.
    Raises InvalidRequest for a key that is not a non-negative integer."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 12:
            raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                                 param="logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)
