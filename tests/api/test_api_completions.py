"""/v1/completions over a real server with a tiny random-weight model: prompt forms, stream vs
non-stream parity, n>1 framing, echo and logprobs, max_tokens edges, usage and cached tokens."""
from __future__ import annotations

import pytest

from tests.api.streams import assert_framing, post_stream

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_server):
    yield tiny_server
    tiny_server.assert_alive()


def complete(server, **fields) -> dict:
    r = server.post("/v1/completions", json={"model": server.model, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_round_trip(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="The sky is", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == server.model
    assert out.choices[0].finish_reason == "length" and out.choices[0].index == 0
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(model=server.model, prompt="The sky is", max_tokens=5,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


@pytest.mark.parametrize("prompt", ["Once upon a time", "1, 2, 3,", "def f(x):\n    return"])
def test_stream_equals_non_stream(server, prompt):
    body = {"model": server.model, "prompt": prompt, "max_tokens": 24, **GREEDY}
    full = complete(server, **body)
    res = post_stream(server.http, "/v1/completions",
                      {**body, "stream_options": {"include_usage": True}})
    assert_framing(res, 1, chat=False, usage=True)
    assert res.texts[0] == full["choices"][0]["text"]
    assert res.finish[0] == [full["choices"][0]["finish_reason"]] == ["length"]
    assert res.usage["completion_tokens"] == full["usage"]["completion_tokens"] == 24
    assert res.usage["prompt_tokens"] == full["usage"]["prompt_tokens"]


def test_prompt_forms(server, default_tokenizer):
    text = "The quick brown fox"
    ids = default_tokenizer.encode(text)
    by_text = complete(server, prompt=text, max_tokens=6, **GREEDY)
    by_ids = complete(server, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)

    many = complete(server, prompt=[text, "Hello"], n=2, max_tokens=3, **GREEDY)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == by_text["choices"][0]["text"][:len(many["choices"][0]["text"])]
    assert many["usage"]["prompt_tokens"] == len(ids) + len(default_tokenizer.encode("Hello"))
    assert many["usage"]["completion_tokens"] == 4 * 3

    arrays = complete(server, prompt=[ids, [5, 6, 7]], max_tokens=2, **GREEDY)
    assert len(arrays["choices"]) == 2 and arrays["usage"]["prompt_tokens"] == len(ids) + 3


@pytest.mark.parametrize("stream_usage", [True, False])
def test_n_framing(server, stream_usage):
    """C17 on completions: choices end at different lengths (stop token ids from the greedy run)."""
    body = {"model": server.model, "prompt": "Tell me a story", "n": 3, "temperature": 0.9,
            "seed": 7, "max_tokens": 30, "ignore_eos": True}
    full = complete(server, **body)
    assert sorted(c["index"] for c in full["choices"]) == [0, 1, 2]
    assert full["usage"]["completion_tokens"] == 90
    opts = {"stream_options": {"include_usage": True}} if stream_usage else {}
    res = post_stream(server.http, "/v1/completions", {**body, **opts})
    assert_framing(res, 3, chat=False, usage=stream_usage)
    # Same seed per choice -> the same texts as the non-streaming request.
    assert [res.texts[i] for i in range(3)] == [c["text"] for c in full["choices"]]


def test_seeded_choices_differ_and_repeat(server):
    body = {"prompt": "Pick a word:", "n": 4, "temperature": 1.0, "seed": 123, "max_tokens": 8,
            "ignore_eos": True}
    a, b = complete(server, **body), complete(server, **body)
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) > 1


def test_echo_with_zero_tokens_scores_the_prompt(server, default_tokenizer):
    """C08: echo + logprobs + max_tokens 0 returns the prompt with its logprobs."""
    prompt = "Your answer: Yes"
    n_prompt = len(default_tokenizer.encode(prompt))
    out = complete(server, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n_prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == prompt
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                            "total_tokens": n_prompt, "prompt_tokens_details": out["usage"]["prompt_tokens_details"]}
    plain = complete(server, prompt=prompt, max_tokens=0)
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0
    res = post_stream(server.http, "/v1/completions", {"model": server.model, "prompt": prompt,
                                                       "echo": True, "max_tokens": 0})
    assert res.texts[0] == prompt and res.finish[0] == ["length"]


def test_echo_with_generation(server):
    prompt = "Counting: one two"
    out = complete(server, prompt=prompt, echo=True, logprobs=2, max_tokens=4, **GREEDY)
    choice = out["choices"][0]
    plain = complete(server, prompt=prompt, max_tokens=4, **GREEDY)["choices"][0]["text"]
    assert choice["text"] == prompt + plain
    lp = choice["logprobs"]
    n = out["usage"]["prompt_tokens"] + 4
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["text_offset"] == sorted(lp["text_offset"])
    res = post_stream(server.http, "/v1/completions", {"model": server.model, "prompt": prompt,
                                                       "echo": True, "max_tokens": 4, **GREEDY})
    assert res.texts[0] == choice["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_one(server, stream):
    """C08: exactly one token in both modes, finish_reason length."""
    body = {"model": server.model, "prompt": "Answer:", "max_tokens": 1, **GREEDY}
    if stream:
        res = post_stream(server.http, "/v1/completions",
                          {**body, "stream_options": {"include_usage": True}})
        assert res.finish[0] == ["length"] and res.usage["completion_tokens"] == 1
    else:
        out = complete(server, **body)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 1


def test_logprobs_format(server):
    out = complete(server, prompt="Logprobs please", max_tokens=5, logprobs=3, **GREEDY)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: chosen is the top
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    res = post_stream(server.http, "/v1/completions",
                      {"model": server.model, "prompt": "Logprobs please", "max_tokens": 5,
                       "logprobs": 3, **GREEDY})
    streamed = [t for c in res.chunks for ch in c["choices"] if ch["logprobs"]
                for t in ch["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_stop_string_trims_in_both_modes(server):
    """C15/C16 mechanics: stop on a substring of the greedy output."""
    body = {"model": server.model, "prompt": "Stop test:", "max_tokens": 30, **GREEDY}
    text = complete(server, **body)["choices"][0]["text"]
    at = next(k for k in range(6, len(text) - 3) if text.find(text[k:k + 3]) == k
              and text[k:k + 3].strip())
    stop = text[at:at + 3]
    out = complete(server, **body, stop=[stop])["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (text[:at], "stop", stop)
    res = post_stream(server.http, "/v1/completions", {**body, "stop": stop})
    assert res.texts[0] == text[:at] and res.finish[0] == ["stop"]
    kept = complete(server, **body, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[:at + 3]


def test_cached_tokens_and_n_usage(server):
    """C05: warm prompt reports cached tokens once, not n times; a cold prompt reports 0."""
    long_prompt = [1000 + i for i in range(300)]
    first = complete(server, prompt=long_prompt, max_tokens=2, **GREEDY)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = complete(server, prompt=long_prompt, max_tokens=2, **GREEDY)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 300 and cached % 16 == 0
    many = complete(server, prompt=long_prompt, n=4, temperature=0.8, max_tokens=16,
                    ignore_eos=True)
    assert many["usage"]["prompt_tokens"] == 300
    assert many["usage"]["completion_tokens"] == 64
    assert 0 < many["usage"]["prompt_tokens_details"]["cached_tokens"] <= 300
    res = post_stream(server.http, "/v1/completions",
                      {"model": server.model, "prompt": long_prompt, "n": 4, "max_tokens": 16,
                       "temperature": 0.8, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    assert res.usage["prompt_tokens"] == 300 and res.usage["completion_tokens"] == 64
    cold = complete(server, prompt=[2000 + i for i in range(300)], n=4, max_tokens=4,
                    temperature=0.8)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31])
def test_short_prompts_around_a_page(server, length):
    """C04: prompts shorter than, equal to and just past a page, each twice."""
    prompt = [300 + i for i in range(length)]
    outs = [complete(server, prompt=prompt, max_tokens=4, **GREEDY) for _ in range(2)]
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    for out in outs:
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached % 16 == 0 and cached <= max(length - 1, 0)
