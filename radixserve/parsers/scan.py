"""Text scanning the output parsers share: held-back marker prefixes, edge whitespace, the ends of JSON values in growing text.

Each helper answers None ("not yet") while more text could change its answer."""
from __future__ import annotations

WHITESPACE = " \t\r\n"


def held_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def is_marker_prefix(text: str, markers: tuple[str, ...]) -> bool:
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


class Trimmer:
    """Streams text with its edge whitespace removed; trailing whitespace is held until more text comes."""

    def __init__(self, strip_leading: bool = False) -> None:
        self._strip_leading = strip_leading
        self.held = ""

    def push(self, text: str) -> str:
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self._strip_leading = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body

    def strip_next(self) -> None:
        self._strip_leading = True

    def drop_held(self) -> None:
        self.held = ""

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class JsonValueEnd:
    """The end of the JSON value at text[0], each character scanned once over calls with growing text."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._end: int | None = None

    def scan(self, text: str, final: bool) -> int | None:
        """Index just past the value once complete, else None; a scalar ends at a delimiter or `final`."""
        if self._end is None and text:
            self._end = self._scan(text, final)
        return self._end

    def _scan(self, text: str, final: bool) -> int | None:
        if text[0] not in '"{[':
            for i in range(self._pos, len(text)):
                if text[i] in WHITESPACE or text[i] in ",}]":
                    return i
            self._pos = len(text)
            return len(text) if final else None
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._pos = len(text)
        return None
