"""Incremental detokenizer (UTF-8 and leading-space safe) and the streaming stop-string matcher."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from radixserve.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# A character needs at most 4 byte tokens: a U+FFFD tail held this many tokens is real and released.
MAX_HELD_TOKENS = 32
# Past this many unread tokens an open byte-fallback run is released anyway (keeps work linear).
MAX_GROUP_TOKENS = 256


class IncrementalDetokenizer:
    """One choice's ids to text deltas that join to `tokenizer.decode(all_ids, skip_special_tokens)`.

        ids  [ done ............ | prefix window       | unread ids             ]
             0                   prefix_offset         read_offset              len(ids)
                                 `----- prefix text -----'`-- new text (delta) --'

    The prefix text (emitted already) is context, so leading spaces and merged bytes decode as in
    the full output. A trailing U+FFFD (a split character) or ByteFallback `<0xNN>` run is held until
    complete; then the window moves to [read_offset, len(ids)), so each id decodes O(1) times."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_token_ids
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_len = 0    # len(decode(ids[prefix_offset:read_offset])) in characters
        self._num_emitted = 0   # characters of the window past prefix_len already returned
        self._last_plain = -1   # index of the latest id that decodes to text (not skipped)

    @property
    def token_ids(self) -> list[int]:
        """All ids added so far (do not mutate)."""
        return self._ids

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text now final (may be ""), the same at any chunking."""
        deltas = []
        for tid in token_ids:
            if tid not in self._skipped_ids:
                self._last_plain = len(self._ids)
            self._ids.append(tid)
            deltas.append(self._emit(final=False))
        return "".join(deltas)

    def finish(self) -> str:
        """Release all held text (an incomplete character comes out as U+FFFD, as in decode)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        upto = len(self._ids) if final else self._open_group_start()
        if upto <= self._read_offset:
            return ""
        text = self._decode(self._ids[self._prefix_offset:upto], self._skip_special_tokens)
        end = len(text)
        if not final and upto == len(self._ids) and text.endswith(REPLACEMENT_CHAR) \
                and len(self._ids) - self._read_offset <= MAX_HELD_TOKENS:
            end = len(text.rstrip(REPLACEMENT_CHAR))
        start = self._prefix_len + self._num_emitted
        delta = text[start:end] if end > start else ""
        self._num_emitted += len(delta)
        if upto == len(self._ids) and end == len(text):
            self._advance_window()
        return delta

    def _open_group_start(self) -> int:
        """Start of a trailing run of byte tokens (`<0xE4>`, skipped specials inside), else len(ids):
        ByteFallback decodes an invalid run to U+FFFD per byte, so no part of it is final."""
        ids, n = self._ids, len(self._ids)
        if not self._byte_ids or n - self._read_offset > MAX_GROUP_TOKENS:
            return n
        i = n - 1
        while i >= self._read_offset and ids[i] in self._skipped_ids:
            i -= 1
        if i < self._read_offset or ids[i] not in self._byte_ids:
            return n
        while i > self._read_offset and (ids[i - 1] in self._byte_ids or ids[i - 1] in self._skipped_ids):
            i -= 1
        return i

    def _advance_window(self) -> None:
        new_prefix = self._read_offset
        if self._skipped_ids and 0 <= self._last_plain < new_prefix:
            # Keep a text token in context: some decoders strip the first token's leading space.
            new_prefix = self._last_plain
        self._prefix_offset = new_prefix
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids[new_prefix:], self._skip_special_tokens))
        self._num_emitted = 0


class StopCheck(NamedTuple):
    """Text safe to send now, and the stop string that matched (then `text` is the last piece)."""

    text: str
    matched: str | None


class StopStringMatcher:
    """Finds stop strings in a stream, holding back what could still become one. The stop whose first occurrence ends
    earliest wins (ties: starts earliest) at any chunking; cut at its start (end: include_stop_str_in_output)."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self._stops = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        self._pending = ""
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        return self._pending

    def feed(self, text: str) -> StopCheck:
        assert self.matched is None, "feed() after a stop string matched"
        if not self._stops:
            return StopCheck(text, None)
        buf = self._pending + text
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            at = buf.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < best[:2]):
                best = (at + len(s), at, s)
        if best is not None:
            end, start, s = best
            self._pending = ""
            self.matched = s
            return StopCheck(buf[:end] if self._include else buf[:start], s)
        held = self._held_len(buf)
        self._pending = buf[len(buf) - held:] if held else ""
        return StopCheck(buf[:len(buf) - held], None)

    def flush(self) -> str:
        """Release the held text (the choice ended for another reason: length, eos, abort)."""
        out, self._pending = self._pending, ""
        return out

    def _held_len(self, buf: str) -> int:
        if not buf:
            return 0
        last, best = buf[-1], 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if s[n - 1] == last and buf.endswith(s[:n]):
                    best = n
                    break
        return best
