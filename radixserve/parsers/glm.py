"""GLM-4.5 / 4.6 / 4.7 tool calls (`--tool-call-parser glm45` or `glm47`): XML-like tags, argument values as text.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same tags without the newlines (`<tool_call>get_weather<arg_key>city</arg_key>
<arg_value>...`); whitespace between tags is optional here, so one parser reads both formats.
Values are typed per the tool's schema (schema.type_text). A string-only parameter is streamed
as it is generated; other values go out whole once their closing tag is read. Whitespace
around a value is not part of it (as vLLM's GLM tool parser strips it, and as
xgrammar's `glm_xml` grammar pads values with it: server/native_tools.py).

A value may itself contain "</arg_value>" (code, XML): a closing tag counts only when what
follows it, after whitespace, is `<arg_key>`, `</tool_call>` or the end of the reply, so the
text after a candidate is held until that is known.
"""
from __future__ import annotations

from radixserve.parsers.scan import held_prefix_len, is_marker_prefix, skip_ws
from radixserve.parsers.schema import ToolSpec, is_string_only, type_text
from radixserve.parsers.tool_parser import ToolCallParser

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
CALL_CLOSE = "</tool_call>"
NAME_ENDS = ("\n", KEY_OPEN, CALL_CLOSE)
NAME_END_CHARS = max(map(len, NAME_ENDS))
AFTER_VALUE = (KEY_OPEN, CALL_CLOSE)
MAX_NAME_CHARS = 256    # the longest function name a request may offer (server/protocol.py)
MAX_KEY_CHARS = 4096    # longer argument keys end the call (read as text), streamed or not


class GlmToolParser(ToolCallParser):
    """The GLM format (module doc). States of one call, in order:

        name -> args -> key -> value_open -> string | value -> args -> ... -> (</tool_call>)

    Anything unexpected after the name commits ends the call (its arguments so far stand) and
    is read as text again."""

    def _begin_call(self) -> None:
        self._state = "name"
        self._tool = ToolSpec("")
        self._key = ""
        self._scan_from = 0     # where the search for the value's closing tag resumes
        self._leading = False   # a string value's leading whitespace is still to be skipped

    def _step_call(self, final: bool) -> bool:
        return getattr(self, "_read_" + self._state)(final)

    def _read_name(self, final: bool) -> bool:
        start = skip_ws(self._buf, 0)
        ends = [at for end in NAME_ENDS if (at := self._buf.find(end, start)) >= 0]
        if not ends:   # wait for the name's end, unless no offered name can be this long
            if final or len(self._buf) - start > MAX_NAME_CHARS + NAME_END_CHARS:
                self._reject_call()
                return True
            return False
        at = min(ends)
        name = self._buf[start:at].strip()
        if name not in self.tools:
            self._reject_call()
            return True
        self._buf = self._buf[at:]
        self._tool = self.tools[name]
        self._start_call(name)
        self._state = "args"
        return True

    def _read_args(self, final: bool) -> bool:
        rest = self._buf[skip_ws(self._buf, 0):]
        if rest.startswith(KEY_OPEN):
            self._buf, self._state = rest[len(KEY_OPEN):], "key"
            return True
        if rest.startswith(CALL_CLOSE):
            self._buf = rest[len(CALL_CLOSE):]
            self._end_call()
            return True
        if not final and (not rest or is_marker_prefix(rest, AFTER_VALUE)):
            return False
        self._buf = rest     # broken, or the reply ended inside the call
        self._end_call()
        return True

    def _read_key(self, final: bool) -> bool:
        at = self._buf.find(KEY_CLOSE)
        if at < 0 and not final and len(self._buf) <= MAX_KEY_CHARS + len(KEY_CLOSE):
            return False
        if at < 0 or at > MAX_KEY_CHARS:
            self._end_call()     # the unfinished (or too long) key is read as text
            return True
        self._key = self._buf[:at].strip()
        self._buf, self._state = self._buf[at + len(KEY_CLOSE):], "value_open"
        return True

    def _read_value_open(self, final: bool) -> bool:
        rest = self._buf[skip_ws(self._buf, 0):]
        if rest.startswith(VALUE_OPEN):
            self._buf, self._scan_from = rest[len(VALUE_OPEN):], 0
            if is_string_only(self._tool.param_schema(self._key)):
                self._args(self.writer.open_string(self._key))
                self._state, self._leading = "string", True
            else:
                self._state = "value"
            return True
        if not final and (not rest or is_marker_prefix(rest, (VALUE_OPEN,))):
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
        value = type_text(self._buf[:end], self._tool.param_schema(self._key))
        self._args(self.writer.add(self._key, value))
        self._buf = self._buf[end:]
        self._close_value()
        return True

    def _close_value(self) -> None:
        if self._buf.startswith(VALUE_CLOSE):
            self._buf = self._buf[len(VALUE_CLOSE):]
        self._state = "args"

    def _value_end(self, final: bool) -> tuple[int | None, int]:
        """(end, safe): `end` is where the value ends (its real closing tag, or the end of the
        text when the reply ended without one), None while unknown; the value surely holds
        `_buf[:safe]`. See the module doc for which closing tags are real."""
        buf, start = self._buf, self._scan_from
        while True:
            at = buf.find(VALUE_CLOSE, start)
            if at < 0:
                if final:
                    return len(buf), len(buf)
                safe = max(len(buf) - held_prefix_len(buf, (VALUE_CLOSE,)), start)
                self._scan_from = safe
                return None, safe
            rest = buf[skip_ws(buf, at + len(VALUE_CLOSE)):]
            if rest.startswith(AFTER_VALUE):
                return at, at
            if not rest or is_marker_prefix(rest, AFTER_VALUE):
                if final:
                    return at, at
                self._scan_from = at
                return None, at
            start = at + 1   # "</arg_value>" inside the value
