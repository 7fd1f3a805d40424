"""The API with the embedded default model (SmolLM2-135M-Instruct), where the text matters:
answers, chat-template token counts (C23), stop strings (C15, C16), n>1 framing with choices of
different lengths (C17), concurrent stream parity (C13, C14), multi-byte text (C12), cache hits."""
from __future__ import annotations

import asyncio

import pytest

from tests.api.streams import assert_framing, post_stream

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(gguf_server):
    yield gguf_server
    gguf_server.assert_alive()


def post(server, path: str, **fields) -> dict:
    r = server.post(path, json={"model": server.model, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_capital_of_france_stream_and_not(server):
    client = server.client()
    full = client.chat.completions.create(model=server.model, messages=FRANCE, max_tokens=30,
                                          temperature=0)
    answer = full.choices[0].message.content
    assert "Paris" in answer and full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=server.model, messages=FRANCE,
                                                 max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer


def test_prompt_tokens_match_the_template(server, default_tokenizer):
    """C23: one BOS, template counts match, the same ids through /v1/completions."""
    n_ref = len(default_tokenizer.apply_chat_template(FRANCE))
    assert post(server, "/v1/chat/completions", messages=FRANCE,
                max_tokens=1)["usage"]["prompt_tokens"] == n_ref
    rendered = default_tokenizer.render_chat(FRANCE)
    assert post(server, "/v1/completions", prompt=rendered,
                max_tokens=1)["usage"]["prompt_tokens"] == n_ref
    with_system = [{"role": "system", "content": "You answer in one word."}, *FRANCE]
    n_sys = post(server, "/v1/chat/completions", messages=with_system,
                 max_tokens=1)["usage"]["prompt_tokens"]
    assert n_sys == len(default_tokenizer.apply_chat_template(with_system))
    assert rendered.count("<|im_start|>assistant") == 1


def test_stop_string_is_never_leaked(server):
    """C15: a multi-token stop string; nothing of it streams, parity holds."""
    body = {"model": server.model, "prompt": "Here is the English alphabet: A B C",
            "max_tokens": 12, "temperature": 0}
    plain = post(server, "/v1/completions", **{k: v for k, v in body.items() if k != "model"})
    assert plain["choices"][0]["text"].startswith(" D E F G")
    out = post(server, "/v1/completions", **{k: v for k, v in body.items() if k != "model"},
               stop=["D E F G"])["choices"][0]
    assert out["text"] == " " and out["finish_reason"] == "stop" and out["stop_reason"] == "D E F G"
    res = post_stream(server.http, "/v1/completions", {**body, "stop": ["D E F G"]})
    assert res.texts[0] == " " and res.finish[0] == ["stop"]


def test_a_stop_string_ending_is_counted_as_finished_not_aborted(server):
    """The server stops the engine's request when a stop string matches in the text; in the
    metrics that is a finished request, not an aborted one (the engine was still generating)."""
    before = server.metrics()
    out = post(server, "/v1/completions", prompt="Here is the English alphabet: A B C", max_tokens=12,
               temperature=0, stop=["D E F G"])["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == "D E F G"
    after = server.metrics()
    for name, change in (("num_aborted_requests_total", 0), ("num_requests_total", 1)):
        name = "radixserve:" + name
        assert after[name] - before[name] == change, name


@pytest.mark.parametrize("stop", [["\n"], ["?\n"], ["?"]])
def test_held_back_tail_is_flushed(server, stop):
    """C16: text held back as a possible stop prefix is flushed on every ending."""
    body = {"model": server.model, "prompt": "Alice: Ask me any question.\nBob: What color is "
            "the sky on Mars", "max_tokens": 8, "temperature": 0, "stop": stop}
    full = post(server, "/v1/completions", **{k: v for k, v in body.items() if k != "model"})
    res = post_stream(server.http, "/v1/completions", body)
    assert res.texts[0] == full["choices"][0]["text"]
    assert res.finish[0] == [full["choices"][0]["finish_reason"]]
    assert not any(s in res.texts[0] for s in stop)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_of_different_lengths(server, path):
    """C17 as in the field report: n=3, sampling, stop '.', so choices end at different steps."""
    body = {"model": server.model, "n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 30,
            "stop": ["."], "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "Describe the sea."}]}
                if "chat" in path else {"prompt": "The sea is"})
    res = post_stream(server.http, path, body)
    assert_framing(res, 3, chat="chat" in path, usage=True)
    assert all("." not in res.texts[i] for i in range(3))


def test_concurrent_streams_match_non_stream(server):
    """C13/C14: concurrent greedy streams join to the non-streaming text, token counts agree."""
    prompts = ["Write two sentences about cats.", "List three fruits.", "Count to five.",
               "Say hello in French.", "What is 2+2?"]
    client = server.async_client()

    async def one(prompt: str) -> tuple[str, str, int, int]:
        messages = [{"role": "user", "content": prompt}]
        kwargs = dict(model=server.model, messages=messages, max_tokens=24, temperature=0)
        stream = await client.chat.completions.create(**kwargs, stream=True,
                                                      stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            parts.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        full = await client.chat.completions.create(**kwargs)
        return "".join(parts), full.choices[0].message.content, usage.completion_tokens, \
            full.usage.completion_tokens

    async def run_all():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    for streamed, full, n_streamed, n_full in asyncio.run(run_all()):
        assert streamed == full and n_streamed == n_full


def test_multibyte_text_streams_without_replacement_chars(server):
    """C12: characters split across tokens never reach a delta as U+FFFD."""
    body = {"model": server.model, "max_tokens": 24, "temperature": 0,
            "prompt": "Emoji: 👨‍👩‍👧 🇫🇷 👍🏽 ✨\nChinese: 你好，世界。\nRepeat the emoji line:\nEmoji:"}
    res = post_stream(server.http, "/v1/completions", body)
    deltas = [c["choices"][0]["text"] for c in res.chunks if c["choices"]]
    assert not any("\ufffd" in d for d in deltas), deltas
    full = post(server, "/v1/completions", **{k: v for k, v in body.items() if k != "model"})
    assert res.texts[0] == full["choices"][0]["text"]


def test_repeated_long_prompt_hits_the_cache(server):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be kind." for i in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = post(server, "/v1/chat/completions", messages=messages, max_tokens=1)
    assert first["usage"]["prompt_tokens"] > 300
    res = post_stream(server.http, "/v1/chat/completions",
                      {"model": server.model, "messages": messages, "max_tokens": 1,
                       "stream_options": {"include_usage": True}})
    cached = res.usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < res.usage["prompt_tokens"]
