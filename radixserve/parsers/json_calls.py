r"""Tool calls written as JSON objects: Qwen2.5 / Qwen3 (`qwen25`) and the generic `json` format.

    qwen25   <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
    json     the reply opens with such objects ("parameters" too, as Llama writes), bare or in an array

JSON can break at its last character, so a call is read whole and checked before any of it is
sent; anything invalid, marker included, goes out as content."""
from __future__ import annotations

from typing import Any

from radixserve.parsers.scan import JsonValueEnd, is_marker_prefix, skip_ws
from radixserve.parsers.schema import loads_json, type_json
from radixserve.parsers.tool_parser import ToolCallParser

CALL_CLOSE = "</tool_call>"


def call_of(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a call object's text, or None; "arguments" may be a string holding JSON."""
    try:
        obj = loads_json(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_json(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class JsonCallParser(ToolCallParser):
    def _send_call(self, text: str) -> bool:
        """Commit `text` as a call when it names a known tool; else False."""
        call = call_of(text)
        if call is None or call[0] not in self.tools:
            return False
        name, args = call
        tool = self.tools[name]
        self._start_call(name)
        for key, value in args.items():
            self._args(self.writer.add(key, type_json(value, tool.param_schema(key))))
        self._end_call()
        return True


class Qwen25ToolParser(JsonCallParser):
    """`qwen25` (Qwen2.5, Qwen3); a reply ending right after the object, untagged, still calls."""

    def _begin_call(self) -> None:
        self._value_end = JsonValueEnd()

    def _step_call(self, final: bool) -> bool:
        start = skip_ws(self._buf, 0)
        if start == len(self._buf) and not final:
            return False
        if not self._buf.startswith("{", start):
            self._reject_call()
            return True
        end = self._value_end.scan(self._buf[start:], final)
        if end is None and not final:
            return False
        close = -1 if end is None else skip_ws(self._buf, start + end)
        rest = self._buf[close:] if close >= 0 else ""
        if not final and close >= 0 and (not rest or is_marker_prefix(rest, (CALL_CLOSE,))):
            return False
        if rest.startswith(CALL_CLOSE):
            after = close + len(CALL_CLOSE)
        elif close >= 0 and not rest:
            after = close
        else:
            after = -1
        if after < 0 or not self._send_call(self._buf[start:start + end]):
            self._reject_call()
            return True
        self._buf = self._buf[after:]
        return True


class JsonToolParser(JsonCallParser):
    """`json`: after anything but a call object, `,` or `]` of the opening array, the rest is content."""

    start_marker = ""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._calls_allowed = True
        self._in_array = False
        self._structure = ""    # "[", "," and whitespace since the last call

    def _step_text(self, final: bool) -> bool:
        if not self._calls_allowed:
            self._content(self._buf)
            self._buf = ""
            return False
        at = skip_ws(self._buf, 0)
        if at == len(self._buf):
            if final:
                self._content(self._structure + self._buf)
                self._buf, self._calls_allowed = "", False
            return False
        first = self._buf[at]
        opens_array = first == "[" and self.num_calls == 0 and not self._in_array
        separates = first == "," and self._in_array and self.num_calls > 0
        if opens_array or separates:
            self._in_array = True
            self._structure += self._buf[:at + 1]
            self._buf = self._buf[at + 1:]
            return True
        if first == "]" and self._in_array:
            self._buf = self._buf[at + 1:]
        elif first == "{":
            self._buf = self._buf[at:]
            self._enter_call(self._structure)
            self._structure = ""
            return True
        else:
            self._content(self._structure)
        self._structure, self._calls_allowed = "", False
        return True

    def _begin_call(self) -> None:
        self._value_end = JsonValueEnd()

    def _step_call(self, final: bool) -> bool:
        end = self._value_end.scan(self._buf, final)
        if end is None and not final:
            return False
        if end is None or not self._send_call(self._buf[:end]):
            self._reject_call()
            self._calls_allowed = False
            return True
        self._buf = self._buf[end:]
        return True
