"""ArgumentsWriter: one tool call's arguments as JSON object text, written in fragments as arguments complete.

Every format writes through it, so the joined text is the same at any chunking; strings stream
per character since JSON escapes each on its own (escape(a + b) == escape(a) + escape(b))."""
from __future__ import annotations

import json
from typing import Any


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


class ArgumentsWriter:
    """Each method returns the next fragment of `{"key": value, ...}`; `close()` comes last."""

    def __init__(self) -> None:
        self.num_args = 0
        self._in_string = False
        self.closed = False

    def add(self, key: str, value: Any) -> str:
        return self._key(key) + dumps(value)

    def open_string(self, key: str) -> str:
        prefix = self._key(key)
        self._in_string = True
        return prefix + '"'

    def string_chars(self, text: str) -> str:
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
