"""Tool calls and reasoning over HTTP (issue 15, field case C43): GLM-format replies forced with sampler.force_tokens through a real server, streamed and not, plus tool_choice "none" and the 400s."""
from __future__ import annotations

import json

import pytest

from tests.api.streams import assert_framing
from tests.api.test_api_errors import assert_error
from tests.api.tool_fixtures import (TIME, TOOLS, WEATHER, chat, force, full_message, same_reply,
                                     stream, streamed_message)
from tests.unit.parser_cases import TRICKY, glm45, glm47

CALL = glm45("get_weather", [("city", "Paris"), ("days", "3"), ("where", '{"lat": [4, null]}')])
ARGS = {"city": "Paris", "days": 3, "where": {"lat": [4, None]}}
REPLIES = {   # name -> (forced reply, content, [(name, arguments)])
    "typed_args": (CALL, "", [("get_weather", ARGS)]),
    "tricky_string": (glm47("get_weather", [("city", TRICKY)]), "",
                      [("get_weather", {"city": TRICKY})]),
    "no_arguments": (glm45("get_time", []), "", [("get_time", {})]),
    "two_calls": (CALL + "\n" + glm47("get_time", []), "",
                  [("get_weather", ARGS), ("get_time", {})]),
    "text_around": ("Checking.\n" + CALL + "\nOne moment.", "Checking.One moment.",
                    [("get_weather", ARGS)]),
    "reasoning_then_call": ("<think>The user wants the weather.</think>\n" + CALL, "",
                            [("get_weather", ARGS)]),
}


@pytest.fixture(scope="module")
def server(glm45_server):
    return glm45_server


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_forced_reply_streamed_equals_full(server, default_tokenizer, name):
    reply, content, calls = REPLIES[name]
    num_tokens = force(server, default_tokenizer, reply, count=2)
    full = chat(server, tools=TOOLS)
    res = stream(server, tools=TOOLS)
    assert_framing(res, 1, chat=True, usage=True)
    got = full_message(full)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == calls
    assert got["content"] == content and got["finish_reason"] == "tool_calls"
    assert full["choices"][0]["message"]["content"] == (content or None)
    same_reply(streamed_message(res), got)
    assert full["usage"]["completion_tokens"] == res.usage["completion_tokens"] == num_tokens
    if name == "reasoning_then_call":
        assert got["reasoning"] == "The user wants the weather."


def test_reasoning_split_and_usage(server, default_tokenizer):
    reply = "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4."
    num_tokens = force(server, default_tokenizer, reply, count=2)
    full = chat(server)
    msg = full["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("2 + 2 is 4.", "The answer is 4.")
    assert msg["tool_calls"] is None and full["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == num_tokens   # thinking tokens count too
    thinking = len(default_tokenizer.hf.encode("<think>\n2 + 2 is 4.\n</think>", add_special_tokens=False))
    assert full["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}
    res = stream(server)
    streamed = streamed_message(res)
    assert (streamed["reasoning"], streamed["content"]) == ("2 + 2 is 4.", "The answer is 4.")
    assert res.usage["completion_tokens_details"] == {"reasoning_tokens": thinking}


def test_no_think_block_is_all_content(server, default_tokenizer):
    force(server, default_tokenizer, "Plain answer, no thinking.")
    full = chat(server)
    msg = full["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Plain answer, no thinking.", None)
    assert full["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("reply", [
    glm45("delete_everything", [("path", "/")]),     # not an offered function
    "<tool_call>\n\n</tool_call>",                  # no name
    "<tool_call>get_weather",                       # ends inside the name
])
def test_malformed_calls_come_back_as_text(server, default_tokenizer, reply):
    force(server, default_tokenizer, "Sure: " + reply, count=2)
    full = chat(server, tools=TOOLS)
    assert full_message(full) == {"content": "Sure: " + reply, "reasoning": "", "calls": [],
                                  "finish_reason": "stop"}
    same_reply(streamed_message(stream(server, tools=TOOLS)), full_message(full))


def test_cut_by_max_tokens_keeps_finish_reason_length(server, default_tokenizer):
    num_tokens = force(server, default_tokenizer, CALL, count=2)
    full = chat(server, tools=TOOLS, max_tokens=num_tokens - 8)
    got = full_message(full)
    assert got["finish_reason"] == "length" and [c["name"] for c in got["calls"]] == ["get_weather"]
    assert json.loads(got["calls"][0]["arguments"])["city"] == "Paris"
    same_reply(streamed_message(stream(server, tools=TOOLS, max_tokens=num_tokens - 8)), got)


def test_tool_choice_none_leaves_calls_as_text(server, default_tokenizer):
    force(server, default_tokenizer, CALL)
    none = full_message(chat(server, tools=TOOLS, tool_choice="none"))
    assert none["calls"] == [] and none["content"] == CALL and none["finish_reason"] == "stop"
    # "required" and a named function are enforced by the grammar: test_api_tool_choice.py


def test_n_choices_are_parsed_each(server, default_tokenizer):
    force(server, default_tokenizer, CALL, count=4)
    full = chat(server, tools=TOOLS, n=2)
    res = stream(server, tools=TOOLS, n=2)
    assert_framing(res, 2, chat=True, usage=True)
    for i in range(2):
        assert full_message(full, i)["finish_reason"] == "tool_calls"
        same_reply(streamed_message(res, i), full_message(full, i))


NAMELESS = {"type": "function", "function": {"description": "no name"}}
BAD_TOOL_REQUESTS = {
    "tool_without_name": {"tools": [NAMELESS]},
    "empty_name": {"tools": [{"type": "function", "function": {"name": ""}}]},
    "name_with_space": {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
    "not_a_function": {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
    "duplicate_names": {"tools": [WEATHER, TIME, WEATHER]},
    "choice_names_absent_function": {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_stock_price"}}},
    "choice_not_allowed": {"tools": TOOLS, "tool_choice": "sometimes"},
    "choice_wrong_type": {"tools": TOOLS, "tool_choice": {"type": "code", "function": {"name": "x"}}},
    "choice_as_number": {"tools": TOOLS, "tool_choice": 1},
    "required_without_tools": {"tool_choice": "required"},
    "tools_not_a_list": {"tools": {"type": "function"}},
    "assistant_call_without_function": {"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
    "reserved_template_kwarg": {"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}},
}


@pytest.mark.parametrize("name", sorted(BAD_TOOL_REQUESTS))
@pytest.mark.parametrize("streaming", [False, True])
def test_bad_tool_input_is_400(server, name, streaming):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "stream": streaming, **BAD_TOOL_REQUESTS[name]}
    err = assert_error(server.post("/v1/chat/completions", json=body), 400)
    assert err["param"] and err["param"].split(".")[0] in (
        "tools", "tool_choice", "messages", "chat_template_kwargs"), err


def test_auto_without_tools_is_plain_chat(server):
    assert chat(server, tool_choice="auto", max_tokens=2)["choices"][0]["message"]["tool_calls"] is None
