"""The JSON schema that enforces tool_choice "required" or a named function while decoding: the reply is a JSON array of calls (as vLLM and SGLang build it).

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

Read by parsers/json_calls.py. `$defs` / `definitions` move to the array's root; other `#...` root references break."""
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
    """JSON schema of 1+ calls to `tools` (<= 1 unless `parallel`); InvalidRequest: non-object params, $defs clash."""
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
    """`tool`'s parameters (default EMPTY_PARAMETERS); InvalidRequest (400) unless an object."""
    parameters = tool.parameters or EMPTY_PARAMETERS
    types = schema_types(parameters)
    if types and "object" not in types:
        raise InvalidRequest(f"tools: the parameters of {tool.name!r} must describe a JSON object "
                             f"to be enforced (tool_choice or strict), got type {sorted(types)}", param="tools")
    return parameters


def _call_item(tool: ToolSpec, definitions: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
