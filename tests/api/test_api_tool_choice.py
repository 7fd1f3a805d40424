"""tool_choice "required" / a named function and parallel_tool_calls enforced while decoding (issue 15): even the tiny random model makes valid calls, streamed and not alike; bad combinations are 400s."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.streams import assert_framing
from tests.api.test_api_errors import assert_error
from tests.api.tool_fixtures import (chat, force, full_message, same_reply, stream,
                                     streamed_message)
from tests.unit.parser_cases import glm45

# Bounded values (enums, ranges, short strings), so that random weights end every call well
# within max_tokens; a $ref into $defs, which the call array moves to its root.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}, "metric": {"type": "boolean"}},
    "required": ["city", "days"]}}}
NOTE = {"type": "function", "function": {"name": "add_note", "parameters": {
    "type": "object", "properties": {
        "text": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "maxItems": 2}},
    "required": ["text", "tags"], "$defs": {"Tag": {"type": "string", "enum": ["home", "work"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, NOTE, TIME]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object",
                                                                   "maxProperties": 0})
           for t in TOOLS}
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def server(glm45_server):
    return glm45_server


def both(server, **fields) -> tuple[dict, dict]:
    """The full and the streamed reply of one request (same seed), checked to agree."""
    fields = {"tools": TOOLS, "temperature": 1.0, "max_tokens": 300, **fields}
    full = chat(server, **fields)
    res = stream(server, **fields)
    assert_framing(res, 1, chat=True, usage=True)
    got = full_message(full)
    same_reply(streamed_message(res), got)
    assert full["choices"][0]["message"]["content"] is None
    assert full["usage"]["completion_tokens"] == res.usage["completion_tokens"]
    return full, got


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_required_always_calls_offered_functions(server, seed, parallel):
    _, got = both(server, tool_choice="required", seed=seed, parallel_tool_calls=parallel)
    assert_valid_calls(got["calls"], set(SCHEMAS))
    assert got["finish_reason"] == "tool_calls"
    if not parallel:
        assert len(got["calls"]) == 1


@pytest.mark.parametrize("name, parallel", [("add_note", True), ("add_note", False),
                                            ("get_time", True)])
def test_named_function_is_the_one_called(server, name, parallel):
    _, got = both(server, tool_choice={"type": "function", "function": {"name": name}}, seed=7,
                  parallel_tool_calls=parallel)
    assert_valid_calls(got["calls"], {name})
    assert got["finish_reason"] == "stop"     # as OpenAI and vLLM answer a named function
    if not parallel:
        assert len(got["calls"]) == 1


def test_each_of_n_choices_is_enforced(server):
    full = chat(server, tools=TOOLS, tool_choice="required", n=2, seed=3, max_tokens=300)
    for i in range(2):
        assert_valid_calls(full_message(full, i)["calls"], set(SCHEMAS))


def test_text_response_format_goes_with_required(server):
    _, got = both(server, tool_choice="required", seed=5, response_format={"type": "text"},
                  parallel_tool_calls=False)
    assert_valid_calls(got["calls"], set(SCHEMAS))


def test_auto_without_parallel_calls_keeps_the_first(server, default_tokenizer):
    two_calls = glm45("get_weather", [("city", "Oslo"), ("days", "2")]) + glm45("get_time", [])
    force(server, default_tokenizer, two_calls, count=4)
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        _, got = both(server, parallel_tool_calls=parallel)
        assert [c["name"] for c in got["calls"]] == names
        assert got["finish_reason"] == "tool_calls"


def test_cut_by_max_tokens_is_length(server):
    full = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, seed=1, max_tokens=4)
    got = full_message(full)
    assert got["finish_reason"] == "length" and got["calls"] == []
    assert got["content"].startswith("[{")   # what the grammar let it write before the cut


UNCOMPILABLE = {"type": "function", "function": {"name": "bad", "parameters": {
    "type": "object", "properties": {"x": {"type": "strnig"}}}}}
NOT_AN_OBJECT = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
CLASHING_DEFS = {"type": "function", "function": {"name": "clash", "parameters": {
    "type": "object", "properties": {"t": {"$ref": "#/$defs/Tag"}},
    "$defs": {"Tag": {"type": "integer"}}}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD = {   # name -> (fields, param)
    "required_with_json_schema_format": ({"tool_choice": "required",
                                          "response_format": JSON_FORMAT}, "response_format"),
    "named_with_json_object_format": ({"tool_choice": NAMED,
                                       "response_format": {"type": "json_object"}}, "response_format"),
    "schema_xgrammar_refuses": ({"tools": [UNCOMPILABLE], "tool_choice": "required"}, "tools"),
    "parameters_not_an_object": ({"tools": [NOT_AN_OBJECT], "tool_choice": "required"}, "tools"),
    "same_def_two_schemas": ({"tools": [NOTE, CLASHING_DEFS], "tool_choice": "required"}, "tools"),
    "parallel_not_a_bool": ({"tool_choice": "required", "parallel_tool_calls": "no"},
                            "parallel_tool_calls"),
}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_combinations_are_400(server, name, streaming):
    fields, param = BAD[name]
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, "stream": streaming, "tools": TOOLS, **fields}
    err = assert_error(server.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param, err
