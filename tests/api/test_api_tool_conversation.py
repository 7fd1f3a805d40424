"""A two-turn tool-calling conversation with the `openai` client (issue 15), Qwen2.5-format calls and Qwen3 thinking, on a template that renders tools, tool calls, tool results and enable_thinking."""
from __future__ import annotations

import json

import pytest

from radixserve.tokenizer.tokenizer import Tokenizer
from tests.api.tool_fixtures import (TOOLS, chat, force, parser_server, qwen_like_model_dir,
                                     stream, streamed_message)

QUESTION = [{"role": "system", "content": "Use tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "2"}}\n</tool_call>'
ARGS = {"city": "Paris", "days": 2}   # "2" typed per the schema (integer)


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return qwen_like_model_dir(request.getfixturevalue("tiny_model_dir"),
                               tmp_path_factory.mktemp("qwen-like") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.load(str(model_dir))


@pytest.fixture(scope="module")
def server(request, model_dir):
    yield from parser_server(request, ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"],
                             model_dir)


def test_openai_client_two_turn_tool_conversation(server, tokenizer):
    client = server.client()
    force(server, tokenizer, "Let me look that up." + CALL)
    first = client.chat.completions.create(model=server.model, messages=QUESTION, tools=TOOLS,
                                           max_tokens=100, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look that up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS

    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}
    turn_two = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    force(server, tokenizer, "It is sunny in Paris, 24 C.")
    second = client.chat.completions.create(model=server.model, messages=turn_two, tools=TOOLS,
                                            max_tokens=100, temperature=0)
    assert second.choices[0].message.content == "It is sunny in Paris, 24 C."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    # the template saw the call (arguments as an object, not a JSON string) and its result
    expected = [*QUESTION, {"role": "assistant", "content": "Let me look that up.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        result]
    assert second.usage.prompt_tokens == len(tokenizer.apply_chat_template(expected, tools=TOOLS))


def test_openai_client_streams_the_same_call(server, tokenizer):
    client = server.client()
    force(server, tokenizer, CALL + "\n" + CALL)
    chunks = list(client.chat.completions.create(model=server.model, messages=QUESTION,
                                                 tools=TOOLS, max_tokens=100, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "args": ""})
            entry["args"] += tc.function.arguments or ""
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == [("get_weather", ARGS)] * 2
    assert len({c["id"] for c in calls.values()}) == 2
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_template_gets_tools_only_when_offered(server, tokenizer):
    with_tools = chat(server, messages=QUESTION, tools=TOOLS, max_tokens=1)
    none = chat(server, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=1)
    plain = chat(server, messages=QUESTION, max_tokens=1)
    assert with_tools["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(QUESTION, tools=TOOLS))
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(
        tokenizer.apply_chat_template(QUESTION))
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_enable_thinking_opens_think_in_the_prompt(server, tokenizer):
    """The template opens <think> itself: the reply starts inside thinking and holds only
    </think>; without enable_thinking the same text is all content."""
    reply = "The user asks about Paris.\n</think>\n\nIt is sunny."
    num_tokens = force(server, tokenizer, reply, count=3)
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    full = chat(server, messages=QUESTION, **kwargs)
    msg = full["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user asks about Paris.", "It is sunny.")
    assert full["usage"]["completion_tokens"] == num_tokens
    assert full["usage"]["prompt_tokens"] == len(tokenizer.apply_chat_template(
        QUESTION, template_kwargs={"enable_thinking": True}))
    streamed = streamed_message(stream(server, messages=QUESTION, **kwargs))
    assert (streamed["reasoning"], streamed["content"]) == ("The user asks about Paris.",
                                                            "It is sunny.")
    off = chat(server, messages=QUESTION)["choices"][0]["message"]
    assert (off["reasoning_content"], off["content"]) == (None, reply)
