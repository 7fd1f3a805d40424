"""Tools and reasoning in /v1/chat/completions: what `tools` / `tool_choice` mean for one request, and its choices' output parsed into OpenAI messages and deltas.

    tool_choice        tools offered    decoding                     calls parsed         finish_reason
                       to the template                                                    after calls
    "none"             no               free                         no                   -
    "auto" (default)   yes              free (strict tools: native)  native format, any   "tool_calls"
    "required"         yes              JSON array of calls          json, any offered    "tool_calls"
    {"function": f}    yes              JSON array of calls to f     json, f only         "stop"

Enforced JSON arrays (tool_schema.py) are read with the `json` parser, no thinking split (as vLLM, SGLang);
`--tool-call-constraint native` or "auto" strict tools force the native format (native_tools.py). docs/tool_calls.md."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.parsers.chat_output import NATIVE_TOOL_FORMATS, ChatOutputParser
from radixserve.parsers.events import CallArgs, CallStart, Content, Event, ParsedMessage, Reasoning
from radixserve.parsers.reasoning import opens_thinking, reasoning_token_count
from radixserve.parsers.schema import ToolSpec
from radixserve.server.protocol import (ChatCompletionRequest, ChatMessageOut, FunctionCallOut,
                                        NamedToolChoice, ToolCallOut)
from radixserve.server.native_tools import NativeCalls
from radixserve.server.tool_schema import calls_schema, object_parameters

PROMPT_TAIL_TOKENS = 16   # enough to see whether the prompt ends inside <think>


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools. None / empty means: none offered, no parsing, no enforced array, no limit, no native tag."""

    template_tools: list[dict[str, Any]] | None
    parse_tools: dict[str, ToolSpec]
    json_schema: str | None = None
    max_calls: int | None = None
    calls_finish_reason: str = "tool_calls"
    native: NativeCalls | None = None


def plan_tools(req: ChatCompletionRequest, tool_call_parser: str | None,
               constraint: str = "json") -> ToolPlan:
    """The module table; `constraint` is --tool-call-constraint. InvalidRequest (400) for duplicate names, a forced
    choice without tools or with response_format, an unknown name, unenforceable parameters, no --tool-call-parser."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise InvalidRequest(f"tools: function name {duplicate!r} appears more than once",
                             param="tools")
    choice = req.tool_choice or ("auto" if tools else "none")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    forced = choice == "required" or named is not None
    if forced and not tools:
        raise InvalidRequest(f"tool_choice {named or choice!r} needs tools", param="tool_choice")
    if named is not None and named not in names:
        raise InvalidRequest(f"tool_choice names function {named!r}, which is not in tools",
                             param="tool_choice")
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequest("response_format cannot be combined with tool_choice "
                             f"{named or choice!r}: both decide the form of the whole reply",
                             param="response_format")
    if choice == "none" or not tools:
        return ToolPlan(None, {})
    if tool_call_parser is None and not forced:
        raise InvalidRequest("tools are not supported: this server was started without "
                             "--tool-call-parser", param="tools")
    specs = {t.function.name: ToolSpec(t.function.name, t.function.parameters or {}) for t in tools}
    allowed = {named: specs[named]} if named is not None else specs
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    max_calls = None if req.parallel_tool_calls else 1
    native_format = tool_call_parser in NATIVE_TOOL_FORMATS
    if not forced:
        strict = {t.function.name for t in tools if t.function.strict}
        free = req.response_format is None or req.response_format.type == "text"
        native = (NativeCalls(tool_call_parser, tuple((n, object_parameters(s) if n in strict else None)
                                                      for n, s in allowed.items()), False, max_calls == 1)
                  if strict and free and native_format else None)
        return ToolPlan(template_tools, allowed, max_calls=max_calls, native=native)
    finish = "stop" if named is not None else "tool_calls"
    if constraint == "native" and native_format:
        functions = tuple((n, object_parameters(s)) for n, s in allowed.items())
        return ToolPlan(template_tools, allowed, None, max_calls, finish,
                        NativeCalls(tool_call_parser, functions, True, max_calls == 1))
    return ToolPlan(template_tools, allowed, calls_schema(list(allowed.values()), max_calls is None),
                    max_calls, finish)


class ChatOutputs:
    """One ChatOutputParser per choice, shared by streams and full responses; `prompt_tail` may open <think>."""

    def __init__(self, plan: ToolPlan, tool_call_parser: str | None, reasoning: bool,
                 prompt_tail: str):
        enforced = plan.json_schema is not None
        self._tool_parser = "json" if enforced else tool_call_parser if plan.parse_tools else None
        self._tools = plan.parse_tools
        self._reasoning = reasoning and not enforced
        self._starts_in_reasoning = self._reasoning and opens_thinking(prompt_tail)
        self._max_calls = plan.max_calls
        self._calls_finish_reason = plan.calls_finish_reason
        self._streams: dict[int, ChatOutputParser] = {}

    @property
    def reasoning(self) -> bool:
        return self._reasoning

    @property
    def starts_in_reasoning(self) -> bool:
        return self._starts_in_reasoning

    @property
    def is_parsing(self) -> bool:
        return self._tool_parser is not None or self._reasoning

    def _new_parser(self) -> ChatOutputParser:
        return ChatOutputParser(self._tool_parser, self._tools, self._reasoning,
                                self._starts_in_reasoning)

    def _kept(self, events: list[Event]) -> list[Event]:
        if self._max_calls is None:
            return events
        return [e for e in events
                if not isinstance(e, (CallStart, CallArgs)) or e.index < self._max_calls]

    def reasoning_tokens(self, choices_ids: list[list[int]],
                         decode: Callable[[Sequence[int]], str]) -> int | None:
        """usage.reasoning_tokens summed over the choices; None when no reasoning is split."""
        if not self._reasoning:
            return None
        return sum(reasoning_token_count(ids, decode, self._starts_in_reasoning) for ids in choices_ids)

    def _finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        return self._calls_finish_reason if reason == "stop" and num_calls else reason

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        parser = self._new_parser()
        parsed = ParsedMessage()
        parsed.add(self._kept(parser.feed(text) + parser.finish()))
        calls = [ToolCallOut(id=c.call_id, function=FunctionCallOut(name=c.name,
                                                                   arguments=c.arguments))
                 for c in parsed.calls]
        message = ChatMessageOut(content=parsed.content if parsed.content or not calls else None,
                                 reasoning_content=parsed.reasoning or None,
                                 tool_calls=calls or None)
        return message, self._finish_reason(finish_reason, len(calls))

    def delta(self, index: int, text: str, finished: bool) -> dict[str, Any]:
        parser = self._streams.get(index)
        if parser is None:
            parser = self._streams[index] = self._new_parser()
        events = parser.feed(text)
        if finished:
            events += parser.finish()
        return stream_delta(self._kept(events))

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        parser = self._streams.get(index)
        return self._finish_reason(reason, parser.num_calls if parser is not None else 0)


def stream_delta(events: list[Event]) -> dict[str, Any]:
    """OpenAI delta fields; a call's first entry also carries "id", "type" and the name."""
    delta: dict[str, Any] = {}
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    calls: dict[int, dict[str, Any]] = {}
    for ev in events:
        if isinstance(ev, CallStart):
            calls[ev.index] = {"index": ev.index, "id": ev.call_id, "type": "function",
                               "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, CallArgs):
            entry = calls.setdefault(ev.index, {"index": ev.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += ev.text
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta


def prompt_tail(tokenizer: Any, prompt_ids: list[int]) -> str:
    return tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
