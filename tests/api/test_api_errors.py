"""Bad requests get OpenAI error bodies with 4xx codes, before any SSE byte, and never kill the
server (field cases C07, C08, C09, C10, C11, C23's edge, plus auth and unknown models)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, TINY_CONTEXT

MAX_ERROR_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_server):
    yield tiny_server
    tiny_server.assert_alive()


def assert_error(r: httpx.Response, status: int, code: str | None = None,
                 err_type: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert len(r.content) < MAX_ERROR_BODY
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == err_type
    if code is not None:
        assert err["code"] == code
    return err


def completion(server, **fields) -> httpx.Response:
    return server.post("/v1/completions", json={"model": server.model, **fields})


def chat(server, **fields) -> httpx.Response:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return server.post("/v1/chat/completions", json=body)


# ---- auth, routing, models --------------------------------------------------------------------
def test_api_key_required(server):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
        assert_error(r, 401, "invalid_api_key", "authentication_error")
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # health needs no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0
                      ).models.list()


def test_models_reports_effective_context(server):
    (card,) = server.get("/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"]
    assert card["max_model_len"] == TINY_CONTEXT


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(server, stream):
    r = server.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi", "stream": stream})
    assert "gpt-9" in assert_error(r, 404, "model_not_found", "not_found_error")["message"]
    r = server.post("/v1/chat/completions", json={"model": "gpt-9", "stream": stream,
                                                  "messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 404, "model_not_found", "not_found_error")


def test_unknown_route_and_method(server):
    assert_error(server.get("/v1/nothing"), 404, err_type="not_found_error")
    assert server.get("/v1/completions").status_code == 405
    assert "error" in server.get("/v1/completions").json()


# ---- C10: same status streaming or not, before any SSE byte ----------------------------------
C10_CASES = [
    ({"max_tokens": TINY_CONTEXT + 1}, "context_length_exceeded"),
    ({"temperature": -1}, None), ({"top_p": 1.5}, None), ({"n": 0}, None), ({"stop": 5}, None),
    ({"max_tokens": -1}, None), ({"top_k": -5}, None), ({"logprobs": 100}, None),
    ({"stop_token_ids": [10**9]}, None), ({"frequency_penalty": 3}, None),
]


@pytest.mark.parametrize("fields, code", C10_CASES)
def test_invalid_params_same_status_stream_or_not(server, fields, code):
    for route in (completion, chat):
        if route is chat and "logprobs" in fields:
            fields = {"logprobs": True, "top_logprobs": 100}
        errors = [assert_error(route(server, prompt="Hi", stream=stream, **fields), 400, code)
                  for stream in (False, True)]
        assert errors[0]["param"] == errors[1]["param"]


def test_too_many_top_logprobs_names_the_field_the_client_sent(server):
    """Chat's top_logprobs and completions' logprobs share the engine's limit; the error names
    the request's own field."""
    for route, fields, param in ((chat, {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
                                 (completion, {"logprobs": 50}, "logprobs")):
        err = assert_error(route(server, prompt="Hi", **fields), 400)
        assert err["param"] == param and "50" in err["message"] and param in err["message"], err


def test_openai_client_sees_bad_request_when_streaming(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, stream=True, temperature=-1,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"


# ---- C09: context length ----------------------------------------------------------------------
def test_context_length_limits(server):
    limit = server.get("/v1/models").json()["data"][0]["max_model_len"]
    ok = completion(server, prompt=[100] * (limit - 1), max_tokens=1, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    for prompt, max_tokens in (([100] * limit, 1), ([100] * (limit + 500), 1), ([100] * 10, limit),
                               ([100] * limit, None)):
        for stream in (False, True):
            err = assert_error(completion(server, prompt=prompt, max_tokens=max_tokens,
                                          stream=stream), 400, "context_length_exceeded")
            assert str(limit) in err["message"] and str(len(prompt)) in err["message"]
    err = assert_error(chat(server, max_tokens=limit), 400, "context_length_exceeded")
    assert str(limit) in err["message"]


# ---- C07 / C08: empty prompts, max_tokens edges -------------------------------------------------
@pytest.mark.parametrize("prompt", ["", [""], [], [[]], ["", "hi"], None])
@pytest.mark.parametrize("max_tokens", [20, 0])
def test_empty_prompts_never_500(server, prompt, max_tokens):
    fields = {"max_tokens": max_tokens} if prompt is None else {"prompt": prompt,
                                                                  "max_tokens": max_tokens}
    r = completion(server, **fields)
    if r.status_code == 200:
        assert r.json()["choices"]
    else:
        assert_error(r, 400)


def test_empty_messages(server):
    assert_error(chat(server, messages=[]), 400)
    r = chat(server, messages=[{"role": "user", "content": ""}], max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0


def test_out_of_range_token_ids(server):
    for prompt in ([10**7], [-1], [[1, 2], [49152]]):
        assert_error(completion(server, prompt=prompt), 400)


def test_logit_bias_forces_a_token_and_bad_bias_is_400(server):
    picked = []
    for token in ("5", "6"):
        r = completion(server, prompt="Hi", max_tokens=3, temperature=0, logprobs=0, logit_bias={token: 100})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and len(set(tokens)) == 1
        picked.append(tokens[0])
    assert picked[0] != picked[1]
    for bias in ({"x": 1}, {"-1": 1}, {"5": 101}, {"10000000": 1}, {"5": "a lot"}):
        assert_error(completion(server, prompt="Hi", logit_bias=bias), 400)


def test_unsupported_features_are_400(server):
    assert_error(completion(server, prompt="Hi", suffix="x"), 400)
    for best_of in (0, -1, 5):
        assert_error(completion(server, prompt="Hi", best_of=best_of), 400)
    assert completion(server, prompt="Hi", max_tokens=1, best_of=1).status_code == 200
    assert_error(chat(server, tools=[{"type": "function", "function": {"name": "f"}}]), 400)
    assert_error(chat(server, top_logprobs=2), 400)  # without logprobs: true


# ---- C11: malformed bodies ----------------------------------------------------------------------
MALFORMED = [
    ("no content type", b'{"prompt": "hi"}', {}),
    ("not json", b"not json", {"content-type": "application/json"}),
    ("truncated", b'{"prompt": "hi", "max_tok', {"content-type": "application/json"}),
    ("form", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ("array body", b"[1, 2]", {"content-type": "application/json"}),
    ("empty body", b"", {"content-type": "application/json"}),
]


@pytest.mark.parametrize("name, body, headers", MALFORMED, ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies(server, name, body, headers, route):
    assert_error(server.post(route, content=body, headers=headers), 400)


@pytest.mark.parametrize("fields", [
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user"}], "max_tokens": "10"},
    {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
    {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "schema": {"type": "object"}}},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "y"}},
])
def test_wrong_nested_types(server, fields):
    assert_error(server.post("/v1/chat/completions", json={"model": server.model, **fields}), 400)


def test_prompt_as_object(server):
    assert_error(completion(server, prompt={"text": "hi"}), 400)


def test_huge_malformed_inputs_give_bounded_errors(server):
    many = {"model": server.model, "messages": [{"role": "robot", "content": "x" * 100}] * 5000}
    err = assert_error(server.post("/v1/chat/completions", json=many), 400)
    assert "more errors" in err["message"]
    big = json.dumps({"model": server.model, "prompt": "word " * 1_000_000}).encode()  # ~5 MB
    r = server.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_error(r, 400, "context_length_exceeded")
    big_ids = {"model": server.model, "prompt": [[1, 2, "x"]] * 20_000}
    assert_error(server.post("/v1/completions", json=big_ids), 400)
