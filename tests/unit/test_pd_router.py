"""The router's PD dispatch over mock workers: when one leg fails the other is cancelled, not awaited (C28); a prefill 4xx reaches the client; a stream is committed only at decode's first event."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from radixserve.router.pd import PDRouter

P, D = "http://prefill:1", "http://decode:2"


class Registry:
    def __init__(self, url):
        self.worker = SimpleNamespace(url=url)
        self.in_flight = 0

    def routable(self):
        return [self.worker]

    def acquire(self, url):
        self.in_flight += 1

    def release(self, url):
        self.in_flight -= 1


def side(url, http):
    policy = SimpleNamespace(select=lambda key, cands: SimpleNamespace(worker=cands[0]))
    return SimpleNamespace(registry=Registry(url), policy=policy, http=http,
                           config=SimpleNamespace(connect_timeout_s=1.0))


def run(prefill_handler, decode_handler, body=None):
    """Forward one request; returns (response status, body bytes, events seen by handlers)."""
    seen: dict[str, object] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"disaggregation_mode": "prefill",
                                             "bootstrap_address": "tcp://127.0.0.1:8998"})
        fn = prefill_handler if request.url.host == "prefill" else decode_handler
        return await fn(request, seen)

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        router = PDRouter(side(P, http), side(D, http))
        resp = await asyncio.wait_for(router.forward(
            "/v1/completions", body or {"prompt": "hi", "max_tokens": 2}, {}, None,
            bool((body or {}).get("stream"))), 10)
        chunks = b""
        if hasattr(resp, "body_iterator"):
            async for chunk in resp.body_iterator:
                chunks += chunk
        else:
            chunks = resp.body
        await asyncio.sleep(0)   # let cancellations run
        seen["in_flight"] = (router.prefill.registry.in_flight, router.decode.registry.in_flight)
        await http.aclose()
        return resp.status_code, chunks
    status, data = asyncio.run(main())
    return status, data, seen


async def hang(request, seen):
    key = "prefill" if request.url.host == "prefill" else "decode"
    seen[key + "_body"] = json.loads(request.content)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        seen[key + "_cancelled"] = True
        raise


async def reset(request, seen):
    raise httpx.ConnectError("connection reset")


async def chunks(parts):
    """A streamed body (a worker's SSE events, one network read each)."""
    for part in parts:
        yield part


async def prefill_ok(request, seen):
    seen["prefill_body"] = json.loads(request.content)
    return httpx.Response(200, json={"choices": [{"text": "x"}]})


def test_decode_transport_failure_cancels_the_prefill_leg():
    status, data, seen = run(hang, reset)
    assert status == 502 and b"decode" in data
    assert seen.get("prefill_cancelled"), seen
    assert seen["in_flight"] == (0, 0)


def test_prefill_error_cancels_the_decode_leg_and_reaches_the_client():
    async def too_long(request, seen):
        return httpx.Response(400, json={"error": {"message": "too long", "type": "invalid_request_error",
                                                   "code": "context_length_exceeded"}})
    status, data, seen = run(too_long, hang)
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"
    assert seen.get("decode_cancelled"), seen
    assert seen["in_flight"] == (0, 0)


def test_both_legs_share_the_bootstrap_room_and_prefill_is_not_streamed():
    async def decode_ok(request, seen):
        seen["decode_body"] = json.loads(request.content)
        events = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
        return httpx.Response(200, content=chunks(events), headers={"content-type": "text/event-stream"})
    status, data, seen = run(prefill_ok, decode_ok, {"prompt": "hi", "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    p, d = seen["prefill_body"], seen["decode_body"]
    assert p["bootstrap_room"] == d["bootstrap_room"] and p["bootstrap_port"] == 8998
    assert p["stream"] is False and "stream_options" not in p and d["stream"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_error_before_any_token_is_the_status(stream):
    error = {"error": {"message": "prefill/decode handoff failed", "type": "kv_transfer_failed",
                       "code": "kv_transfer_failed"}}

    async def decode_fails(request, seen):
        if stream:   # the worker said 200 at acceptance, then its first event is the error
            return httpx.Response(200, content=chunks([b"data: " + json.dumps(error).encode() + b"\n\n"]),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(500, json=error)
    status, data, _ = run(prefill_ok, decode_fails, {"prompt": "hi", "stream": stream})
    assert status == 500 and json.loads(data)["error"]["code"] == "kv_transfer_failed"
