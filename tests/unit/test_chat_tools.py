"""tools / tool_choice planning, message fields for the template, and parsed output as OpenAI messages and deltas."""
from __future__ import annotations

import json

import pytest

from radixserve.errors import InvalidRequest
from radixserve.server.chat_tools import ChatOutputs, plan_tools, stream_delta
from radixserve.server.protocol import ChatCompletionRequest
from tests.unit.parser_cases import glm45

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": "x"}], **fields}))


@pytest.mark.parametrize("fields, offered, parsed", [
    ({}, None, []),
    ({"tools": [WEATHER, TIME]}, ["get_weather", "get_time"], ["get_weather", "get_time"]),
    ({"tools": [WEATHER, TIME], "tool_choice": "auto"}, ["get_weather", "get_time"],
     ["get_weather", "get_time"]),
    ({"tools": [WEATHER, TIME], "tool_choice": "required"}, ["get_weather", "get_time"],
     ["get_weather", "get_time"]),
    ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, ["get_weather", "get_time"], ["get_time"]),
    ({"tools": [WEATHER, TIME], "tool_choice": "none"}, None, []),
    ({"tool_choice": "auto"}, None, []),
    ({"tool_choice": "none"}, None, []),
])
def test_plan(fields, offered, parsed):
    plan = plan_tools(request(**fields), "glm45")
    names = None if plan.template_tools is None else [t["function"]["name"]
                                                      for t in plan.template_tools]
    assert names == offered and list(plan.parse_tools) == parsed
    if "tools" in fields and offered:
        assert plan.template_tools[1] == TIME   # as sent, no nulls added


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_plan_refusals(fields, param):
    with pytest.raises(InvalidRequest) as err:
        plan_tools(request(**fields), "glm45")
    assert err.value.param == param


def test_tools_need_a_parser_unless_not_offered():
    with pytest.raises(InvalidRequest, match="--tool-call-parser"):
        plan_tools(request(tools=[WEATHER]), None)
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None).parse_tools == {}


def test_message_fields_reach_the_template_with_arguments_as_objects():
    req = request(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"days": 2}'}},
            {"id": "call_2", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny",
         "custom_field": [1]}])
    user, assistant, tool = (m.template_dict() for m in req.messages)
    assert user == {"role": "user", "content": "ab"}
    assert assistant["content"] == "" and assistant["reasoning_content"] == "hm"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"days": 2}, {}]
    assert assistant["tool_calls"][1]["type"] == "function"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                    "content": "sunny", "custom_field": [1]}


def test_full_message_and_finish_reason():
    outputs = ChatOutputs(plan_tools(request(tools=[WEATHER, TIME]), "glm45"), "glm45", False, "")
    reply = "Hi.\n" + glm45("get_weather", [("days", "2")])
    message, reason = outputs.message(reply, "stop")
    assert reason == "tool_calls" and message.content == "Hi."
    (call,) = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"days": 2}')
    only_call, _ = outputs.message(glm45("get_time", []), "length")
    assert only_call.content is None and _ == "length"
    text, reason = outputs.message("No call.", "stop")
    assert (text.content, text.tool_calls, text.reasoning_content, reason) == (
        "No call.", None, None, "stop")


def test_stream_deltas_name_each_call_once():
    outputs = ChatOutputs(plan_tools(request(tools=[WEATHER, TIME]), "glm45"), "glm45", False, "")
    reply = glm45("get_weather", [("days", "2")]) + glm45("get_time", [])
    deltas = [outputs.delta(0, ch, False) for ch in reply] + [outputs.delta(0, "", True)]
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    firsts = [e for e in entries if "id" in e]
    assert [(e["index"], e["function"]["name"]) for e in firsts] == [(0, "get_weather"), (1, "get_time")]
    joined = ["".join(e["function"]["arguments"] for e in entries if e["index"] == i) for i in (0, 1)]
    assert joined == ['{"days": 2}', "{}"]
    assert outputs.finish_reason(0, "stop") == "tool_calls"
    assert stream_delta([]) == {}


@pytest.mark.parametrize("choice, parallel, names, max_items, finish", [
    ("required", True, {"get_weather", "get_time"}, None, "tool_calls"),
    ("required", False, {"get_weather", "get_time"}, 1, "tool_calls"),
    ({"type": "function", "function": {"name": "get_time"}}, True, {"get_time"}, None, "stop"),
])
def test_enforced_choices_carry_the_call_schema(choice, parallel, names, max_items, finish):
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice,
                              parallel_tool_calls=parallel), None)   # no native parser needed
    schema = json.loads(plan.json_schema)
    items = schema["items"].get("anyOf", [schema["items"]])
    assert {i["properties"]["name"]["enum"][0] for i in items} == names == set(plan.parse_tools)
    assert schema.get("maxItems") == max_items and plan.calls_finish_reason == finish
    assert plan_tools(request(tools=[WEATHER], tool_choice="auto"), "glm45").json_schema is None


@pytest.mark.parametrize("response_format", [{"type": "json_object"}, {
    "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
def test_enforced_choice_with_a_response_format_is_refused(response_format):
    with pytest.raises(InvalidRequest) as err:
        plan_tools(request(tools=[WEATHER], tool_choice="required",
                           response_format=response_format), "glm45")
    assert err.value.param == "response_format"
    text = plan_tools(request(tools=[WEATHER], tool_choice="required",
                              response_format={"type": "text"}), "glm45")
    assert text.json_schema is not None


def test_enforced_reply_is_read_as_json_without_reasoning():
    named = {"type": "function", "function": {"name": "get_weather"}}
    outputs = ChatOutputs(plan_tools(request(tools=[WEATHER, TIME], tool_choice=named), "glm45"),
                          "glm45", True, "<think>\n")
    reply = '[{"name": "get_weather", "parameters": {"days": 2}}]'
    message, reason = outputs.message(reply, "stop")
    assert (message.content, message.reasoning_content, reason) == (None, None, "stop")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"days": 2}')]
    deltas = [outputs.delta(0, ch, False) for ch in reply] + [outputs.delta(0, "", True)]
    assert "".join(e["function"]["arguments"] for d in deltas for e in d.get("tool_calls", [])) \
        == '{"days": 2}'
    assert outputs.finish_reason(0, "stop") == "stop"


def test_auto_without_parallel_calls_keeps_the_first():
    plan = plan_tools(request(tools=[WEATHER, TIME], parallel_tool_calls=False), "glm45")
    outputs = ChatOutputs(plan, "glm45", False, "")
    reply = "On it." + glm45("get_weather", [("days", "2")]) + glm45("get_time", [])
    message, reason = outputs.message(reply, "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert (message.content, reason) == ("On it.", "tool_calls")
    deltas = [outputs.delta(0, ch, False) for ch in reply] + [outputs.delta(0, "", True)]
    assert {e["index"] for d in deltas for e in d.get("tool_calls", [])} == {0}
