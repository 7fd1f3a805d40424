"""Prefix cache vs cold runs on the default model over HTTP: greedy parity with logprobs (C01) and
prompt logprobs (echo) with cache hits (C02). Cold reference = the same request right after
/flush_cache. Where greedy tokens differ, the top-2 logprob gap at the first differing position
must be about 0 (a numerical tie); anything else is a bug in the cached-prefix path."""
from __future__ import annotations

import math

import pytest

LOGPROB_TOL = 1e-3     # fp32 on CPU: cached-prefix attention vs full prefill
PROMPT_LP_TOL = 1e-4   # C02's bound for prompt logprobs across run orders
TIE_GAP = 1e-3

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "Write a short Python function that returns the factorial of a number:\n",
    "List three reasons why the sky appears blue during the day and red at sunset.",
    "Once upon a time, in a small village at the foot of a great mountain, there lived",
    "Translate the following sentence to French: The cat is sleeping on the warm windowsill.",
    "Q: What is 17 multiplied by 23? Explain each step of the calculation.\nA:",
]
SYSTEM = ("You are a concise assistant for a hardware store. Answer in one sentence, mention the "
          "aisle number when you know it, and never invent prices or stock levels. ")
SHARED = [SYSTEM + q for q in ("Where are the hammers?", "Do you sell paint brushes?",
                               "How do I return a broken drill?", "What time do you open?")]


@pytest.fixture(scope="module")
def server(gguf_server):
    yield gguf_server
    gguf_server.assert_alive()


def complete(server, prompt, **fields) -> dict:
    r = server.post("/v1/completions", json={"model": server.model, "prompt": prompt,
                                             "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def flush(server) -> None:
    assert server.post("/flush_cache").json() == {"flushed": True}


def assert_same_greedy(cold: dict, warm: dict, name: str) -> None:
    """Identical tokens, or a first difference at a tie; logprobs agree before it."""
    a, b = cold["choices"][0]["logprobs"], warm["choices"][0]["logprobs"]
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        if ta != tb:
            top = sorted(a["top_logprobs"][i].values(), reverse=True)
            assert len(top) == 2 and top[0] - top[1] < TIE_GAP, \
                f"{name}: token {i} differs ({ta!r} vs {tb!r}) at a non-tie, top-2 {top}"
            return
        assert abs(a["token_logprobs"][i] - b["token_logprobs"][i]) < LOGPROB_TOL, (name, i)
    assert a["tokens"] == b["tokens"], name


def test_c01_cold_vs_warm_greedy_parity(server):
    for i, prompt in enumerate(PROMPTS):
        flush(server)
        cold = complete(server, prompt, max_tokens=16, logprobs=2)
        warm = complete(server, prompt, max_tokens=16, logprobs=2)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if cold["usage"]["prompt_tokens"] > 16:
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert_same_greedy(cold, warm, f"prompt {i}")


def test_c01_shared_system_prefix_parity(server):
    """Prompts sharing a 2-3 page system prefix, differing in the last sentence: each one run
    after its siblings (prefix hit) equals its own cold run."""
    cold = []
    for prompt in SHARED:
        flush(server)
        cold.append(complete(server, prompt, max_tokens=16, logprobs=2))
    flush(server)
    for i, prompt in enumerate(SHARED):
        warm = complete(server, prompt, max_tokens=16, logprobs=2)
        if i > 0:
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        assert_same_greedy(cold[i], warm, f"shared {i}")


def prompt_logprobs(out: dict, num_prompt: int) -> list[float | None]:
    lps = out["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == num_prompt + 1, "one entry per prompt position plus the generated token"
    assert lps[0] is None
    assert all(v is not None and math.isfinite(v) for v in lps[1:]), lps
    return lps[:num_prompt]


def assert_close(a: list, b: list, tol: float) -> None:
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a[1:], b[1:]))
    assert worst < tol, worst


def test_c02_echo_logprobs_of_a_cached_prompt(server):
    """(a) 256 copies of one token, echo + logprobs 5 + max_tokens 1, sent twice."""
    prompt = [504] * 256
    flush(server)
    first = complete(server, prompt, max_tokens=1, logprobs=5, echo=True)
    second = complete(server, prompt, max_tokens=1, logprobs=5, echo=True)
    assert_close(prompt_logprobs(first, 256), prompt_logprobs(second, 256), PROMPT_LP_TOL)
    server.assert_alive()


def test_c02_prompt_logprobs_do_not_depend_on_order(server, default_tokenizer):
    """(b) A and B share a 3-page prefix: B's prompt logprobs are the same after A, cold, and
    before A."""
    base = default_tokenizer.encode(SYSTEM * 2)[:48]
    a = base + default_tokenizer.encode(" Where are the hammers kept?")
    b = base + default_tokenizer.encode(" Can I rent a carpet cleaner?")
    flush(server)
    complete(server, a, max_tokens=1, logprobs=1, echo=True)
    b_after_a = prompt_logprobs(complete(server, b, max_tokens=1, logprobs=1, echo=True), len(b))
    flush(server)
    b_cold = prompt_logprobs(complete(server, b, max_tokens=1, logprobs=1, echo=True), len(b))
    a_after_b = prompt_logprobs(complete(server, a, max_tokens=1, logprobs=1, echo=True), len(a))
    flush(server)
    a_cold = prompt_logprobs(complete(server, a, max_tokens=1, logprobs=1, echo=True), len(a))
    assert_close(b_after_a, b_cold, PROMPT_LP_TOL)
    assert_close(a_after_b, a_cold, PROMPT_LP_TOL)
