"""OpenAI chat messages normalised for chat templates: content as one string, tool-call arguments as objects (C60)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from radixserve.errors import InvalidRequest

_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def call_arguments(value: Any) -> dict:
    """A tool call's `arguments` as the object templates read (GLM's iterate `arguments.items()`): JSON object text
    (OpenAI's form) parsed, "" or blank text {}, an object as it is. Raises ValueError saying what came otherwise."""
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"arguments must be a JSON object or its text, got {type(value).__name__}")
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as exc:     # RecursionError: nesting too deep to read
        raise ValueError(f"arguments must be a JSON object, got text that is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"arguments must be a JSON object, got {_JSON_KINDS.get(type(parsed), 'a number')}")
    return parsed


def _message_calls(i: int, calls: Any) -> Any:
    """`tool_calls` with each function's arguments as an object; other shapes are left to the template."""
    if not isinstance(calls, (list, tuple)):
        return calls
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and "arguments" in function:
            try:
                function = {**function, "arguments": call_arguments(function["arguments"])}
            except ValueError as exc:
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments: {exc}",
                                     param="messages") from None
            call = {**call, "function": function}
        out.append(call)
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """New message dicts: `content` a string (text parts joined, None ""), `tool_calls[].function.arguments`
    objects (call_arguments), other fields as given. Raises InvalidRequest (param "messages") for a malformed one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string", param="messages")
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                         param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role != "assistant":   # OpenAI: only an assistant turn may omit it
            raise InvalidRequest(f"messages[{i}].content is required for role {role!r}", param="messages")
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        normalized = {**msg, "content": content}
        if "tool_calls" in msg:
            normalized["tool_calls"] = _message_calls(i, msg["tool_calls"])
        out.append(normalized)
    return out
