"""response_format over HTTP on the default model: json_schema and json_object outputs parse and
match, streamed text equals the non-streamed text, unusable formats are 400 and leave the server
serving."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.streams import post_stream

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person. Reply with a JSON object with their name and age."}]


@pytest.fixture(scope="module")
def server(gguf_server):
    yield gguf_server
    gguf_server.assert_alive()


def chat(server, **fields):
    return server.post("/v1/chat/completions", json={"model": server.model, "messages": ASK, **fields})


@pytest.mark.parametrize("response_format, schema", [
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, PERSON),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_output_matches_the_format_stream_and_not(server, response_format, schema):
    fields = dict(max_tokens=200, temperature=0, response_format=response_format)
    r = chat(server, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"
    res = post_stream(server.http, "/v1/chat/completions", {"model": server.model, "messages": ASK, **fields})
    assert res.texts[0] == choice["message"]["content"] and res.finish[0] == ["stop"]


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x"}},                       # no schema
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
    {"type": "yaml"},
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unusable_format_is_400(server, response_format, path):
    body = {"messages": ASK} if path == "/v1/chat/completions" else {"prompt": "A person as JSON:"}
    r = server.post(path, json={"model": server.model, "max_tokens": 8, "response_format": response_format, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("response_format", "response_format.type", None)


def test_completions_take_response_format_too(server):
    """/v1/completions constrains its output like chat (vLLM accepts response_format on both); it was ignored."""
    fields = {"model": server.model, "prompt": "A person as JSON:", "max_tokens": 200, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    r = server.post("/v1/completions", json=fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), PERSON)
    assert choice["finish_reason"] == "stop"
