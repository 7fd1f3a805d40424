"""Stream migration rules of the router against fake workers (httpx MockTransport): continuation bodies, the spliced stream, chat role hold, fallbacks."""
from __future__ import annotations

import asyncio
import inspect
import json
import time

import httpx
import pytest

from radixserve.router.config import RouterConfig
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import RouteKey, make_policy
from radixserve.router.prefix_tree import ApproxPrefixTree
from radixserve.router.proxy import Forwarder
from radixserve.router.relay import RelayResponse
from radixserve.router.worker import WorkerRegistry
from tests.api.test_router_retries import ReadFailsAfter

URLS = ["http://w0", "http://w1", "http://w2"]


class Chunks(httpx.AsyncByteStream):
    """A worker body that sends `chunks` and ends cleanly."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
SSE = {"content-type": "text/event-stream"}


def sse(data) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def text_chunk(rid: str, text: str, ids: list[int], finish: str | None = None) -> bytes:
    return sse({"id": rid, "object": "text_completion", "created": 7 if rid == "a" else 9,
                "model": "m", "choices": [{"index": 0, "text": text, "logprobs": None,
                                           "finish_reason": finish, "token_ids": ids}]})


def chat_chunk(rid: str, delta: dict, ids: list[int] | None = None,
               finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return sse({"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m",
                "choices": [choice]})


ROLE = {"role": "assistant", "content": ""}
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def make(handler, health=None, **config) -> tuple[Forwarder, WorkerRegistry, list]:
    """A Forwarder over three fake workers; `handler(url, n, body)` answers POST attempt n
    (a response, or an awaitable of one: a worker slow to answer), `health(url)` a GET (a health check; default a 200). Returns (forwarder,
    registry, calls as (url, request body))."""
    cfg = RouterConfig(policy="round_robin", retry_initial_backoff_ms=1, **config)
    registry = WorkerRegistry(cfg)
    for url in URLS:
        registry.add(url)
    calls: list[tuple[str, dict]] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if request.method == "GET":
            return httpx.Response(200, json={}) if health is None else health(url)
        calls.append((url, json.loads(request.content)))
        response = handler(url, len(calls), calls[-1][1])
        return await response if inspect.isawaitable(response) else response

    policy = make_policy(cfg, registry, ApproxPrefixTree(1000, 60.0))
    http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    return Forwarder(cfg, registry, policy, RouterMetrics(), http), registry, calls


async def stream(fwd: Forwarder, body: dict, path: str = "/v1/completions") -> bytes:
    """Forward `body` as a stream; returns the body the client receives."""
    raw = json.dumps({**body, "stream": True}).encode()
    response = await fwd.forward(path, raw, {}, RouteKey("hi"), True, time.perf_counter())
    if isinstance(response, RelayResponse):
        return b"".join([chunk async for chunk in response.body_iterator])
    return response.body


def run(handler, body: dict, path: str = "/v1/completions", **config):
    """Forward one streamed request to three fake workers (`make`). Returns (client body,
    calls as (url, request body), forwarder, registry)."""
    fwd, registry, calls = make(handler, **config)
    out = asyncio.run(stream(fwd, body, path))
    assert all(w.in_flight == 0 for w in registry.list())
    return out, calls, fwd, registry


def events(body: bytes) -> list:
    out = []
    for e in body.split(b"\n\n"):
        if e:
            assert e.startswith(b"data: "), e
            out.append(e[6:] if e == b"data: [DONE]" else json.loads(e[6:]))
    return out


def migrations(fwd: Forwarder) -> dict[str, float]:
    """Migrations by outcome, outcomes still at 0 left out."""
    return {s.labels["outcome"]: s.value for m in fwd.metrics.migrations.collect()
            for s in m.samples if s.name.endswith("_total") and s.value}


def test_completion_stream_continues_on_another_worker_after_a_break():
    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=ReadFailsAfter(
                [text_chunk("a", "He", [1]), text_chunk("a", "", [2]), b'data: {"id": "a", "ch']))
        return httpx.Response(200, headers=SSE, stream=Chunks([
            text_chunk("b", "llo", [3]), text_chunk("b", "", [], "length"),
            sse({"id": "b", "created": 9, "choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]))
    out, calls, fwd, registry = run(handler, {"prompt": "hi", "max_tokens": 3,
                                              "stream_options": {"include_usage": True}})
    assert calls[0][1]["return_token_ids"] is True and "resume_token_ids" not in calls[0][1]
    assert calls[1][1]["resume_token_ids"] == [1, 2] and calls[1][0] != calls[0][0]
    got = events(out)
    assert got[-1] == b"[DONE]" and not any("error" in e for e in got[:-1])
    chunks = got[:-1]
    assert all(c["id"] == "a" and c["created"] == 7 for c in chunks)
    assert all("token_ids" not in c for e in chunks for c in e["choices"])
    assert "".join(c["text"] for e in chunks for c in e["choices"]) == "Hello"
    assert len(chunks) == 4  # the id-only chunk (text "") is not passed on
    assert chunks[-1]["usage"] == USAGE
    assert registry.get(calls[0][0]).num_failures == 1
    assert migrations(fwd) == {"success": 1.0}


def test_worker_fault_event_mid_stream_migrates_and_client_ids_are_kept():
    """(An output_anomaly event is never continued: tests/api/test_router_anomaly.py.)"""
    fault = {"error": {"message": "x", "type": "internal_error", "param": None, "code": 500}}

    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=Chunks(
                [text_chunk("a", "He", [1]), sse(fault), b"data: [DONE]\n\n"]))
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [text_chunk("b", "y", [5], "stop"), b"data: [DONE]\n\n"]))
    out, calls, fwd, _ = run(handler, {"prompt": "hi", "return_token_ids": True})
    assert calls[1][1]["resume_token_ids"] == [1]
    got = events(out)
    assert [c["choices"][0]["token_ids"] for c in got[:-1]] == [[1], [5]]
    assert migrations(fwd) == {"success": 1.0}


def test_chat_failure_before_content_is_retried_with_one_role_chunk():
    dead = {"error": {"message": "dead", "type": "engine_dead", "param": None, "code": 503}}

    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=Chunks(
                [chat_chunk("a", ROLE), sse(dead), b"data: [DONE]\n\n"]))
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [chat_chunk("b", ROLE), chat_chunk("b", {"content": "Hi"}, [4]),
             chat_chunk("b", {}, [], "stop"), b"data: [DONE]\n\n"]))
    out, calls, fwd, registry = run(handler, {"messages": [{"role": "user", "content": "x"}]},
                                    "/v1/chat/completions", disable_stream_migration=True)
    assert len(calls) == 2 and "resume_token_ids" not in calls[1][1]
    got = events(out)
    assert [e["choices"][0]["delta"] for e in got[:-1]] == [ROLE, {"content": "Hi"}, {}]
    assert registry.get(calls[0][0]).num_failures == 1 and migrations(fwd) == {}


def test_chat_stream_cut_mid_content_continues_without_a_second_role_chunk():
    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=ReadFailsAfter(
                [chat_chunk("a", ROLE), chat_chunk("a", {"content": "Hi"}, [4])]))
        assert body["resume_token_ids"] == [4]
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [chat_chunk("b", ROLE), chat_chunk("b", {"content": " there"}, [5]),
             chat_chunk("b", {}, [], "stop"), b"data: [DONE]\n\n"]))
    out, calls, fwd, _ = run(handler, {"messages": [{"role": "user", "content": "x"}]},
                             "/v1/chat/completions")
    got = events(out)
    assert [e["choices"][0]["delta"] for e in got[:-1]] == [ROLE, {"content": "Hi"},
                                                           {"content": " there"}, {}]
    assert {e["id"] for e in got[:-1]} == {"a"} and migrations(fwd) == {"success": 1.0}


@pytest.mark.parametrize("case", ["disabled", "n2", "refused", "exhausted"])
def test_streams_that_cannot_continue_end_with_an_error_event_and_done(case):
    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=ReadFailsAfter(
                [text_chunk("a", "He", [1])]))
        if case == "refused":
            return httpx.Response(400, json={"error": {"message": "no", "type":
                                                       "invalid_request_error"}})
        return httpx.Response(200, headers=SSE, stream=ReadFailsAfter([]))
    body = {"prompt": "hi", "n": 2 if case == "n2" else 1}
    out, calls, fwd, _ = run(handler, body, disable_stream_migration=case == "disabled")
    got = events(out)
    assert got[0]["choices"][0]["text"] == "He" and got[-1] == b"[DONE]" and len(got) == 3
    assert got[1]["error"]["type"] == "worker_error"
    expected = {"disabled": ({}, 1), "n2": ({"unsupported": 1.0}, 1),
                "refused": ({"refused": 1.0}, 2), "exhausted": ({"exhausted": 1.0}, 3)}[case]
    assert (migrations(fwd), len(calls)) == expected


def test_a_stream_that_ends_cleanly_without_done_is_continued():
    """Every worker stream ends with `data: [DONE]`; one that closes cleanly before it was cut
    short (not a complete answer): continued on another worker like a broken one."""
    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=Chunks([text_chunk("a", "He", [1])]))
        return httpx.Response(200, headers=SSE, stream=Chunks([
            text_chunk("b", "llo", [2], "length"), b"data: [DONE]\n\n"]))
    out, calls, fwd, registry = run(handler, {"prompt": "hi", "max_tokens": 2})
    got = events(out)
    assert got[-1] == b"[DONE]" and "".join(c["text"] for e in got[:-1] for c in e["choices"]) == "Hello"
    assert calls[1][1]["resume_token_ids"] == [1]
    assert registry.get(calls[0][0]).num_failures == 1
    assert migrations(fwd) == {"success": 1.0}
