"""The call-array JSON schema behind tool_choice "required" / a named function: what it admits, $defs moved to its root, and the refusals."""
from __future__ import annotations

import json

import jsonschema
import pytest

from radixserve.errors import InvalidRequest
from radixserve.parsers.schema import ToolSpec
from radixserve.server.tool_schema import calls_schema

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}}, "required": ["city"],
    "$defs": {"Unit": {"enum": ["C", "F"]}}})
TIME = ToolSpec("get_time")
PARIS = {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}
NOW = {"name": "get_time", "parameters": {}}


@pytest.mark.parametrize("calls, parallel, ok", [
    ([PARIS], True, True),
    ([PARIS, NOW, NOW], True, True),
    ([PARIS, NOW], False, False),                                       # maxItems 1
    ([], True, False),                                                  # minItems 1
    ([{"name": "get_stock", "parameters": {}}], True, False),           # not offered
    ([{"name": "get_weather", "parameters": {"unit": "C"}}], True, False),   # city required
    ([{**PARIS, "parameters": {"city": "Paris", "unit": "K"}}], True, False),  # $ref enforced
    ([{"name": "get_time"}], True, False),                              # parameters required
    ([{**NOW, "parameters": {"x": 1}}], True, False),                   # no parameters: {}
    ([{**NOW, "extra": 1}], True, False),
])
def test_schema_admits_exactly_the_calls(calls, parallel, ok):
    schema = json.loads(calls_schema([WEATHER, TIME], parallel))
    valid = jsonschema.Draft202012Validator(schema).is_valid(calls)
    assert valid == ok


def test_one_function_and_its_defs_at_the_root():
    schema = json.loads(calls_schema([WEATHER], False))
    assert schema["items"]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}}
    assert "$defs" not in schema["items"]["properties"]["parameters"]
    assert "$defs" in WEATHER.parameters, "the tool's own schema is left as it was"


def test_xgrammar_compiles_it_and_it_accepts_calls_only():
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    grammar = xgrammar.Grammar.from_json_schema(calls_schema([WEATHER, TIME], True),
                                                any_whitespace=False)
    assert accepts(grammar, json.dumps([PARIS, NOW]))      # xgrammar's ", " / ": " layout
    assert not accepts(grammar, "[]")                       # at least one call
    assert not accepts(grammar, json.dumps([{"name": "other", "parameters": {}}]))


@pytest.mark.parametrize("tools", [
    [ToolSpec("f", {"type": "string"})],
    [WEATHER, ToolSpec("g", {"type": "object", "$defs": {"Unit": {"type": "integer"}}})],
])
def test_refusals_name_tools(tools):
    with pytest.raises(InvalidRequest) as err:
        calls_schema(tools, True)
    assert err.value.param == "tools"


def test_same_definition_twice_is_fine():
    twin = ToolSpec("twin", {"type": "object", "$defs": {"Unit": {"enum": ["C", "F"]}}})
    assert json.loads(calls_schema([WEATHER, twin], True))["$defs"] == {"Unit": {"enum": ["C", "F"]}}
