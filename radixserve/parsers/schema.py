"""Tool definitions as the parsers see them, and argument values typed per the tool's JSON schema.

GLM writes every argument value as text (`<arg_value>5</arg_value>`), so the type comes from the
schema: `type_text` turns "5" into 5 for an integer parameter and keeps it "5" for a string one.
JSON formats (Qwen2.5, generic) carry types already; `type_json` only fixes a string the model
wrote for a non-string parameter ("5" for an integer). Neither ever fails: a value that fits no
schema type stays the text the model wrote.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

_INTEGER = re.compile(r"-?(0|[1-9]\d*)")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
# Non-string JSON schema types, in the order a text value is tried against them.
_TEXT_TYPES = ("null", "boolean", "integer", "number", "object", "array")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the client offered: its name and its `parameters` JSON schema ({} if none)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def param_schema(self, key: str) -> dict[str, Any] | None:
        """The schema of parameter `key`, or None when the tool does not describe it."""
        props = self.parameters.get("properties")
        schema = props.get(key) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else None


def schema_types(schema: dict[str, Any] | None) -> frozenset[str]:
    """JSON types a schema allows: `type` (a name or a list), `anyOf` / `oneOf` branches, and
    "object" for a schema with `properties` but no type. Empty: anything (no constraint known)."""
    if not isinstance(schema, dict):
        return frozenset()
    kind = schema.get("type")
    types: set[str] = set()
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                types |= schema_types(branch)
    if not types and isinstance(schema.get("properties"), dict):
        types.add("object")
    return frozenset(types)


def is_string_only(schema: dict[str, Any] | None) -> bool:
    """True when the schema allows exactly one type, string: a GLM value is then the raw text."""
    return schema_types(schema) == {"string"}


def loads_json(text: str) -> Any:
    """json.loads without NaN / Infinity, written (`NaN`) or overflowing (`1e999`): they are not
    JSON and would make the arguments invalid. Raises ValueError for anything that is not one
    complete JSON value, nesting too deep for the parser included."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def finite(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise ValueError(f"{digits[:40]} overflows a double")
        return value
    try:
        return json.loads(text, parse_constant=refuse, parse_float=finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def type_text(text: str, schema: dict[str, Any] | None) -> Any:
    """The value of a parameter written as text (GLM), whitespace around it stripped.
    String-only schemas keep the text; other schemas try their non-string types in
    _TEXT_TYPES order, else keep the text; a parameter without a schema is JSON when the
    text is JSON."""
    types = schema_types(schema)
    stripped = text.strip()
    if types == {"string"}:
        return stripped
    try:
        return loads_json(stripped) if not types else _as_types(stripped, types)
    except ValueError:
        return stripped


def type_json(value: Any, schema: dict[str, Any] | None) -> Any:
    """A JSON-format argument value, with a string turned into the schema's type when the
    schema does not allow strings ("5" -> 5 for an integer parameter); else unchanged."""
    types = schema_types(schema)
    if not isinstance(value, str) or not types or "string" in types:
        return value
    try:
        return _as_types(value.strip(), types)
    except ValueError:
        return value


def _as_types(text: str, types: frozenset[str]) -> Any:
    """`text` read as the first non-string type of `types` it fits (see _TEXT_TYPES); raises
    ValueError when it fits none (the caller keeps the text then)."""
    for kind in _TEXT_TYPES:
        if kind not in types:
            continue
        if kind == "null" and text in ("null", "None"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "integer" and _INTEGER.fullmatch(text):
            return int(text)
        if kind == "number" and _NUMBER.fullmatch(text):
            number = float(text)
            if math.isfinite(number):
                return int(text) if _INTEGER.fullmatch(text) else number
        if kind in ("object", "array"):
            try:
                value = loads_json(text)
            except ValueError:
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    raise ValueError(f"{text[:40]!r} fits none of {sorted(types)}")
