r"""XML-like tool calls with one tag per argument: GLM-4.5 / 4.6 / 4.7 (`--tool-call-parser glm45`, `glm47`) and Qwen3-Coder (`qwen3_coder`).

    glm45        <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>
    glm47        the same without the newlines (whitespace between tags is optional here)
    qwen3_coder  <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>

String-only values stream; edge whitespace is no part of a value (as vLLM's parsers, xgrammar's glm_xml
and qwen_xml). A closing tag inside a value counts only if the next key or the call's or reply's end follows."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.parsers.scan import held_prefix_len, is_marker_prefix, skip_ws
from radixserve.parsers.schema import ToolSpec, is_string_only, type_text
from radixserve.parsers.tool_parser import ToolCallParser

MAX_NAME_CHARS = 256    # the longest function name a request may offer (server/protocol.py)
MAX_KEY_CHARS = 4096    # longer argument keys end the call (read as text), streamed or not
MAX_GAP_CHARS = 256     # a longer whitespace run around the name means no call (read as text)


@dataclass(frozen=True)
class XmlTags:
    """After `<tool_call>`: name_open NAME (ends at a `name_ends`), then per argument key_open KEY
    key_close value_open VALUE value_close, then call_close and optional call_tail."""

    name_open: str
    name_ends: tuple[str, ...]
    name_close: str
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    call_close: str
    call_tail: str = ""

    @property
    def after_value(self) -> tuple[str, ...]:
        return (self.key_open, self.call_close)


GLM_TAGS = XmlTags(name_open="", name_ends=("\n", "<arg_key>", "</tool_call>"), name_close="",
                   key_open="<arg_key>", key_close="</arg_key>", value_open="<arg_value>",
                   value_close="</arg_value>", call_close="</tool_call>")
QWEN3_CODER_TAGS = XmlTags(name_open="<function=", name_ends=(">",), name_close=">",
                           key_open="<parameter=", key_close=">", value_open="",
                           value_close="</parameter>", call_close="</function>",
                           call_tail="</tool_call>")


class XmlToolParser(ToolCallParser):
    """States: name -> args -> key -> value_open -> string | value -> args ... -> tail. After the
    name commits, anything unexpected ends the call and is read as text."""

    tags: XmlTags

    def _begin_call(self) -> None:
        self._state = "name"
        self._tool = ToolSpec("")
        self._key = ""
        self._keys: set[str] = set()   # keys written: a repeated key's value is dropped
        self._scan_from = 0
        self._leading = False

    def _step_call(self, final: bool) -> bool:
        return getattr(self, "_read_" + self._state)(final)

    def _read_name(self, final: bool) -> bool:
        """A call when the name is offered and the MAX_GAP_CHARS / MAX_NAME_CHARS bounds hold."""
        t = self.tags
        start = skip_ws(self._buf, 0)
        if start > MAX_GAP_CHARS:
            self._reject_call()
            return True
        if t.name_open:
            head = self._buf[start:start + len(t.name_open)]
            if head != t.name_open:
                if final or not t.name_open.startswith(head):
                    self._reject_call()
                    return True
                return False
            gap = start + len(t.name_open)
            start = skip_ws(self._buf, gap)
            if start - gap > MAX_GAP_CHARS:
                self._reject_call()
                return True
        ends = [at for end in t.name_ends if (at := self._buf.find(end, start)) >= 0]
        at = min(ends, default=len(self._buf))
        raw = self._buf[start:at]
        name = raw.rstrip()
        if (len(raw) - len(name) > MAX_GAP_CHARS or len(name) > MAX_NAME_CHARS
                or not ends and final):
            self._reject_call()
            return True
        if not ends:
            return False
        if name not in self.tools:
            self._reject_call()
            return True
        self._buf = self._buf[at + len(t.name_close):]
        self._tool = self.tools[name]
        self._start_call(name)
        self._state = "args"
        return True

    def _read_args(self, final: bool) -> bool:
        t = self.tags
        rest = self._buf[skip_ws(self._buf, 0):]
        if rest.startswith(t.key_open):
            self._buf, self._state = rest[len(t.key_open):], "key"
            return True
        if rest.startswith(t.call_close):
            self._buf, self._state = rest[len(t.call_close):], "tail"
            return True
        if not final and (not rest or is_marker_prefix(rest, t.after_value)):
            self._buf = rest
            return False
        self._buf = rest
        self._end_call()
        return True

    def _read_tail(self, final: bool) -> bool:
        tail = self.tags.call_tail
        rest = self._buf[skip_ws(self._buf, 0):]
        if tail and rest.startswith(tail):
            self._buf = rest[len(tail):]
        elif tail and not final and (not rest or is_marker_prefix(rest, (tail,))):
            self._buf = rest
            return False
        self._end_call()
        return True

    def _read_key(self, final: bool) -> bool:
        close = self.tags.key_close
        at = self._buf.find(close)
        if at < 0 and not final and len(self._buf) <= MAX_KEY_CHARS + len(close):
            return False
        if at < 0 or at > MAX_KEY_CHARS:
            self._end_call()
            return True
        self._key = self._buf[:at].strip()
        self._buf, self._state = self._buf[at + len(close):], "value_open"
        return True

    def _read_value_open(self, final: bool) -> bool:
        value_open = self.tags.value_open
        rest = self._buf[skip_ws(self._buf, 0):] if value_open else self._buf
        if rest.startswith(value_open):
            self._buf, self._scan_from = rest[len(value_open):], 0
            if self._key not in self._keys and is_string_only(self._tool.param_schema(self._key)):
                self._keys.add(self._key)
                self._args(self.writer.open_string(self._key))
                self._state, self._leading = "string", True
            else:
                self._state = "value"
            return True
        if not final and (not rest or is_marker_prefix(rest, (value_open,))):
            self._buf = rest
            return False
        self._buf = rest
        self._end_call()
        return True

    def _read_string(self, final: bool) -> bool:
        """Stream the value's known characters, edge whitespace dropped; close it at its closing tag."""
        if self._leading:
            lead = len(self._buf) - len(self._buf.lstrip())
            if lead == len(self._buf) and not final:
                return False
            self._buf, self._scan_from = self._buf[lead:], max(self._scan_from - lead, 0)
            self._leading = False
        end, safe = self._value_end(final)
        emit = len(self._buf[:safe if end is None else end].rstrip())
        cut = emit if end is None else end
        self._args(self.writer.string_chars(self._buf[:emit]))
        self._buf, self._scan_from = self._buf[cut:], max(self._scan_from - cut, 0)
        if end is None:
            return False
        self._args(self.writer.close_string())
        self._close_value()
        return True

    def _read_value(self, final: bool) -> bool:
        end, _ = self._value_end(final)
        if end is None:
            return False
        if self._key not in self._keys:
            self._keys.add(self._key)
            value = type_text(self._buf[:end], self._tool.param_schema(self._key))
            self._args(self.writer.add(self._key, value))
        self._buf = self._buf[end:]
        self._close_value()
        return True

    def _close_value(self) -> None:
        if self._buf.startswith(self.tags.value_close):
            self._buf = self._buf[len(self.tags.value_close):]
        self._state = "args"

    def _value_end(self, final: bool) -> tuple[int | None, int]:
        """(end, safe): the value's end (its real closing tag; None: not yet known), the `_buf` length surely in it."""
        buf, start = self._buf, self._scan_from
        close, after = self.tags.value_close, self.tags.after_value
        while True:
            at = buf.find(close, start)
            if at < 0:
                if final:
                    return len(buf), len(buf)
                safe = max(len(buf) - held_prefix_len(buf, (close,)), start)
                self._scan_from = safe
                return None, safe
            rest = buf[skip_ws(buf, at + len(close)):]
            if rest.startswith(after):
                return at, at
            if not rest or is_marker_prefix(rest, after):
                if final:
                    return at, at
                self._scan_from = at
                return None, at
            start = at + 1


class GlmToolParser(XmlToolParser):
    tags = GLM_TAGS


class Qwen3CoderToolParser(XmlToolParser):
    tags = QWEN3_CODER_TAGS
