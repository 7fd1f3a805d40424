"""Bounded fuzz of the HTTP API with hypothesis-generated bodies and headers: nothing a client
sends yields a 5xx, an error body is always a bounded OpenAI error, and the engine survives."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
SMALL_INT = st.integers(-3, 6)
# Always present and never null, so that no example generates up to the whole context.
MAX_TOKENS = SMALL_INT | st.integers(10**4, 2**70) | st.text(max_size=5) \
    | st.floats(allow_nan=False) | st.lists(SMALL_INT, max_size=2)
TOKEN_IDS = st.lists(st.integers(-5, 60000), max_size=20)
TEXT = st.text(max_size=40)

COMMON = {
    "model": st.sampled_from(["tiny", "other", ""]) | JUNK,
    "temperature": st.floats(-1, 3, allow_nan=False) | JUNK,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | JUNK,
    "top_k": SMALL_INT | JUNK,
    "n": st.integers(-1, 3) | JUNK,
    "stream": st.booleans() | JUNK,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JUNK}) | JUNK,
    "stop": st.none() | TEXT | st.lists(TEXT, max_size=5) | JUNK,
    "seed": st.integers(-2**64, 2**64) | JUNK,
    "presence_penalty": st.floats(-3, 3, allow_nan=False) | JUNK,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | JUNK,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(-200, 200)) | JUNK,
    "ignore_eos": st.booleans() | JUNK,
    "min_tokens": SMALL_INT | JUNK,
}
COMPLETION = st.fixed_dictionaries({"max_tokens": MAX_TOKENS}, optional={
    **COMMON,
    "prompt": TEXT | TOKEN_IDS | st.lists(TEXT | TOKEN_IDS, max_size=3) | JUNK,
    "echo": st.booleans() | JUNK,
    "logprobs": st.integers(-1, 6) | JUNK,
    "suffix": TEXT | JUNK,
})
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | JUNK,
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                      "text": TEXT})) | JUNK,
    "name": TEXT,
})
CHAT = st.fixed_dictionaries({"max_tokens": MAX_TOKENS}, optional={
    **COMMON,
    "messages": st.lists(MESSAGE, max_size=3) | JUNK,
    "logprobs": st.booleans() | JUNK,
    "top_logprobs": st.integers(-1, 25) | JUNK,
    "max_completion_tokens": MAX_TOKENS,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | JUNK,
    "tools": st.lists(JUNK, max_size=2),
})
CONTENT_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8",
                                 "text/plain", "", "application/x-www-form-urlencoded"])
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


def check_response(r: httpx.Response, body: bytes) -> None:
    assert r.status_code < 500, (r.status_code, body[:500], r.content[:500])
    if r.status_code >= 400:
        assert len(r.content) < 64 * 1024
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "internal_error" not in r.text, r.text[-500:]
        assert r.text.rstrip().endswith("data: [DONE]")


def post(server, route: str, content: bytes, content_type: str) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return server.post(route, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzz_bodies_never_5xx(tiny_server, route):
    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=ROUTES[route], content_type=CONTENT_TYPES)
    def run(body: dict, content_type: str) -> None:
        content = json.dumps(body).encode()
        check_response(post(tiny_server, route, content, content_type), content)

    run()
    tiny_server.assert_alive()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200) | JUNK.map(lambda v: json.dumps(v).encode()),
       route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/abort_request",
                              "/flush_cache"]))
def test_fuzz_raw_bodies_never_5xx(tiny_server, raw, route):
    check_response(post(tiny_server, route, raw, "application/json"), raw)
