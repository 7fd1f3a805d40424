"""What the output parsers emit (content, reasoning, tool-call starts and argument fragments) and their fold into one message.

A parser turns text deltas into a list of events; the events of a whole reply, in order,
describe the message completely. Streaming sends each feed's events as they come; a full
response folds all of them with `ParsedMessage`, so the two can only differ in how the text
was split, never in what it says (field case C43):

    content    = "".join(Content.text)
    reasoning  = "".join(Reasoning.text)
    call i     = CallStart(i) then "".join(CallArgs(i).text), a JSON object once the call ends
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Content:
    """Answer text outside any tool call and outside thinking."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Thinking text (what a `<think>` block held)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Tool call number `index` (0, 1, ... within the choice) begins; its name is final."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    """The next fragment of call `index`'s arguments, a JSON object text once all are joined."""

    index: int
    text: str


Event = Content | Reasoning | CallStart | CallArgs


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One finished tool call: `arguments` is a JSON object text."""

    call_id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedMessage:
    """The events of one reply folded into a message (the non-streaming response)."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        """Fold events in the order the parser emitted them."""
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
