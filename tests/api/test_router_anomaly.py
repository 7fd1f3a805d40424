"""Output anomalies through the router, against fake workers (httpx MockTransport): a non-streamed
request and a stream stopped before any content are retried on another worker from the prompt,
transparently and counted; a stream stopped after content is never continued from the suspect
tokens: it ends with the worker's error event (docs/anomaly_guard.md, docs/stream_migration.md)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixserve.router.policy import RouteKey
from radixserve.router.stream import StreamLedger
from tests.api.test_router_migration import (ROLE, SSE, Chunks, chat_chunk, events, make,
                                             migrations, run, sse, text_chunk)
from tests.api.test_router_retries import OK

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"


def anomaly(kind: str = "spec_acceptance") -> dict:
    """A worker's output_anomaly error body (errors.OutputAnomaly.to_dict)."""
    return {"error": {"message": f"The output of choice 0 looked broken ({kind}: ...)",
                      "type": "output_anomaly", "param": None, "code": "output_anomaly",
                      "anomaly_kind": kind}}


def counted(fwd) -> dict[tuple[str, str], float]:
    return {(s.labels["kind"], s.labels["action"]): s.value
            for m in fwd.metrics.anomalies.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


def post(handler) -> tuple[httpx.Response, list, object, object]:
    """One non-streamed completion through three fake workers (test_router_migration.make)."""
    fwd, registry, calls = make(handler)
    raw = json.dumps({"prompt": "hi", "max_tokens": 200}).encode()
    response = asyncio.run(fwd.forward("/v1/completions", raw, {}, RouteKey("hi"), False,
                                       time.perf_counter()))
    assert all(w.in_flight == 0 for w in registry.list())
    return response, calls, fwd, registry


def test_a_non_streamed_anomaly_is_retried_from_the_prompt_and_counted():
    def handler(url, n, body):
        return httpx.Response(500, json=anomaly()) if n == 1 else httpx.Response(200, json=OK)
    response, calls, fwd, registry = post(handler)
    assert response.status_code == 200 and json.loads(response.body) == OK
    assert calls[0][0] != calls[1][0] and calls[0][1] == calls[1][1]   # the same request body
    assert counted(fwd) == {("spec_acceptance", "retried"): 1.0}
    assert registry.get(calls[0][0]).num_failures == 1


def test_when_every_worker_sees_an_anomaly_the_client_gets_the_last_error():
    response, calls, fwd, _ = post(lambda url, n, body: httpx.Response(500, json=anomaly("garbled")))
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["type"] == "output_anomaly"
    assert len(calls) == 3
    assert counted(fwd) == {("garbled", "retried"): 2.0, ("garbled", "exhausted"): 1.0}


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_a_stream_stopped_before_content_is_retried_from_the_prompt(path):
    """The worker's "abort" finish chunk and error event come before any text: nothing was sent,
    so the client sees one clean stream from the second worker."""
    chat = path == CHAT

    def handler(url, n, body):
        if n == 1:
            first = [chat_chunk("a", ROLE), chat_chunk("a", {}, finish="abort")] if chat else [
                text_chunk("a", "", [], "abort")]
            return httpx.Response(200, headers=SSE, stream=Chunks([*first, sse(anomaly()), DONE]))
        if chat:
            return httpx.Response(200, headers=SSE, stream=Chunks(
                [chat_chunk("b", ROLE), chat_chunk("b", {"content": "Hi"}, [4]),
                 chat_chunk("b", {}, [], "stop"), DONE]))
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [text_chunk("b", "Hi", [4]), text_chunk("b", "", [], "stop"), DONE]))
    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "hi"}
    out, calls, fwd, registry = run(handler, body, path)
    assert len(calls) == 2 and calls[0][1] == calls[1][1] and "resume_token_ids" not in calls[1][1]
    got = events(out)
    assert got[-1] == b"[DONE]" and not any("error" in e for e in got[:-1])
    finishes = [c["finish_reason"] for e in got[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["stop"]
    assert counted(fwd) == {("spec_acceptance", "retried"): 1.0} and migrations(fwd) == {}
    assert registry.get(calls[0][0]).num_failures == 1


@pytest.mark.parametrize("migration", [True, False])
def test_a_stream_stopped_after_content_ends_with_the_error_event_and_is_not_continued(migration):
    """Before this change the router continued it with resume_token_ids = the tokens the worker's
    detector had just flagged."""
    def handler(url, n, body):
        assert n == 1, "an anomaly after content must not be continued"
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [text_chunk("a", "He", [1]), text_chunk("a", "llo", [2]),
             text_chunk("a", "", [], "abort"), sse(anomaly()), DONE]))
    out, calls, fwd, registry = run(handler, {"prompt": "hi", "max_tokens": 200},
                                    disable_stream_migration=not migration)
    got = events(out)
    assert "".join(c["text"] for e in got[:-2] for c in e["choices"]) == "Hello"
    assert got[-3]["choices"][0]["finish_reason"] == "abort"
    assert got[-2]["error"]["type"] == "output_anomaly" and got[-1] == b"[DONE]"
    assert len(calls) == 1
    assert counted(fwd) == {("spec_acceptance", "ended"): 1.0} and migrations(fwd) == {}
    assert registry.get(calls[0][0]).num_failures == 1


def test_a_chat_stream_stopped_after_content_ends_with_the_error_event():
    def handler(url, n, body):
        assert n == 1
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [chat_chunk("a", ROLE), chat_chunk("a", {"content": "Hi"}, [4]),
             chat_chunk("a", {}, finish="abort"), sse(anomaly("rare_chars")), DONE]))
    out, calls, fwd, _ = run(handler, {"messages": [{"role": "user", "content": "x"}]}, CHAT)
    got = events(out)
    assert [e["choices"][0]["delta"] for e in got[:-2]] == [ROLE, {"content": "Hi"}, {}]
    assert got[-2]["error"]["type"] == "output_anomaly" and got[-1] == b"[DONE]"
    assert counted(fwd) == {("rare_chars", "ended"): 1.0}


def test_only_a_text_less_abort_chunk_is_held():
    ledger = StreamLedger("/v1/completions", b'{"prompt": "hi"}', True)
    held = text_chunk("a", "", [], "abort")
    assert ledger.is_held(held)
    assert not ledger.is_held(text_chunk("a", "x", [3], "abort"))
    assert not ledger.is_held(text_chunk("a", "", [], "stop"))
    assert not ledger.is_held(text_chunk("a", "", [], None))
