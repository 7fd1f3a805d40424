"""Qwen3-Coder tool calls over HTTP on the tiny random model (`--tool-call-parser qwen3_coder`): a forced reply in its XML format becomes OpenAI tool_calls, streamed as whole; under `--tool-call-constraint native` "required" yields valid calls in that format."""
from __future__ import annotations

import json

import pytest

from tests.api.test_api_tool_choice import SCHEMAS, assert_valid_calls
from tests.api.test_api_tool_choice import TOOLS as CHOICE_TOOLS
from tests.api.tool_fixtures import (TOOLS, chat, force, full_message, parser_server, same_reply,
                                     stream, streamed_message)
from tests.unit.parser_cases import TRICKY, qwen3_coder

CALL = qwen3_coder("get_weather", [("city", TRICKY), ("days", "3"), ("where", '{"lat": [4, null]}')])


@pytest.fixture(scope="module")
def server(request):
    yield from parser_server(request, ["--tool-call-parser", "qwen3_coder", "--tool-call-constraint",
                                       "native"])


def test_forced_qwen3_coder_reply_streamed_equals_full(server, default_tokenizer):
    reply = "Checking.\n" + CALL + "\n" + qwen3_coder("get_time", [])
    num_tokens = force(server, default_tokenizer, reply, count=2)
    full = chat(server, tools=TOOLS)
    got = full_message(full)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == [
        ("get_weather", {"city": TRICKY, "days": 3, "where": {"lat": [4, None]}}), ("get_time", {})]
    assert (got["content"], got["finish_reason"]) == ("Checking.", "tool_calls")
    res = stream(server, tools=TOOLS)
    same_reply(streamed_message(res), got)
    assert full["usage"]["completion_tokens"] == res.usage["completion_tokens"] == num_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_required_calls_in_the_qwen3_coder_format(server, seed):
    fields = {"tools": CHOICE_TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed,
              "max_tokens": 300, "parallel_tool_calls": False}
    got = full_message(chat(server, **fields))
    assert len(got["calls"]) == 1 and got["content"] == "", got
    assert_valid_calls(got["calls"], set(SCHEMAS))
    assert got["finish_reason"] == "tool_calls"
    same_reply(streamed_message(stream(server, **fields)), got)
