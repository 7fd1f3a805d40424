"""/v1/chat/completions over a real server with a tiny random-weight model: parity, framing,
logprobs, token limits and usage."""
from __future__ import annotations

import pytest

from tests.api.conftest import TINY_CONTEXT
from tests.api.streams import assert_framing, post_stream

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tiny_server):
    yield tiny_server
    tiny_server.assert_alive()


def chat(server, **fields) -> dict:
    body = {"model": server.model, "messages": MESSAGES, **fields}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_stream_equals_non_stream(server):
    client = server.client()
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_prompt_tokens_match_the_template(server, default_tokenizer):
    """C23: usage counts exactly the template's tokens; a system message adds tokens."""
    out = chat(server, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(default_tokenizer.apply_chat_template(MESSAGES))
    user_only = chat(server, messages=MESSAGES[1:], max_tokens=1)["usage"]["prompt_tokens"]
    assert user_only == len(default_tokenizer.apply_chat_template(MESSAGES[1:]))
    assert out["usage"]["prompt_tokens"] != user_only


@pytest.mark.parametrize("usage", [True, False])
def test_n_framing(server, usage):
    """C17: role once per index, one finish chunk per index after its content, usage last."""
    body = {"model": server.model, "messages": MESSAGES, "n": 3, "temperature": 0.9, "seed": 1,
            "max_tokens": 30, "ignore_eos": True}
    opts = {"stream_options": {"include_usage": True}} if usage else {}
    # Both runs below then read the prompt from the prefix cache: a cold and a warm prefill
    # round differently, which flips T=0.9 samples of the tiny model (order-independent test).
    chat(server, max_tokens=1)
    res = post_stream(server.http, "/v1/chat/completions", {**body, **opts})
    assert_framing(res, 3, chat=True, usage=usage)
    full = chat(server, **{k: v for k, v in body.items() if k not in ("model", "messages")})
    assert [res.texts[i] for i in range(3)] == [c["message"]["content"] for c in full["choices"]]
    if usage:
        assert res.usage["completion_tokens"] == full["usage"]["completion_tokens"] == 90
    assert "completion_tokens_details" not in full["usage"]   # no --reasoning-parser here


def test_logprobs(server):
    out = chat(server, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0,
               ignore_eos=True)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    assert chat(server, max_tokens=2)["choices"][0]["logprobs"] is None
    res = post_stream(server.http, "/v1/chat/completions",
                      {"model": server.model, "messages": MESSAGES, "max_tokens": 5,
                       "logprobs": True, "temperature": 0, "ignore_eos": True})
    streamed = [e["token"] for c in res.chunks for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    assert streamed == [e["token"] for e in content]


def test_max_completion_tokens_wins(server):
    out = chat(server, max_tokens=9, max_completion_tokens=3, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 3


def test_default_max_tokens_runs_to_the_context(server):
    out = chat(server, ignore_eos=True, temperature=0)
    usage = out["usage"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == TINY_CONTEXT


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_one(server, stream):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 1, "ignore_eos": True,
            "temperature": 0}
    if stream:
        res = post_stream(server.http, "/v1/chat/completions",
                          {**body, "stream_options": {"include_usage": True}})
        assert res.finish[0] == ["length"] and res.usage["completion_tokens"] == 1
        assert res.texts[0] == chat(server, **{k: body[k] for k in ("max_tokens", "ignore_eos",
                                                                      "temperature")}
                                    )["choices"][0]["message"]["content"]
    else:
        assert chat(server, **{k: body[k] for k in ("max_tokens", "ignore_eos")}
                    )["usage"]["completion_tokens"] == 1


def test_content_parts_and_roles(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "},
                                          {"type": "text", "text": "colours."}]}]
    a = chat(server, messages=parts, max_tokens=4, temperature=0, ignore_eos=True)
    b = chat(server, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=4,
             temperature=0, ignore_eos=True)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    convo = [*MESSAGES, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More"}]
    assert chat(server, messages=convo, max_tokens=2)["usage"]["prompt_tokens"] > \
        chat(server, max_tokens=2)["usage"]["prompt_tokens"]


def test_streamed_stop_reason_names_the_stop_token_id_as_the_collected_one(server):
    """The finish chunk of a stream carries stop_reason as the collected choice does: the id of a
    stop_token_ids match (vLLM), null at the length limit."""
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    ids = [i for c in post_stream(server.http, "/v1/chat/completions", body).chunks
           for ch in c["choices"] for i in ch.get("token_ids") or []]
    stop = {**body, "stop_token_ids": [ids[1]]}
    full = chat(server, **{k: v for k, v in stop.items() if k not in ("model", "messages")})
    assert (full["choices"][0]["finish_reason"], full["choices"][0]["stop_reason"]) == ("stop", ids[1])
    for fields, want in ((stop, ids[1]), (body, None)):
        res = post_stream(server.http, "/v1/chat/completions", fields)
        last = [ch for c in res.chunks for ch in c["choices"] if ch["finish_reason"]]
        assert [(ch["finish_reason"], ch["stop_reason"]) for ch in last] == [
            ("stop" if want is not None else "length", want)]
