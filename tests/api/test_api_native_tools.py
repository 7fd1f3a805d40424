"""Tool calls enforced in the model's own (GLM) format over HTTP, on the tiny random model (issue 15): `--tool-call-constraint native` for "required" and a named function, and strict tools under "auto"; streamed and full replies agree."""
from __future__ import annotations

import copy

import pytest

from tests.api.test_api_errors import assert_error
from tests.api.test_api_tool_choice import SCHEMAS, TOOLS, UNCOMPILABLE, WEATHER, assert_valid_calls
from tests.api.tool_fixtures import (chat, full_message, parser_server, same_reply, stream,
                                     streamed_message)


@pytest.fixture(scope="module")
def server(request):
    yield from parser_server(request, ["--tool-call-parser", "glm45", "--tool-call-constraint", "native"])


def replies(server, **fields) -> dict:
    """The full reply of one request (full_message: content "" when there is none), checked
    equal to the streamed one (same seed)."""
    fields = {"tools": TOOLS, "temperature": 1.0, "max_tokens": 300, **fields}
    got = full_message(chat(server, **fields))
    same_reply(streamed_message(stream(server, **fields)), got)
    return got


@pytest.mark.parametrize("seed", [0, 1])
def test_required_calls_in_the_native_format(server, seed):
    got = replies(server, tool_choice="required", seed=seed, parallel_tool_calls=False)
    assert len(got["calls"]) == 1 and got["content"] == ""     # the grammar ends after one call
    assert_valid_calls(got["calls"], set(SCHEMAS))
    assert got["finish_reason"] == "tool_calls"
    # Parallel calls: random weights may go on calling until max_tokens cuts the last call,
    # which then comes back as content; every completed call is valid.
    got = replies(server, tool_choice="required", seed=seed)
    assert_valid_calls(got["calls"], set(SCHEMAS))
    if got["finish_reason"] == "length":
        assert got["content"] == "" or got["content"].startswith("<tool_call>"), got
    else:
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""


def test_named_function_in_the_native_format(server):
    got = replies(server, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  seed=4, parallel_tool_calls=False)
    assert_valid_calls(got["calls"], {"get_weather"})
    assert got["finish_reason"] == "stop" and got["content"] == ""


def test_a_strict_tool_under_auto_is_held_to_its_schema(server, default_tokenizer):
    strict = copy.deepcopy(WEATHER)
    strict["function"]["strict"] = True
    # The model is made to open a call; the grammar must then finish it within the schema
    # (city one of three names, days 1..14) and close it.
    ids = default_tokenizer.hf.encode("<tool_call>get_weather\n", add_special_tokens=False)
    r = server.post("/admin/fault", json={"kind": "sampler.force_tokens", "token_ids": ids, "count": 2})
    assert r.status_code == 200, r.text
    got = replies(server, tools=[strict, *TOOLS[1:]], seed=2, max_tokens=120)
    assert got["calls"] and got["calls"][0]["name"] == "get_weather"
    assert_valid_calls(got["calls"][:1], {"get_weather"})


@pytest.mark.parametrize("streaming", [False, True])
def test_a_schema_xgrammar_refuses_is_400(server, streaming):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "stream": streaming, "tools": [UNCOMPILABLE], "tool_choice": "required"}
    assert assert_error(server.post("/v1/chat/completions", json=body), 400)["param"] == "tools"


def test_text_a_grammar_forces_is_not_judged_as_a_repetition_loop(server):
    """A sampled reply whose schema forces a 320-character periodic `const`: the output-anomaly
    guard's repetition detector would call that a loop; under a grammar it is not judged."""
    loop = "ab" * 160
    schema = {"type": "object", "properties": {"code": {"const": loop}}, "required": ["code"],
              "additionalProperties": False}
    fields = {"messages": [{"role": "user", "content": "code?"}], "temperature": 1.0, "seed": 3,
              "max_tokens": 400, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "c", "schema": schema}}}
    r = server.post("/v1/chat/completions", json=fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert loop in choice["message"]["content"] and choice["finish_reason"] == "stop", choice
