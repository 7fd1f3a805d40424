"""Tool calls enforced in the model's own format (server/native_tools.py): which requests get a native tag, and what each tag lets through, checked with xgrammar's matcher on the default tokenizer."""
from __future__ import annotations

import copy
import json

import pytest

from radixserve.errors import InvalidRequest
from radixserve.server.chat_tools import ChatOutputs, plan_tools
from radixserve.server.native_tools import native_calls_tag
from radixserve.server_config import ServerConfig
from tests.unit.parser_cases import glm45, glm47, qwen3_coder
from tests.unit.test_chat_tools import TIME, request

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def qwen25(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_auto_gets_a_native_tag_only_with_a_strict_tool_and_a_native_parser():
    plan = plan_tools(request(tools=[WEATHER, LOOSE, TIME]), "glm45")
    assert plan.json_schema is None and plan.native is not None
    functions = dict(plan.native.functions)
    assert functions["get_weather"] == WEATHER["function"]["parameters"]
    assert functions["search"] is None and functions["get_time"] is None   # not strict: any object
    assert not plan.native.forced and not plan.native.single
    assert plan_tools(request(tools=[LOOSE, TIME]), "glm45").native is None
    assert plan_tools(request(tools=[WEATHER]), "json").native is None     # no native format
    assert plan_tools(request(tools=[WEATHER], response_format={"type": "json_object"}),
                      "qwen25").native is None   # the response_format constrains the reply
    assert plan_tools(request(tools=[WEATHER], parallel_tool_calls=False), "qwen25").native.single


@pytest.mark.parametrize("choice, names, finish", [("required", {"get_weather", "get_time"}, "tool_calls"),
                                                   (NAMED, {"get_weather"}, "stop")])
def test_native_constraint_replaces_the_json_array(choice, names, finish):
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice), "glm45", "native")
    assert plan.json_schema is None and plan.native.forced
    assert set(dict(plan.native.functions)) == names and plan.calls_finish_reason == finish
    assert dict(plan.native.functions).get("get_time", {}).get("type", "object") == "object"
    assert plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice), "glm45").json_schema
    # a parser without a native format keeps the JSON array
    assert plan_tools(request(tools=[WEATHER], tool_choice="required"), None, "native").json_schema


@pytest.mark.parametrize("fields, constraint", [({"tool_choice": "required"}, "native"), ({}, "json")])
def test_parameters_that_are_not_an_object_are_400(fields, constraint):
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "string"}}}
    with pytest.raises(InvalidRequest) as err:
        plan_tools(request(tools=[tool], **fields), "glm45", constraint)
    assert err.value.param == "tools" and "JSON object" in str(err.value)


def test_each_schema_is_in_the_tag_once():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), "glm45", "native")
    tag = native_calls_tag(plan.native, True, False)
    assert tag.count('"<tool_call>get_weather"') == 1 and tag.count('"days"') == 1


def test_native_constraint_needs_a_native_parser():
    with pytest.raises(ValueError, match="tool-call-constraint native needs"):
        ServerConfig(tool_call_constraint="native", tool_call_parser="json")
    ServerConfig(tool_call_constraint="native", tool_call_parser="glm47")


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    xgr = pytest.importorskip("xgrammar")
    tok = default_tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf),
                                              stop_token_ids=sorted(tok.eos_token_ids))
    return xgr, xgr.GrammarCompiler(info), tok


def accepts(compiler, tag: str, text: str) -> bool:
    """Whether the tag's grammar takes `text` whole and then lets the reply end."""
    xgr, comp, tok = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(tag))
    ids = tok.hf.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(sorted(tok.eos_token_ids)[0])


def tag_of(parser: str, choice, reasoning=False, starts=False, tools=(WEATHER, TIME), **fields) -> str:
    plan = plan_tools(request(tools=list(tools), tool_choice=choice, **fields), parser, "native")
    return native_calls_tag(plan.native, reasoning, starts)


@pytest.mark.parametrize("parser, call", [("glm45", glm45), ("glm47", glm47),
                                          ("qwen3_coder", qwen3_coder)])
