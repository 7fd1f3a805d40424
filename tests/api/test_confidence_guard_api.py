"""--enable-confidence-detector through a real tiny-model worker: which requests the detector
watches, how a detection ends them (as any output anomaly), and that the confidences it reads
never reach a client that did not ask for logprobs. The thresholds here make every window of
a watched request "low" (mean below 0 and below its start + 100), judged from token 16 (the
baseline's length), so the test shows the plumbing; the detection and false-positive
rates on real corruption are measured on the default model (benchmarks/spec_anomaly.py,
docs/anomaly_guard.md)."""
from __future__ import annotations

import json
import time

import pytest

from tests.api.conftest import TINY_CONTEXT, start_tiny_server

WINDOW = 8
WAIT_S = 60.0   # only to avoid hanging a broken run, never a pass/fail threshold


@pytest.fixture(scope="module")
def server(request):
    server = start_tiny_server(request, ["--context-length", str(TINY_CONTEXT), "--max-total-tokens", "8192",
                                         "--enable-debug-endpoints", "--enable-confidence-detector",
                                         "--confidence-window", str(WINDOW),
                                         "--confidence-min-mean-logprob", "0",
                                         "--confidence-min-drop", "-100"])
    yield server
    try:
        server.assert_no_tracebacks()
    finally:
        server.stop()


def complete(server, **body):
    return server.post("/v1/completions", json={"model": server.model, "prompt": "Tell me a story",
                                                "ignore_eos": True, **body})


def pages_freed(server) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        p = server.pages()
        if p["invariant_holds"] and p["num_in_use_pages"] == 0 and p["num_running"] == 0:
            return
        time.sleep(0.2)
    pytest.fail("pages of the stopped request were not freed")


def test_a_watched_request_is_stopped_after_one_window(server):
    r = complete(server, max_tokens=3 * WINDOW, temperature=0)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "output_anomaly" and "low_confidence" in error["message"]
    assert f"over the last {WINDOW} tokens" in error["message"]
    pages_freed(server)
    server.assert_no_leak()


def test_a_stream_ends_with_the_anomaly_error_event(server):
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3 * WINDOW, "ignore_eos": True, "temperature": 0.5, "seed": 3, "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "output_anomaly"
    pages_freed(server)


def test_unwatched_requests_finish_and_get_no_logprobs(server):
    short = complete(server, max_tokens=WINDOW - 1, temperature=0)     # never judged (< 16 tokens)
    hot = complete(server, max_tokens=3 * WINDOW, temperature=1.0, seed=5)   # above --confidence-max-temperature
    for r, n in ((short, WINDOW - 1), (hot, 3 * WINDOW)):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        assert r.json()["choices"][0]["logprobs"] is None


def test_a_client_asking_for_logprobs_gets_only_what_it_asked(server):
    r = complete(server, max_tokens=WINDOW - 1, temperature=0, logprobs=2)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == WINDOW - 1 and all(len(t) == 2 for t in lp["top_logprobs"])


def test_a_grammar_constrained_request_is_not_watched(server):
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "max_tokens": 3 * WINDOW, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
