"""What the output parsers emit (content, reasoning, tool-call starts and argument fragments) and their fold into one message.

A reply's events, in order, describe the message completely: streaming sends them as they come,
a full response folds them with `ParsedMessage`, so the two differ only in how the text was split."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Tool call number `index` (0, 1, ... within the choice) begins; its name is final."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    text: str


Event = Content | Reasoning | CallStart | CallArgs


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedMessage:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, Content):
                self.content += ev.text
            elif isinstance(ev, Reasoning):
                self.reasoning += ev.text
            elif isinstance(ev, CallStart):
                assert ev.index == len(self.calls), f"call {ev.index} started out of order"
                self.calls.append(ToolCall(ev.call_id, ev.name, ""))
            else:
                call = self.calls[ev.index]
                self.calls[ev.index] = ToolCall(call.call_id, call.name, call.arguments + ev.text)
