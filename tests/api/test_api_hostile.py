"""Hostile requests from issue 11 against a server with few open-request slots and a 12 MB body
limit: integer overflows are 400s that hold no slot, underflowing sampling values give the
greedy text, 10 MB texts are refused by their size, and the server keeps serving afterwards."""
from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import start_tiny_server

MAX_RUNNING, MAX_QUEUED = 1, 2
SLOTS = MAX_RUNNING + MAX_QUEUED          # open requests the server admits
BODY_LIMIT = 12_000_000
TEN_MB = 10_000_000


@pytest.fixture(scope="module")
def small_server(request):
    """Three open-request slots, so that leaking even one per request shows within a few."""
    server = start_tiny_server(request, ["--context-length", "512", "--max-total-tokens", "4096",
                                         "--page-size", "16", "--enable-debug-endpoints",
                                         "--max-running-requests", str(MAX_RUNNING),
                                         "--max-queued-requests", str(MAX_QUEUED),
                                         "--max-request-body-bytes", str(BODY_LIMIT)])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == param, err


def open_requests(server) -> int:
    return server.get("/get_server_info").json()["num_open_requests"]


# The exact requests of the finding 1 (raw JSON: Python's json would write them the same).
OVERFLOWS = [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "seed": 18446744073709551616}', "seed"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
                             '"top_k": 18446744073709551616}', "top_k"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, '
                        '"stop_token_ids": [1000000000000000000000000000000]}', "stop_token_ids"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
                             '"stream": true, "seed": 18446744073709551616}', "seed"),
]


@pytest.mark.parametrize("route, body, param", OVERFLOWS)
def test_overflowing_integers_are_400_and_hold_no_slot(small_server, route, body, param):
    for _ in range(3 * SLOTS):    # well past every slot: a leak would turn the next into 503s
        r = small_server.post(route, content=body, headers={"content-type": "application/json"})
        assert_400(r, param)
    assert open_requests(small_server) == 0
    small_server.assert_alive()
    small_server.assert_no_leak()


# ---- finding 2: underflowing sampling parameters --------------------------------------------
def completion_text(server, **fields) -> str:
    r = server.post("/v1/completions", json={"prompt": "The capital of France is",
                                              "max_tokens": 8, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_underflowing_sampling_values_give_the_greedy_text(small_server):
    """T=1e-38 and top_p=1e-300 made the float32 probabilities NaN and drew the last vocabulary
    id; both are the greedy text now (T below 1e-5 is greedy; top_p keeps the top token)."""
    greedy = completion_text(small_server, temperature=0)
    assert completion_text(small_server, temperature=1e-38, seed=1) == greedy
    assert completion_text(small_server, temperature=1.0, top_p=1e-300, seed=1) == greedy


def test_unrepresentable_repetition_penalty_is_400(small_server):
    r = small_server.post("/v1/completions", json={"prompt": "Hi", "repetition_penalty": 1e-300})
    assert_400(r, "repetition_penalty")
    assert "float32" in r.json()["error"]["message"]


# ---- finding 3: size limits before work --------------------------------------------------------
# The unit tests (tests/unit/test_text_bound.py) show these are refused without calling the
# tokenizer; here: the HTTP status and body, and that the server is unharmed.
@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "x" * TEN_MB}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * TEN_MB}]}),
])
def test_ten_megabyte_text_is_refused_by_size(small_server, route, body):
    r = small_server.post(route, json={"max_tokens": 1, **body})
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "bytes" in err["message"], err
    small_server.assert_alive()


def test_body_over_the_flag_is_413(small_server):
    body = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    r = small_server.post("/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:500]
    assert "--max-request-body-bytes" in r.json()["error"]["message"]
    small_server.assert_alive()
    assert open_requests(small_server) == 0
