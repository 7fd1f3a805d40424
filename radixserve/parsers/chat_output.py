"""ChatOutputParser: one choice's text through the reasoning split and then the tool-call parser, and the parser names the CLI accepts.

    text delta -> ReasoningParser -> Reasoning events
                                  -> Content -> ToolCallParser -> Content / CallStart / CallArgs

Either stage may be absent (no --reasoning-parser; no tools offered or tool_choice "none"):
then text passes through that stage unchanged, so a request without either is plain content.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping

from radixserve.parsers.events import Content, Event
from radixserve.parsers.json_calls import JsonToolParser, Qwen25ToolParser
from radixserve.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from radixserve.parsers.schema import ToolSpec
from radixserve.parsers.tool_parser import ToolCallParser
from radixserve.parsers.xml_calls import GlmToolParser, Qwen3CoderToolParser

# --tool-call-parser names (SGLang's). glm47 is GLM-4.7's tag layout without newlines, which the
# GLM parser reads as well; qwen3_coder is Qwen3-Coder's (and Qwen3.5's) XML layout.
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "glm45": GlmToolParser, "glm47": GlmToolParser, "qwen25": Qwen25ToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "json": JsonToolParser}
# --tool-call-parser names whose calls a grammar can enforce in the model's own format
# (server/native_tools.py)
NATIVE_TOOL_FORMATS = ("qwen25", "glm45", "glm47", "qwen3_coder")
__all__ = ["ChatOutputParser", "NATIVE_TOOL_FORMATS", "REASONING_PARSERS", "TOOL_CALL_PARSERS",
           "new_call_id"]


def new_call_id() -> str:
    """A tool call id in OpenAI's shape: "call_" and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    """Parses one choice's output (module doc). `tool_parser`: a TOOL_CALL_PARSERS name or None;
    `tools`: the functions a call may name (required with a tool parser); `reasoning`: whether
    to split thinking; `starts_in_reasoning`: the prompt opened a `<think>` block."""

    def __init__(self, tool_parser: str | None = None, tools: Mapping[str, ToolSpec] | None = None,
                 reasoning: bool = False, starts_in_reasoning: bool = False):
        assert tool_parser is None or tools, "a tool parser needs the offered tools"
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._tools = (TOOL_CALL_PARSERS[tool_parser](tools, new_call_id)
                       if tool_parser is not None and tools else None)

    @property
    def num_calls(self) -> int:
        """Tool calls committed so far."""
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        """Events the next text delta makes final (possibly none)."""
        if not text:
            return []
        events = self._reasoning.feed(text) if self._reasoning is not None else [Content(text)]
        return self._through_tools(events)

    def finish(self) -> list[Event]:
        """Events for whatever was held when the choice ended."""
        events = self._through_tools(self._reasoning.finish() if self._reasoning else [])
        if self._tools is not None:
            events += self._tools.finish()
        return events

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self._tools is None:
            return events
        out: list[Event] = []
        for ev in events:
            out += self._tools.feed(ev.text) if isinstance(ev, Content) else [ev]
        return out
