"""Router retry and relay rules against fake workers (httpx MockTransport), and the routing key."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixserve.router.app import render_messages, route_key
from radixserve.router.config import RouterConfig
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import RouteKey, make_policy
from radixserve.router.prefix_tree import ApproxPrefixTree
from radixserve.router.proxy import Forwarder
from radixserve.router.relay import RelayResponse
from radixserve.router.worker import WorkerRegistry

URLS = ["http://w0", "http://w1", "http://w2"]
OK = {"choices": [{"text": "ok"}]}


class ReadFailsAfter(httpx.AsyncByteStream):
    """A worker body that sends `chunks`, then breaks the connection."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("worker died")


def make_forwarder(handler, **config) -> tuple[Forwarder, WorkerRegistry, list[str]]:
    """A Forwarder over three fake workers; `handler(url, calls)` answers each attempt."""
    cfg = RouterConfig(policy="round_robin", retry_initial_backoff_ms=1, **config)
    registry = WorkerRegistry(cfg)
    for url in URLS:
        registry.add(url)
    calls: list[str] = []

    async def transport(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        calls.append(url)
        return handler(url, len(calls))

    policy = make_policy(cfg, registry, ApproxPrefixTree(1000, 60.0))
    http = httpx.AsyncClient(transport=httpx.MockTransport(transport))
    return Forwarder(cfg, registry, policy, RouterMetrics(), http), registry, calls


def forward(fwd: Forwarder, stream: bool = False):
    return asyncio.run(_forward(fwd, stream))


async def _forward(fwd: Forwarder, stream: bool):
    body = json.dumps({"prompt": "hi", "stream": stream}).encode()
    response = await fwd.forward("/v1/completions", body, {}, RouteKey("hi"), stream,
                                 time.perf_counter())
    if isinstance(response, RelayResponse):
        chunks = [chunk async for chunk in response.body_iterator]
        return response, b"".join(chunks)
    return response, response.body


def assert_no_load(registry: WorkerRegistry) -> None:
    assert all(w.in_flight == 0 for w in registry.list()), [w.to_json(0) for w in registry.list()]


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retryable_status_moves_to_an_untried_worker(status):
    fwd, registry, calls = make_forwarder(
        lambda url, n: httpx.Response(status if n == 1 else 200, json=OK))
    response, body = forward(fwd)
    assert response.status_code == 200 and json.loads(body) == OK
    assert len(calls) == 2 and calls[0] != calls[1]
    assert_no_load(registry)


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
def test_client_errors_pass_through_unretried(status):
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                       "code": status}}
    fwd, registry, calls = make_forwarder(lambda url, n: httpx.Response(status, json=error))
    response, body = forward(fwd)
    assert response.status_code == status and json.loads(body) == error
    assert len(calls) == 1
    assert all(w.breaker.state == "closed" and w.num_failures == 0 for w in registry.list())


def test_output_anomaly_500_is_retried_elsewhere():
    anomaly = {"error": {"message": "repetition", "type": "output_anomaly", "param": None,
                         "code": "output_anomaly"}}
    fwd, registry, calls = make_forwarder(
        lambda url, n: httpx.Response(500, json=anomaly) if n == 1 else httpx.Response(200, json=OK))
    response, _ = forward(fwd)
    assert response.status_code == 200 and len(set(calls)) == 2


def test_exhausted_retries_return_the_last_worker_error_and_never_reuse_a_worker():
    fwd, registry, calls = make_forwarder(lambda url, n: httpx.Response(
        503, json={"error": {"message": f"busy {n}", "type": "server_overloaded", "param": None,
                             "code": 503}}))
    response, body = forward(fwd)
    assert response.status_code == 503 and json.loads(body)["error"]["message"] == "busy 3"
    assert sorted(calls) == URLS  # 5 attempts allowed, 3 workers: each tried once
    assert_no_load(registry)


def test_transport_errors_everywhere_give_503_no_worker_available():
    def refuse(url, n):
        raise httpx.ConnectError("refused")
    fwd, registry, calls = make_forwarder(refuse)
    response, body = forward(fwd)
    assert response.status_code == 503
    assert json.loads(body)["error"]["type"] == "no_worker_available"
    assert len(calls) == 3 and all(w.num_failures == 1 for w in registry.list())
    assert_no_load(registry)


def test_disable_retries_means_one_attempt():
    fwd, _, calls = make_forwarder(lambda url, n: httpx.Response(502, json={}),
                                   disable_retries=True)
    response, _ = forward(fwd)
    assert response.status_code == 502 and len(calls) == 1


def test_stream_is_retried_before_its_first_byte_only():
    """Without stream migration a break after content ends the stream: the cut event is never
    relayed, a worker_error event and [DONE] close it (C20: no replay)."""
    def handler(url, n):
        if n == 1:
            return httpx.Response(200, stream=ReadFailsAfter([]),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, stream=ReadFailsAfter([b'data: {"id": "x"}\n\n', b"data: {"]),
                              headers={"content-type": "text/event-stream"})
    fwd, registry, calls = make_forwarder(handler, disable_stream_migration=True)
    response, body = forward(fwd, stream=True)
    assert len(calls) == 2  # the first worker broke before any byte: retried
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0] == b'data: {"id": "x"}' and events[-1] == b"data: [DONE]"
    assert len(events) == 3  # the cut partial event is not relayed
    error = json.loads(events[1][len(b"data: "):])["error"]
    assert error["type"] == "worker_error" and error["code"] == 502
    assert registry.get(calls[1]).num_failures == 1  # the mid-stream break counts
    assert_no_load(registry)


