"""Field cases not covered elsewhere over HTTP: C18 (top_logprobs come from the model's
distribution before truncation) and the concurrent parts of C04 (identical 1-token prompts at
once, prompts sharing the first P-1 tokens)."""
from __future__ import annotations

import concurrent.futures

import pytest

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("truncation", [{"top_p": 0.5}, {"top_k": 1}, {"temperature": 0.3},
                                        {"top_p": 0.5, "top_k": 1, "temperature": 0.3}])
def test_c18_top_logprobs_are_not_truncated(gguf_server, truncation):
    def first_token(**fields) -> dict:
        r = gguf_server.post("/v1/chat/completions", json={
            "model": gguf_server.model, "messages": MESSAGES, "max_tokens": 1, "logprobs": True,
            "top_logprobs": 3, "seed": 7, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["content"][0]

    plain = first_token(temperature=1.0)
    cut = first_token(**truncation)
    assert len(cut["top_logprobs"]) == 3
    assert [t["token"] for t in cut["top_logprobs"]] == [t["token"] for t in plain["top_logprobs"]]
    for a, b in zip(cut["top_logprobs"], plain["top_logprobs"]):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert cut["logprob"] < 0, "the chosen token's logprob is not forced to 0"


def test_c04_concurrent_identical_one_token_prompts(tiny_server):
    body = {"model": tiny_server.model, "prompt": [777], "max_tokens": 3, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda _: tiny_server.post("/v1/completions", json=body), range(32)))
    assert all(r.status_code == 200 for r in outs)
    texts = {r.json()["choices"][0]["text"] for r in outs}
    assert len(texts) == 1
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in outs)
    tiny_server.assert_no_leak()


def test_c04_prompts_sharing_all_but_the_last_token_of_a_page(tiny_server):
    """Interleave prompts equal in their first P-1 tokens: no cache hit is possible (no full
    page in common) and each equals its cold run."""
    base = [900 + i for i in range(15)]
    prompts = [base + [5000 + k] for k in range(4)] + [base[:-1] + [6000]]
    tiny_server.post("/flush_cache")
    cold = []
    for p in prompts:
        tiny_server.post("/flush_cache")
        cold.append(tiny_server.post("/v1/completions", json={
            "model": tiny_server.model, "prompt": p, "max_tokens": 4, "temperature": 0}).json())
    for _ in range(2):
        for p, ref in zip(prompts, cold):
            out = tiny_server.post("/v1/completions", json={
                "model": tiny_server.model, "prompt": p, "max_tokens": 4, "temperature": 0}).json()
            assert out["choices"][0]["text"] == ref["choices"][0]["text"]
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached % 16 == 0 and cached <= len(p) - 1
    tiny_server.assert_no_leak()
