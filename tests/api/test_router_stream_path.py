"""The router app's own stream path and routing key, driven as ASGI against fake workers (httpx MockTransport): a client
that leaves mid-stream, a drain cut-off mid-stream, and tokenization that never blocks the event loop."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from radixserve.router.app import build_app
from radixserve.router.config import RouterConfig
from radixserve.router.policy import RouteKey
from radixserve.router.proxy import Forwarder
from radixserve.router.state import build_state
from tests.api.test_router_eject import Stalls
from tests.api.test_router_migration import SSE, Chunks, events, make, migrations, sse, text_chunk

WAIT_S = 60.0   # generous bound on every wait for a state change (never pass/fail timing)
URL = "http://w0:8000"
FIRST = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
OK = {"choices": [{"text": "ok"}]}


def make_state(answer, tokenizer=None, **config):
    """A router over one fake worker whose POSTs `answer(request)` answers (an httpx.Response)."""
    cfg = RouterConfig(policy="round_robin", **config)
    state = build_state(cfg, [URL], tokenizer)
    state.registry.get(URL).healthy = True

    async def transport(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/get_server_info"):
            return httpx.Response(200, json={})
        return answer(request)

    state.http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    state.forwarder = Forwarder(cfg, state.registry, state.policy, state.metrics, state.http)
    return state


class AsgiClient:
    """One POST to the app as a server would send it; `sent`: the app's messages; `leave()`: the
    client disconnects."""

    def __init__(self, app, body: dict, path: str = "/v1/completions"):
        self.app, self.path, self.sent, self._gone = app, path, [], asyncio.Event()
        self._body = json.dumps(body).encode()
        self.first_body = asyncio.Event()

    async def receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_body.set()

    def leave(self) -> None:
        self._gone.set()

    def run(self) -> asyncio.Task:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        return asyncio.create_task(self.app(scope, self.receive, self.send))

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def stalled_stream_state() -> tuple[object, Stalls]:
    worker = Stalls([FIRST])
    state = make_state(lambda request: httpx.Response(
        200, stream=worker, headers={"content-type": "text/event-stream"}))
    return state, worker


def test_client_leaving_mid_stream_closes_the_upstream_and_releases_the_worker():
    """The stream path has no task group: a disconnect while the worker holds the stream cancels
    the read, closes the upstream, releases the in-flight count, and blames no worker."""
    async def main():
        state, worker = stalled_stream_state()
        client = AsgiClient(build_app(state), {"prompt": "hi", "stream": True})
        task = client.run()
        await asyncio.wait_for(client.first_body.wait(), WAIT_S)
        await asyncio.wait_for(worker.stalled.wait(), WAIT_S)
        w = state.registry.get(URL)
        assert w.in_flight == 1 and state.drain.num_in_flight == 1
        client.leave()
        await asyncio.wait_for(task, WAIT_S)  # ends without an exception
        assert worker.closed.is_set() and worker.cut_while_holding
        assert w.in_flight == 0 and state.drain.num_in_flight == 0
        assert w.num_failures == 0 and w.breaker.state == "closed"
        body = client.body()  # the one event, nothing after the disconnect, no closing message
        assert body.count(b"\n\n") == 1 and b'"text":"a"' in body, body
        outcomes = {s.labels["outcome"]: s.value for f in state.metrics.registry.collect()
                    for s in f.samples if s.name == "radixserve_router_requests_total"}
        assert outcomes.get("failure", 0) == outcomes.get("transport_error", 0) == 0, outcomes
        await state.http.aclose()
    asyncio.run(main())


def test_drain_cut_off_mid_stream_still_ends_it_with_an_error_event():
    """A cut-off (not a disconnect) cancels the stream from outside: it is not taken for a
    client that left; the drain middleware sends the 503 event and [DONE]."""
    async def main():
        state, worker = stalled_stream_state()
        client = AsgiClient(build_app(state), {"prompt": "hi", "stream": True})
        task = client.run()
        await asyncio.wait_for(worker.stalled.wait(), WAIT_S)
        assert state.drain.cut_off() == 1
        await asyncio.wait_for(task, WAIT_S)
        body = client.body()
        assert b'"text":"a"' in body.split(b"\n\n")[0] and body.endswith(b"data: [DONE]\n\n"), body
        error = json.loads(body.split(b"\n\n")[1][len(b"data: "):])["error"]
        assert error["code"] == "draining", error
        assert worker.closed.is_set() and state.registry.get(URL).in_flight == 0
        await state.http.aclose()
    asyncio.run(main())


class BlockingTokenizer:
    """encode() holds its thread until `release` is set; `started`: it was called."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()
        self.timed_out = False

    def encode(self, text: str) -> list[int]:
        self.started.set()
        self.timed_out = not self.release.wait(WAIT_S)
        return [ord(c) for c in text[:8]]


def test_health_answers_while_a_prompt_is_tokenized():
    """The routing key is tokenized off the event loop: /health and a GET answer while a
    prompt's tokenization is held, and the request goes on once it is released."""
    tokenizer = BlockingTokenizer()

    async def main():
        state = make_state(lambda request: httpx.Response(200, json=OK), tokenizer)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            post = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x" * 1000}))
            while not tokenizer.started.is_set():
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert not post.done()
            tokenizer.release.set()
            r = await asyncio.wait_for(post, WAIT_S)
            assert r.status_code == 200 and r.json() == OK
        assert not tokenizer.timed_out
        await state.http.aclose()
    asyncio.run(main())


def test_prompt_over_the_body_limit_is_a_413_and_never_tokenized():
    tokenizer = BlockingTokenizer()
    tokenizer.release.set()

    async def main():
        state = make_state(lambda request: httpx.Response(200, json=OK), tokenizer,
                           max_request_body_bytes=4096)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            r = await client.post("/v1/completions", json={"prompt": "x" * 8192})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert not tokenizer.started.is_set()
        await state.http.aclose()
    asyncio.run(main())


def test_events_read_together_go_out_together_and_a_cut_among_them_keeps_the_ones_before():
    """One worker chunk with two content events and a fault event: the two reach the client as one
    chunk, are counted as delivered (the continuation resumes after both), and nothing after the
    fault is sent from that worker."""
    fault = {"error": {"message": "x", "type": "internal_error", "param": None, "code": 500}}

    def handler(url, n, body):
        if n == 1:
            return httpx.Response(200, headers=SSE, stream=Chunks([b"".join([
                text_chunk("a", "He", [1]), text_chunk("a", "l", [2]), sse(fault),
                text_chunk("a", "never", [9]), b"data: [DONE]\n\n"])]))
        return httpx.Response(200, headers=SSE, stream=Chunks(
            [text_chunk("b", "lo", [5], "stop") + b"data: [DONE]\n\n"]))

    async def main():
        fwd, registry, calls = make(handler)
        raw = json.dumps({"prompt": "hi", "stream": True, "return_token_ids": True}).encode()
        response = await fwd.forward("/v1/completions", raw, {}, RouteKey("hi"), True,
                                     time.perf_counter())
        chunks = [chunk async for chunk in response.body_iterator]
        assert all(w.in_flight == 0 for w in registry.list())
        return chunks, calls, fwd

    chunks, calls, fwd = asyncio.run(main())
    assert [len(events(chunk)) for chunk in chunks] == [2, 2]  # one send per batch read
    assert calls[1][1]["resume_token_ids"] == [1, 2]
    got = events(b"".join(chunks))
    assert [c["choices"][0]["token_ids"] for c in got[:-1]] == [[1], [2], [5]]
    assert got[-1] == b"[DONE]" and migrations(fwd) == {"success": 1.0}
