"""Tool definitions as the parsers see them, and argument values typed per the tool's JSON schema.

`type_text` types XML-format text values ("5" -> 5 for an integer); `type_json` only fixes a string
written for a non-string parameter. Neither fails: a value fitting no type stays the model's text."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

_INTEGER = re.compile(r"-?(0|[1-9]\d*)")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_TEXT_TYPES = ("null", "boolean", "integer", "number", "object", "array")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One offered function: its name and `parameters` JSON schema ({} if none)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def param_schema(self, key: str) -> dict[str, Any] | None:
        props = self.parameters.get("properties")
        schema = props.get(key) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else None


def schema_types(schema: dict[str, Any] | None) -> frozenset[str]:
    """JSON types a schema allows (`type`, `anyOf`, `oneOf`, `properties`); empty means any."""
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
    return schema_types(schema) == {"string"}


def loads_json(text: str) -> Any:
    """json.loads refusing NaN / Infinity / overflow (`1e999`); ValueError for anything not one JSON value."""
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
    """A parameter written as text, stripped, as the first of its schema's _TEXT_TYPES it fits."""
    types = schema_types(schema)
    stripped = text.strip()
    if types == {"string"}:
        return stripped
    try:
        return loads_json(stripped) if not types else _as_types(stripped, types)
    except ValueError:
        return stripped


def type_json(value: Any, schema: dict[str, Any] | None) -> Any:
    types = schema_types(schema)
    if not isinstance(value, str) or not types or "string" in types:
        return value
    try:
        return _as_types(value.strip(), types)
    except ValueError:
        return value


def _as_types(text: str, types: frozenset[str]) -> Any:
    """`text` as the first of _TEXT_TYPES in `types` it fits; ValueError when none."""
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
