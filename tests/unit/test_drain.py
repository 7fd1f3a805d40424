"""Drain (C41) without a model: admission and /health while draining, the cut-off answers (503 before the response starts, SSE error event and [DONE] after), and the shutdown sequence of GracefulServer."""
from __future__ import annotations

import asyncio
import json
import signal

import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from radixserve.drain import Drain, DrainMiddleware, GracefulServer


def make_app(drain: Drain, first_chunk: bytes = b"data: a\n\n") -> tuple[DrainMiddleware, dict]:
    """POST /v1/stream sends `first_chunk` then waits forever; POST /v1/slow never answers;
    POST /v1/quick answers at once; GET /health and /v1/models answer 200."""
    hooks = {"sent": asyncio.Event(), "forever": asyncio.Event()}

    async def stream(request):
        async def events():
            yield first_chunk
            hooks["sent"].set()
            await hooks["forever"].wait()
            yield b"never sent"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def slow(request):
        hooks["sent"].set()
        await hooks["forever"].wait()

    async def ok(request):
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/v1/stream", stream, methods=["POST"]),
                            Route("/v1/slow", slow, methods=["POST"]),
                            Route("/v1/quick", ok, methods=["POST"]),
                            Route("/v1/models", ok), Route("/health", ok)])
    return DrainMiddleware(app, drain), hooks


def test_draining_refuses_new_generations_and_health_says_so_until_undrained():
    drain = Drain(grace_s=30.0)
    client = TestClient(make_app(drain)[0])
    assert client.post("/v1/quick").status_code == 200
    drain.start("POST /admin/drain")
    refused = client.post("/v1/quick")
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "draining")
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "draining", "reason": "POST /admin/drain",
                             "num_in_flight": 0, "shutting_down": False}
    assert client.get("/v1/models").status_code == 200   # only generations are refused
    assert drain.stop()
    assert client.post("/v1/quick").status_code == 200 and client.get("/health").status_code == 200
    drain.shut_down("SIGTERM")
    assert not drain.stop() and drain.is_draining   # no undrain once shutting down


def start_request(app, path: str) -> tuple[asyncio.Task, list[dict]]:
    """POST `path` through `app` from a client that never leaves; returns its task and the
    ASGI messages sent so far (the list fills as the app sends)."""
    sent: list[dict] = []

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b"",
             "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1"}
    return asyncio.create_task(app(scope, receive, send)), sent


async def call(app, path: str, hooks: dict, drain: Drain) -> list[dict]:
    """POST `path`; once it has sent something (or started waiting), cut every request in
    flight off; returns the ASGI messages sent."""
    task, sent = start_request(app, path)
    await asyncio.wait_for(hooks["sent"].wait(), 30)
    assert drain.num_in_flight == 1
    assert drain.cut_off() == 1
    await asyncio.wait_for(task, 30)
    assert drain.num_in_flight == 0
    return sent


def body_of(sent: list[dict]) -> bytes:
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("first_chunk, gap", [(b"data: a\n\n", b""), (b"data: {\"half", b"\n\n")])
def test_a_stream_cut_off_ends_with_an_error_event_then_done(first_chunk, gap):
    async def scenario() -> list[dict]:
        drain = Drain(grace_s=1.0)
        app, hooks = make_app(drain, first_chunk)
        return await call(app, "/v1/stream", hooks, drain)

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 200
    body = body_of(sent)
    assert body.startswith(first_chunk + gap + b"data: {")
    events = body[len(first_chunk + gap):].split(b"\n\n")
    assert events[1:] == [b"data: [DONE]", b""]
    error = json.loads(events[0][len(b"data: "):])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "draining")
    assert "grace period of 1 s" in error["message"]


def test_a_request_cut_off_before_its_response_gets_a_503_not_a_truncated_200():
    async def scenario() -> list[dict]:
        drain = Drain(grace_s=2.5)
        app, hooks = make_app(drain)
        return await call(app, "/v1/slow", hooks, drain)

    sent = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    error = json.loads(body_of(sent))["error"]
    assert error["code"] == "draining" and "grace period of 2.5 s" in error["message"]


def test_shutdown_exits_at_once_when_idle_and_cuts_off_after_the_grace_period():
    async def scenario() -> None:
        idle = GracefulServer(uvicorn.Config(lambda *a: None), Drain(grace_s=600.0))
        waiter = asyncio.create_task(idle._exit_when_drained())
        idle.drain.shut_down("SIGTERM")
        await asyncio.wait_for(waiter, 30)   # not the 600 s grace: nothing was in flight
        assert idle.should_exit

        drain = Drain(grace_s=0.0)
        busy = GracefulServer(uvicorn.Config(lambda *a: None), drain)
        app, hooks = make_app(drain)
        request, sent = start_request(app, "/v1/stream")
        await asyncio.wait_for(hooks["sent"].wait(), 30)
        waiter = asyncio.create_task(busy._exit_when_drained())
        drain.shut_down("SIGTERM")
        await asyncio.wait_for(waiter, 30)
        await asyncio.wait_for(request, 30)
        assert busy.should_exit and drain.num_in_flight == 0
        assert body_of(sent).endswith(b"data: [DONE]\n\n")

    asyncio.run(scenario())


def test_a_second_sigint_answers_the_requests_in_flight_with_a_503_before_stopping():
    """Not left to uvicorn, whose forced stop cancels them into a 500 and an ASGI traceback."""
    async def scenario() -> list[dict]:
        drain = Drain(grace_s=600.0)
        server = GracefulServer(uvicorn.Config(lambda *a: None), drain)
        server._loop = asyncio.get_running_loop()
        app, hooks = make_app(drain)
        request, sent = start_request(app, "/v1/slow")
        await asyncio.wait_for(hooks["sent"].wait(), 30)
        drain.shut_down("SIGINT")
        server.handle_exit(signal.SIGINT, None)
        await asyncio.wait_for(request, 30)   # not the 600 s grace
        assert server.should_exit and drain.num_in_flight == 0
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert b"a second interrupt stopped it at once" in body_of(sent)   # not "its grace period ran out"


def test_a_negative_grace_period_is_refused():
    with pytest.raises(ValueError, match="graceful shutdown timeout"):
        Drain(grace_s=-1.0)