def test_breaker_opens_after_consecutive_failures_and_worker_leaves_rotation():
    fwd, registry, calls = make_forwarder(
        lambda url, n: httpx.Response(500 if url == "http://w0" else 200, json=OK),
        cb_failure_threshold=2)
    for _ in range(6):
        assert forward(fwd)[0].status_code == 200
    assert registry.get("http://w0").breaker.state == "open"
    assert calls.count("http://w0") == 2


def test_route_key_without_tokenizer():
    assert route_key("/v1/completions", {"prompt": "abc"}, None, None) == RouteKey("abc")
    assert route_key("/v1/completions", {"prompt": [3, 4]}, None, "s") == RouteKey([3, 4], "s")
    assert route_key("/v1/completions", {"prompt": ["a", "b"]}, None, None) == RouteKey("a")
    assert route_key("/v1/completions", {"prompt": 5}, None, None) == RouteKey("")
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    assert render_messages(messages) == "system\nS\nuser\nU\n"
    assert route_key("/v1/chat/completions", {"messages": messages}, None, None).key == \
        "system\nS\nuser\nU\n"
    assert render_messages("junk") == ""


def test_route_key_with_tokenizer(default_tokenizer):
    tok = default_tokenizer
    assert route_key("/v1/completions", {"prompt": "Hello there"}, tok, None).key == \
        tok.encode("Hello there")
    messages = [{"role": "user", "content": "Hi"}]
    assert route_key("/v1/chat/completions", {"messages": messages}, tok, None).key == \
        tok.apply_chat_template(messages)
    # Malformed chat: routed by text; the worker gives the 400.
    assert route_key("/v1/chat/completions", {"messages": []}, tok, None).key == ""


def test_health_checks_use_consecutive_thresholds_and_poll_load():
    """C21 through the router: a worker whose /health says 503 (dead engine) leaves rotation
    after health_failure_threshold checks and returns after health_success_threshold passes."""
    from radixserve.router.health import HealthMonitor

    status = {"http://w0": 200}
    info = {"engine": {"num_running": 3, "num_waiting": 2, "token_usage": 0.5,
                       "cache_hit_rate": 0.25}}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json=info)
        return httpx.Response(status["http://w0"], json={})

    cfg = RouterConfig(health_failure_threshold=2, health_success_threshold=2)
    registry = WorkerRegistry(cfg)
    worker = registry.add("http://w0", healthy=False)

    async def scenario() -> list[bool]:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        monitor = HealthMonitor(cfg, registry, RouterMetrics(), http)
        monitor.expect_new("http://w0")
        seen = []
        await monitor.check(worker)  # never checked: one pass is enough
        seen.append(worker.healthy)
        await monitor.poll(worker)
        status["http://w0"] = 503
        for _ in range(2):
            await monitor.check(worker)
            seen.append(worker.healthy)
        status["http://w0"] = 200
        for _ in range(2):
            await monitor.check(worker)
            seen.append(worker.healthy)
        await http.aclose()
        return seen

    assert asyncio.run(scenario()) == [True, True, False, False, True]
    assert (worker.num_running, worker.num_queue, worker.token_usage) == (3, 2, 0.5)


def test_a_draining_worker_leaves_rotation_on_one_check_and_returns_on_the_next_pass():
    """C41: a worker whose /health says 503 draining (SIGTERM, its own /admin/drain) is out
    of rotation after one check, not health_failure_threshold of them, without counting as a
    failed check; its first 200 puts it back. A plain 503 still needs the threshold."""
    from radixserve.router.health import HealthMonitor

    answer = {"now": httpx.Response(200, json={"status": "ok"})}
    cfg = RouterConfig(health_failure_threshold=3, health_success_threshold=2)
    registry = WorkerRegistry(cfg)
    worker = registry.add("http://w0")

    async def scenario() -> list[tuple[bool, bool]]:
        http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer["now"]))
        monitor = HealthMonitor(cfg, registry, RouterMetrics(), http)
        seen = []
        for body in [{"status": "draining", "reason": "SIGTERM"}, None, {"status": "degraded"}]:
            answer["now"] = httpx.Response(503, json=body) if body else \
                httpx.Response(200, json={"status": "ok"})
            await monitor.check(worker)
            seen.append((worker.is_routable(), worker.reports_draining))
        await http.aclose()
        return seen

    assert asyncio.run(scenario()) == [(False, True), (True, False), (True, False)]
    assert worker.health_failures == 1 and worker.healthy   # degraded: one failure of three
    assert registry.get("http://w0").to_json(0)["reports_draining"] is False
