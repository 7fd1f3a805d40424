"""ToolCallParser: the incremental base every tool-call format shares (content outside calls, call bookkeeping, failure rules).

One parser object per choice serves streaming and non-streaming alike: `feed()` each text
delta, then `finish()`; a full response feeds the whole text once. Decisions depend only on the
text seen so far, never on how it was split, so joined events are the same at any chunking.

    text:   ... content ... <marker> call ... </end> ... content ... <marker> call ...
    state:  TEXT            CALL (uncommitted -> committed)         TEXT

A call is *uncommitted* until the format has read enough of it to know it is a call: nothing
of it is sent, and if it turns out malformed (unknown name, wrong shape, bad JSON, the reply
ends) its text, marker included, goes out as content. Once *committed* (CallStart sent) a call
is never taken back. JSON formats commit a call only once it is read whole and valid; GLM
commits at the function name and streams arguments after it, so if the rest of a GLM call is
broken the arguments object is closed where the good part ends and the rest is read as text.

Whitespace that only separates content from a call is dropped: trailing whitespace is held
until non-space text follows (sent), a call commits (dropped) or the reply ends (sent when no
call was made), and whitespace right after a call is dropped.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from radixserve.parsers.arguments import ArgumentsWriter
from radixserve.parsers.events import CallArgs, CallStart, Content, Event
from radixserve.parsers.scan import Trimmer, held_prefix_len
from radixserve.parsers.schema import ToolSpec


class ToolCallParser:
    """Base class; a format sets `start_marker` and implements `_step_call` (and may replace
    `_step_text`). `tools`: the functions a call may name (others are malformed calls);
    `new_call_id()`: the id of each committed call."""

    start_marker = "<tool_call>"

    def __init__(self, tools: Mapping[str, ToolSpec], new_call_id: Callable[[], str]):
        self.tools = tools
        self._new_call_id = new_call_id
        self._buf = ""               # text received and not yet consumed
        self._events: list[Event] = []
        self._text = Trimmer()
        self._in_call = False
        self._marker_text = ""       # the text that opened the current call (sent on rejection)
        self._writer: ArgumentsWriter | None = None   # the committed call's arguments
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        """Events that `text` (the next piece of content) makes final."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The reply ended: settle whatever was held (an open call is closed)."""
        self._run(final=True)
        assert not self._in_call and not self._buf, "a format left text at the end"
        held = self._text.flush()
        if held and self.num_calls == 0:
            self._events.append(Content(held))
        return self._take()

    # ---- text -------------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while self._step_call(final) if self._in_call else self._step_text(final):
            pass

    def _step_text(self, final: bool) -> bool:
        """Send content up to the next start marker and enter the call; True when it did."""
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

    # ---- calls (for the formats) --------------------------------------------------------------
    def _enter_call(self, marker_text: str) -> None:
        """`marker_text` (already consumed) opened a call; read it next."""
        self._marker_text = marker_text
        self._in_call = True
        self._begin_call()

    def _begin_call(self) -> None:
        """Reset the format's per-call state (the start marker was just consumed)."""

    def _step_call(self, final: bool) -> bool:
        """Read as much of the call in `_buf` as is final; True when progress was made."""
        raise NotImplementedError

    def _start_call(self, name: str) -> None:
        """Commit the call: send CallStart; arguments follow through `_args`."""
        self._text.drop_held()
        self._events.append(CallStart(self.num_calls, self._new_call_id(), name))
        self.num_calls += 1
        self._writer = ArgumentsWriter()

    def _args(self, fragment: str) -> None:
        if fragment:
            self._events.append(CallArgs(self.num_calls - 1, fragment))

    def _end_call(self) -> None:
        """End the committed call, closing its arguments if still open; what follows in `_buf`
        is read as text."""
        assert self._writer is not None, "no committed call to end"
        if not self._writer.closed:
            self._args(self._writer.close())
        self._writer = None
        self._in_call = False
        self._text.strip_next()

    def _reject_call(self) -> None:
        """An uncommitted call was malformed: the marker text that opened it goes out as
        content, and `_buf` (nothing of the call is consumed before it commits) is read as text."""
        assert self._writer is None, "a committed call cannot be rejected"
        self._content(self._marker_text)
        self._in_call = False

    @property
    def writer(self) -> ArgumentsWriter:
        assert self._writer is not None, "no committed call"
        return self._writer
