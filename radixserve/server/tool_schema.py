"""The JSON schema that enforces tool_choice "required" or a named function while decoding: the reply is a JSON array of calls (as vLLM and SGLang build it).

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

Each item is one call: `name` is one of the functions the schema is built over (all offered
ones for "required", the named one otherwise) and `parameters` matches that function's
`parameters` schema ({} and no schema: an empty object). minItems 1 makes at least one call;
maxItems 1 when parallel_tool_calls is false. The schema goes to the engine as the request's
json_schema (runner/structured.py compiles it, a 400 when xgrammar refuses it), and the server
reads the array back into `tool_calls` with the `json` tool-call parser (parsers/json_calls.py,
which takes "parameters" for "arguments"), whatever the model's own format.

A function's `$defs` / `definitions` move to the root of the array schema, where its
`#/$defs/...` references resolve once its schema is nested; two functions that give one
definition name different schemas are a 400. Other references to the function schema's own
root (`#`, `#/properties/...`) do not survive the nesting.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.parsers.schema import ToolSpec, schema_types

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
DEFINITION_KEYS = ("$defs", "definitions")


def calls_schema(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """JSON schema text of an array of one or more calls to `tools` (module doc); at most one
    call unless `parallel`. Raises InvalidRequest (param "tools") when a function's parameters
    do not describe an object or two functions define one name differently."""
    assert tools, "a call schema needs at least one function"
    definitions: dict[str, dict[str, Any]] = {key: {} for key in DEFINITION_KEYS}
    items = [_call_item(tool, definitions) for tool in tools]
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": items[0] if len(items) == 1 else {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update((key, defs) for key, defs in definitions.items() if defs)
    return json.dumps(schema)


def object_parameters(tool: ToolSpec) -> dict[str, Any]:
    """`tool`'s parameters schema for an enforced call (EMPTY_PARAMETERS when it has none).
    Raises InvalidRequest (param "tools") when it does not describe a JSON object."""
    parameters = tool.parameters or EMPTY_PARAMETERS
    types = schema_types(parameters)
    if types and "object" not in types:
        raise InvalidRequest(f"tools: the parameters of {tool.name!r} must describe a JSON object "
                             f"to be enforced (tool_choice or strict), got type {sorted(types)}", param="tools")
    return parameters


def _call_item(tool: ToolSpec, definitions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of one call to `tool`; its definitions are moved into `definitions`."""
    parameters = copy.deepcopy(object_parameters(tool))
    for key in DEFINITION_KEYS:
        defs = parameters.get(key)
        if not isinstance(defs, dict):
            continue
        del parameters[key]
        for name, schema in defs.items():
            if definitions[key].setdefault(name, schema) != schema:
                raise InvalidRequest(f"tools: {key} {name!r} has different schemas in different "
                                     "functions, which tool_choice cannot combine", param="tools")
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.name]},
                           "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False}
