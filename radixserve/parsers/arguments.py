"""ArgumentsWriter: one tool call's arguments as JSON object text, written in fragments as arguments complete.

Every parser format ends up here, so the joined fragments are the same JSON whatever the
format or the chunking:

    {"city": "Paris", "days": 3}        add("city", "Paris"), add("days", 3), close()
    {"path": "a.py", "text": "x = 1\\n"} add(...), open_string("text"), string_chars("x = "),
                                        string_chars("1\\n"), close()
    {}                                  close() with no argument

String values can be streamed character by character: JSON escapes each character on its own,
so escape(a + b) == escape(a) + escape(b) and the split points never change the text.
"""
from __future__ import annotations

import json
from typing import Any


def dumps(value: Any) -> str:
    """Compact-spaced JSON as json.dumps writes it, non-ASCII kept (the values are finite)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class ArgumentsWriter:
    """Writes `{`, `"key": value` pairs separated by `, `, and `}` (see module doc). Each method
    returns the fragment to send; `close()` must come last and also ends an open string."""

    def __init__(self) -> None:
        self.num_args = 0
        self._in_string = False
        self.closed = False

    def add(self, key: str, value: Any) -> str:
        """A whole argument (value: any JSON-able, finite)."""
        return self._key(key) + dumps(value)

    def open_string(self, key: str) -> str:
        """Start a string argument whose characters follow through string_chars()."""
        prefix = self._key(key)
        self._in_string = True
        return prefix + '"'

    def string_chars(self, text: str) -> str:
        """More characters of the open string argument, escaped."""
        assert self._in_string, "string_chars() without open_string()"
        return dumps(text)[1:-1]

    def close_string(self) -> str:
        assert self._in_string, "close_string() without open_string()"
        self._in_string = False
        return '"'

    def close(self) -> str:
        """End the object (and an open string); `{}` when no argument was written."""
        assert not self.closed, "arguments closed twice"
        self.closed = True
        tail = self.close_string() if self._in_string else ""
        return tail + ("}" if self.num_args else "{}")

    def _key(self, key: str) -> str:
        assert not self._in_string and not self.closed, "argument started inside another"
        prefix = ", " if self.num_args else "{"
        self.num_args += 1
        return f"{prefix}{dumps(key)}: "
