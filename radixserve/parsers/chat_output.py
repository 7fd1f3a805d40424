"""ChatOutputParser: one choice's text through the reasoning split and then the tool-call parser, and the parser names the CLI accepts.

text delta -> ReasoningParser -> Reasoning | Content -> ToolCallParser -> Content | CallStart | CallArgs;
an absent stage passes text through unchanged."""
from __future__ import annotations

import uuid
from collections.abc import Mapping

from radixserve.parsers.events import Content, Event
from radixserve.parsers.json_calls import JsonToolParser, Qwen25ToolParser
from radixserve.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from radixserve.parsers.schema import ToolSpec
from radixserve.parsers.tool_parser import ToolCallParser
from radixserve.parsers.xml_calls import GlmToolParser, Qwen3CoderToolParser

# --tool-call-parser names, as SGLang's; glm47 (GLM-4.7, no newlines) reads with the GLM parser.
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "glm45": GlmToolParser, "glm47": GlmToolParser, "qwen25": Qwen25ToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "json": JsonToolParser}
# --tool-call-parser names whose calls a grammar can enforce in the model's own format (server/native_tools.py)
NATIVE_TOOL_FORMATS = ("qwen25", "glm45", "glm47", "qwen3_coder")
__all__ = ["ChatOutputParser", "NATIVE_TOOL_FORMATS", "REASONING_PARSERS", "TOOL_CALL_PARSERS",
           "new_call_id"]


def new_call_id() -> str:
    """A tool call id in OpenAI's shape: "call_" and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutputParser:
    """`tool_parser`: a TOOL_CALL_PARSERS name (needs `tools`) or None."""

    def __init__(self, tool_parser: str | None = None, tools: Mapping[str, ToolSpec] | None = None,
                 reasoning: bool = False, starts_in_reasoning: bool = False):
        assert tool_parser is None or tools, "a tool parser needs the offered tools"
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning else None
        self._tools = (TOOL_CALL_PARSERS[tool_parser](tools, new_call_id)
                       if tool_parser is not None and tools else None)

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self._reasoning.feed(text) if self._reasoning is not None else [Content(text)]
        return self._through_tools(events)

    def finish(self) -> list[Event]:
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