def test_xml_tags(compiler, parser, call):
    required = tag_of(parser, "required")
    ok = call("get_weather", [("city", "Paris"), ("days", "3")])
    assert accepts(compiler, required, ok)
    assert accepts(compiler, required, ok + call("get_time", []))
    assert not accepts(compiler, required, call("get_weather", [("days", "3")])), "city is required"
    assert not accepts(compiler, required, call("get_weather", [("city", "Oslo"), ("days", "x")]))
    assert not accepts(compiler, required, "Sure." + ok), "text before the calls"
    assert not accepts(compiler, required, ok + "Done."), "text after the calls"
    assert accepts(compiler, required, ok + "\n" + ok) and not accepts(compiler, required, ok + "\n\n" + ok)
    padded = ok.replace("<arg_value>3", "<arg_value>\n\n3").replace("=days>\n3", "=days>\n\n\n3")
    assert not accepts(compiler, required, padded), "at most one whitespace character in a gap"
    assert not accepts(compiler, required, "Sure."), "no call"
    assert not accepts(compiler, tag_of(parser, NAMED), call("get_time", []))
    single = tag_of(parser, "required", parallel_tool_calls=False)
    assert accepts(compiler, single, ok) and not accepts(compiler, single, ok + call("get_time", []))


def test_qwen25_tags_and_thinking(compiler):
    ok = qwen25("get_weather", {"city": "Paris", "days": 3})
    assert accepts(compiler, tag_of("qwen25", "required"), ok)
    assert not accepts(compiler, tag_of("qwen25", "required"), qwen25("get_weather", {"days": 3}))
    assert not accepts(compiler, tag_of("qwen25", "required"), "<think>plan</think>\n\n" + ok)
    thinking = tag_of("qwen25", "required", reasoning=True)
    assert accepts(compiler, thinking, "<think>plan</think>\n\n" + ok)
    assert accepts(compiler, thinking, ok), "thinking is optional when the prompt did not open it"
    opened = tag_of("qwen25", "required", reasoning=True, starts=True)
    assert accepts(compiler, opened, "plan</think>\n\n" + ok)
    assert not accepts(compiler, opened, "plan" + ok), "the open block must be closed first"
    assert not accepts(compiler, opened, "plan</think>" + "\n" * 4 + ok), "a bounded gap after it"


def test_auto_with_a_strict_tool_leaves_text_free_but_checks_calls(compiler):
    plan = plan_tools(request(tools=[WEATHER, LOOSE]), "qwen25")
    tag = native_calls_tag(plan.native, True, False)
    assert accepts(compiler, tag, "No tool needed, it is sunny.")
    assert accepts(compiler, tag, "<think>hm</think>Let me look. " + qwen25("get_weather", {"city": "Oslo"}))
    assert not accepts(compiler, tag, qwen25("get_weather", {"city": "Oslo", "unit": "C"})), "strict"
    assert accepts(compiler, tag, qwen25("search", {"anything": [1, 2]})), "not strict: any object"
    assert not accepts(compiler, tag, qwen25("delete_all", {})), "only offered functions"


def test_native_reply_is_read_with_the_servers_parser_and_reasoning():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), "glm45", "native")
    outputs = ChatOutputs(plan, "glm45", True, "")
    assert outputs.reasoning and not outputs.starts_in_reasoning
    message, finish = outputs.message("<think>plan</think>" + glm45("get_time", []), "stop")
    assert message.reasoning_content == "plan" and finish == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_time"]


@pytest.mark.parametrize("parser, key", [("qwen3_coder", "a>b"), ("glm45", "x</arg_key>y"),
                                         ("glm47", " padded "), ("qwen3_coder", "tail\n")])
def test_property_names_the_tags_cannot_carry_are_400(parser, key):
    """The grammar would enforce them and the parser then read another key (found by a
    bad-input pass: `<parameter=a>b>` was read as key "a"); the JSON format carries any name."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for fields, constraint in (({"tool_choice": "required"}, "native"), ({}, "json")):
        with pytest.raises(InvalidRequest) as err:
            plan_tools(request(tools=[tool], **fields), parser, constraint)
        assert err.value.param == "tools" and repr(key) in str(err.value)
    assert plan_tools(request(tools=[tool], tool_choice="required"), "qwen25", "native").native
    loose = copy.deepcopy(tool)
    del loose["function"]["strict"]
    assert plan_tools(request(tools=[loose]), parser).native is None, "not enforced: no check"
