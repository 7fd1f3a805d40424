"""XML-like tool calls with one tag per argument: GLM-4.5 / 4.6 / 4.7 (`--tool-call-parser glm45`, `glm47`) and Qwen3-Coder (`qwen3_coder`).

    GLM-4.5 / 4.6                          Qwen3-Coder (also Qwen3.5)
    <tool_call>get_weather                 <tool_call>
    <arg_key>city</arg_key>                <function=get_weather>
    <arg_value>Paris</arg_value>           <parameter=city>
    <arg_key>days</arg_key>                Paris
    <arg_value>3</arg_value>               </parameter>
    </tool_call>                           <parameter=days>
                                           3
                                           </parameter>
                                           </function>
                                           </tool_call>

GLM-4.7 writes the same tags without the newlines (`<tool_call>get_weather<arg_key>city</arg_key>
<arg_value>...`); whitespace between tags is optional here, so one parser reads both formats.
One reader serves both families; a subclass names its tags (XmlTags). Values are typed per the
tool's schema (schema.type_text). A string-only parameter is streamed as it is generated; other
values go out whole once their closing tag is read. Whitespace around a value is not part of it
(as vLLM's GLM and Qwen3-Coder tool parsers strip it, and as xgrammar's `glm_xml` / `qwen_xml`
grammars pad values with it: server/native_tools.py).

A value may itself contain its closing tag (code, XML): a closing tag counts only when what
follows it, after whitespace, is the next argument's opening tag, the end of the call or the end
of the reply, so the text after a candidate is held until that is known.
"""
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
    """One family's tags, after the start marker `<tool_call>`: the name follows `name_open`
    and ends at the first of `name_ends` (consumed only when it is `name_close`); each argument
    is key_open KEY key_close value_open VALUE value_close; `call_close` ends the call, then
    optional whitespace and `call_tail`."""

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
    """The XML-like formats (module doc), by `tags`. States of one call, in order:

        name -> args -> key -> value_open -> string | value -> args -> ... -> (call_close) -> tail

    Anything unexpected after the name commits ends the call (its arguments so far stand) and
    is read as text again."""

    tags: XmlTags   # set by each format's subclass

    def _begin_call(self) -> None:
        self._state = "name"
        self._tool = ToolSpec("")
        self._key = ""
        self._keys: set[str] = set()   # keys written: a repeated key's value is read and dropped
        self._scan_from = 0     # where the search for the value's closing tag resumes
        self._leading = False   # a string value's leading whitespace is still to be skipped

    def _step_call(self, final: bool) -> bool:
        return getattr(self, "_read_" + self._state)(final)

    def _read_name(self, final: bool) -> bool:
        """The function name: a call when it is an offered one. Whitespace runs around it
        longer than MAX_GAP_CHARS, or a name longer than any offered one can be, mean no call;
        the same text gives the same answer at any chunking (each bound is a property of the
        text so far, checked whole or streamed), and no feed rescans more than the bounds."""
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
        if not ends:   # wait for the name's end
            return False
        if name not in self.tools:
            self._reject_call()
            return True
        self._buf = self._buf[at + len(t.name_close):]   # name_close: "" or the only name end
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
            self._buf = rest   # the whitespace goes whatever follows: never scanned twice
            return False
        self._buf = rest     # broken, or the reply ended inside the call
        self._end_call()
        return True

    def _read_tail(self, final: bool) -> bool:
        """After call_close: optional whitespace and call_tail (Qwen3-Coder's </tool_call>)."""
        tail = self.tags.call_tail
        rest = self._buf[skip_ws(self._buf, 0):]
        if tail and rest.startswith(tail):
            self._buf = rest[len(tail):]
        elif tail and not final and (not rest or is_marker_prefix(rest, (tail,))):
            self._buf = rest   # dropped either way (_end_call strips what follows a call)
            return False
        self._end_call()
        return True

    def _read_key(self, final: bool) -> bool:
        close = self.tags.key_close
        at = self._buf.find(close)
        if at < 0 and not final and len(self._buf) <= MAX_KEY_CHARS + len(close):
            return False
        if at < 0 or at > MAX_KEY_CHARS:
            self._end_call()     # the unfinished (or too long) key is read as text
            return True
        self._key = self._buf[:at].strip()
        self._buf, self._state = self._buf[at + len(close):], "value_open"
        return True

    def _read_value_open(self, final: bool) -> bool:
        value_open = self.tags.value_open
        rest = self._buf[skip_ws(self._buf, 0):] if value_open else self._buf
        if rest.startswith(value_open):
            self._buf, self._scan_from = rest[len(value_open):], 0
            # A repeated key's value is read as "value" and dropped (first one wins).
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
        self._buf = rest     # a key without a value
        self._end_call()
        return True

    def _read_string(self, final: bool) -> bool:
        """Stream the characters known to belong to the value; close it at its closing tag.
        Whitespace around the value is not part of it (module doc): leading whitespace is
        dropped, trailing whitespace held until more text or the closing tag decides."""
        if self._leading:
            lead = len(self._buf) - len(self._buf.lstrip())   # str.strip's whitespace, as at the end
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
        """(end, safe): `end` is where the value ends (its real closing tag, or the end of the
        text when the reply ended without one), None while unknown; the value surely holds
        `_buf[:safe]`. See the module doc for which closing tags are real."""
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
            start = at + 1   # the closing tag inside the value


class GlmToolParser(XmlToolParser):
    """GLM-4.5 / 4.6 / 4.7 (`glm45`, `glm47`)."""

    tags = GLM_TAGS


class Qwen3CoderToolParser(XmlToolParser):
    """Qwen3-Coder and Qwen3.5 (`qwen3_coder`, SGLang's name)."""

    tags = QWEN3_CODER_TAGS
