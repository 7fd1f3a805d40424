"""Reasoning output (`--reasoning-parser glm45|qwen3`): `<think>` ... `</think>` text becomes reasoning, the rest content.

The reply opens `<think>` itself, or the prompt did (`opens_thinking`), or there is no block (all content); an unclosed
block is all reasoning. Whitespace at the reasoning's edges and before the content is dropped."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from radixserve.parsers.events import Content, Event, Reasoning
from radixserve.parsers.scan import Trimmer, held_prefix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("glm45", "qwen3")


def reasoning_token_count(ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                          starts_in_reasoning: bool = False) -> int:
    """usage's `reasoning_tokens`: the tokens of `ids` up to the one completing `</think>` (all if
    unclosed, 0 without a block); binary search, O(log n) `decode` calls of prefixes."""
    text = decode(ids)
    if not starts_in_reasoning and not text.lstrip().startswith(THINK_OPEN):
        return 0
    start = 0 if starts_in_reasoning else text.find(THINK_OPEN) + len(THINK_OPEN)
    if text.find(THINK_CLOSE, start) < 0:
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(ids[:mid]).find(THINK_CLOSE, start) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def opens_thinking(prompt_tail: str) -> bool:
    """True when the prompt ends in an open `<think>` (only whitespace after it)."""
    at = prompt_tail.rfind(THINK_OPEN)
    return at >= 0 and not prompt_tail[at + len(THINK_OPEN):].strip()


class ReasoningParser:
    """One choice's Reasoning and Content events: `feed()` each delta, then `finish()`."""

    def __init__(self, starts_in_reasoning: bool = False):
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buf = ""
        self._reasoning = Trimmer(strip_leading=True)
        self._content = Trimmer()

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        events = self._run(final=True)
        if self._state == "content":
            tail = self._content.flush()
            if tail:
                events.append(Content(tail))
        return events

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._buf, self._state = stripped[len(THINK_OPEN):], "reasoning"
            elif final or not THINK_OPEN.startswith(stripped):
                self._state = "content"
            else:
                return events
        if self._state == "reasoning":
            at = self._buf.find(THINK_CLOSE)
            end = at if at >= 0 else len(self._buf)
            if at < 0 and not final:
                end -= held_prefix_len(self._buf, (THINK_CLOSE,))
            text = self._reasoning.push(self._buf[:end])
            if text:
                events.append(Reasoning(text))
            if at < 0:
                self._buf = self._buf[end:]
                return events
            self._buf, self._state = self._buf[at + len(THINK_CLOSE):], "content"
            self._content.strip_next()
        text = self._content.push(self._buf)
        self._buf = ""
        if text:
            events.append(Content(text))
        return events
