"""ToolCallParser: the incremental base every tool-call format shares (content outside calls, call bookkeeping, failure rules).

    text:   ... content ... <marker> call ... </end> ... content ... <marker> call ...
    state:  TEXT            CALL (uncommitted -> committed)         TEXT

An uncommitted call sends nothing (malformed: out as content); a committed one (CallStart sent) is never
taken back. Whitespace only between content and a call is dropped; chunking never changes the result."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from radixserve.parsers.arguments import ArgumentsWriter
from radixserve.parsers.events import CallArgs, CallStart, Content, Event
from radixserve.parsers.scan import Trimmer, held_prefix_len
from radixserve.parsers.schema import ToolSpec


class ToolCallParser:
    """A format sets `start_marker` and implements `_step_call`; `tools`: the functions a call may name."""

    start_marker = "<tool_call>"

    def __init__(self, tools: Mapping[str, ToolSpec], new_call_id: Callable[[], str]):
        self.tools = tools
        self._new_call_id = new_call_id
        self._buf = ""
        self._events: list[Event] = []
        self._text = Trimmer()
        self._in_call = False
        self._marker_text = ""       # sent as content if the call is rejected
        self._writer: ArgumentsWriter | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        assert not self._in_call and not self._buf, "a format left text at the end"
        held = self._text.flush()
        if held and self.num_calls == 0:
            self._events.append(Content(held))
        return self._take()

    def _run(self, final: bool) -> None:
        while self._step_call(final) if self._in_call else self._step_text(final):
            pass

    def _step_text(self, final: bool) -> bool:
        at = self._buf.find(self.start_marker)
        if at < 0:
            keep = 0 if final else held_prefix_len(self._buf, (self.start_marker,))
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:at])
        self._buf = self._buf[at + len(self.start_marker):]
        self._enter_call(self.start_marker)
        return True

    def _content(self, text: str) -> None:
        body = self._text.push(text)
        if body:
            self._events.append(Content(body))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _enter_call(self, marker_text: str) -> None:
        self._marker_text = marker_text
        self._in_call = True
        self._begin_call()

    def _begin_call(self) -> None:
        """Reset the format's per-call state."""

    def _step_call(self, final: bool) -> bool:
        """Read as much of the call in `_buf` as is final; True when progress was made."""
        raise NotImplementedError

    def _start_call(self, name: str) -> None:
        self._text.drop_held()
        self._events.append(CallStart(self.num_calls, self._new_call_id(), name))
        self.num_calls += 1
        self._writer = ArgumentsWriter()

    def _args(self, fragment: str) -> None:
        if fragment:
            self._events.append(CallArgs(self.num_calls - 1, fragment))

    def _end_call(self) -> None:
        """End the committed call, closing its arguments; `_buf` is read as text next."""
        assert self._writer is not None, "no committed call to end"
        if not self._writer.closed:
            self._args(self._writer.close())
        self._writer = None
        self._in_call = False
        self._text.strip_next()

    def _reject_call(self) -> None:
        """A malformed uncommitted call: its marker goes out as content, `_buf` is read as text."""
        assert self._writer is None, "a committed call cannot be rejected"
        self._content(self._marker_text)
        self._in_call = False

    @property
    def writer(self) -> ArgumentsWriter:
        assert self._writer is not None, "no committed call"
        return self._writer
