"""A restarted worker rejoins the router (issue 41 item 7, C40) against fake workers (httpx MockTransport): a new instance id, fresh load, a closed breaker, and the retries and streams of a second crash landing on it."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixserve.router.config import RouterConfig
from radixserve.router.health import HealthMonitor
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import RouteKey, make_policy
from radixserve.router.prefix_tree import ApproxPrefixTree
from radixserve.router.proxy import Forwarder
from radixserve.router.relay import RelayResponse
from radixserve.router.worker import WorkerRegistry
from tests.api.test_router_migration import SSE, Chunks, events, migrations, text_chunk

A, B = "http://a", "http://b"
WAIT_S = 60.0   # generous bound on every wait for a state change (never pass/fail timing)
CONFIG = dict(policy="round_robin", retry_initial_backoff_ms=1, cb_failure_threshold=5,
              cb_success_threshold=2, cb_timeout_s=30.0, health_failure_threshold=3,
              health_success_threshold=2, load_stale_s=5.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class BreaksOn(httpx.AsyncByteStream):
    """A worker body that sends `chunks`, then breaks the connection once `crash` is set."""

    def __init__(self, chunks: list[bytes], crash: asyncio.Event, sent: list):
        self.chunks, self.crash, self.sent = chunks, crash, sent

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        self.sent.append(1)
        await self.crash.wait()
        raise httpx.ReadError("worker killed")


class Fleet:
    """Workers A and B behind a Forwarder and a HealthMonitor whose checks the test runs.
    `instance[url]`: the id its /health reports (None: none; "dead": refuses connections)."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.cfg = RouterConfig(**CONFIG)
        self.registry = WorkerRegistry(self.cfg, clock=self.clock)
        for url in (A, B):
            self.registry.add(url)
        self.instance: dict[str, str | None] = {A: "a1", B: "b1"}
        self.running = {A: 0, B: 0}
        self.crash = asyncio.Event()
        self.hold_a: asyncio.Event | None = None   # set: A answers only once it is set
        self.sent: list = []
        self.posts: list[tuple[str, dict]] = []
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self.answer))
        policy = make_policy(self.cfg, self.registry, ApproxPrefixTree(1000, 60.0))
        self.fwd = Forwarder(self.cfg, self.registry, policy, RouterMetrics(), self.http)
        self.monitor = HealthMonitor(self.cfg, self.registry, self.fwd.metrics, self.http)

    async def answer(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if self.instance[url] == "dead":
            raise httpx.ConnectError("connection refused")
        if request.url.path == "/health":
            body = {"status": "ok"} | ({"instance_id": self.instance[url]}
                                       if self.instance[url] else {})
            return httpx.Response(200, json=body)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"engine": {
                "num_running": self.running[url], "num_waiting": 0, "token_usage": 0.1}})
        body = json.loads(request.content)
        self.posts.append((url, body))
        if url == B and not self.crash.is_set():
            return self.b_answer(body)
        if url == A and self.hold_a is not None:
            await self.hold_a.wait()
        if body.get("stream"):
            return httpx.Response(200, headers=SSE, stream=Chunks([
                text_chunk("a", " more", [9], "length"), b"data: [DONE]\n\n"]))
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    def b_answer(self, body: dict) -> httpx.Response:
        """B answers until the crash: a stream's first content, a plain request nothing."""
        if body.get("stream"):
            return httpx.Response(200, headers=SSE, stream=BreaksOn(
                [text_chunk("b", "He", [1])], self.crash, self.sent))
        return httpx.Response(200, stream=BreaksOn([], self.crash, self.sent))

    async def checks(self, n: int = 1) -> None:
        for _ in range(n):
            await self.monitor.check_all()

    def kill(self, url: str) -> None:
        """The process dies: connections refused, and the requests that were in flight on it
        failed (recorded as the forwarder does)."""
        self.instance[url] = "dead"
        for _ in range(self.cfg.cb_failure_threshold):
            self.registry.get(url).record("failure")


def test_a_restarted_worker_rejoins_at_its_first_check_with_fresh_load_and_closed_breaker():
    async def scenario(fleet: Fleet) -> dict:
        a = fleet.registry.get(A)
        await fleet.checks()
        fleet.running[A] = 16
        await fleet.monitor.poll(a)
        fleet.kill(A)
        await fleet.checks(3)
        assert not a.healthy and a.breaker.state == "open"
        fleet.clock.now += 60.0            # the old reading is long stale (+16 requests)
        fleet.instance[A], fleet.running[A] = "a2", 0
        await fleet.checks()                # one interval after the restart
        return a.to_json(fleet.clock.now)

    fleet = Fleet()
    view = asyncio.run(scenario(fleet))
    assert view["healthy"] and view["breaker"] == "closed" and view["load"] == 0.0, view
    assert view["reported"]["age_s"] == 0.0 and fleet.registry.get(A).is_routable()


def test_without_an_instance_id_the_health_thresholds_and_passing_checks_close_the_breaker():
    """A worker that reports no instance id (or came back as the same process): healthy after
    health_success_threshold passes with its stale reading dropped; its breaker closed by the
    passes after cb_timeout_s (C40: within cb_timeout_s + 2 health-check intervals)."""
    async def scenario(fleet: Fleet) -> list[tuple[bool, str, float]]:
        a, seen = fleet.registry.get(A), []
        fleet.instance[A] = None
        await fleet.checks()
        fleet.running[A] = 16
        await fleet.monitor.poll(a)
        fleet.kill(A)
        await fleet.checks(3)
        fleet.clock.now += 10.0
        fleet.instance[A], fleet.running[A] = None, 0
        for _ in range(2):
            await fleet.checks()
            seen.append((a.healthy, a.breaker.state, a.load(fleet.clock.now)))
        fleet.clock.now += fleet.cfg.cb_timeout_s
        for _ in range(2):
            await fleet.monitor.poll_all()
            await fleet.checks()
            seen.append((a.healthy, a.breaker.state, a.load(fleet.clock.now)))
        return seen

    # 32: the EMA of 16 requests running plus the stale penalty (16), dropped at the flip
    assert asyncio.run(scenario(Fleet())) == [(False, "open", 32.0), (True, "open", 0.0),
                                              (True, "half_open", 0.0), (True, "closed", 0.0)]


async def crash_b(fleet: Fleet, hold_a: bool = False) -> tuple[list, list]:
    """6 requests and 9 streams dispatched to B (A drained meanwhile, as in the measured run),
    then B killed; returns their (status, events). `hold_a`: A answers none of them until
    each has reached A or ended (all at once on A, as slow requests would be)."""
    a = fleet.registry.get(A)
    a.draining = True
    plain = [asyncio.create_task(send(fleet.fwd, False)) for _ in range(6)]
    streams = [asyncio.create_task(send(fleet.fwd, True)) for _ in range(9)]
    await wait_until(lambda: len(fleet.sent) == 15, "the load in flight on B")
    a.draining = False
    fleet.hold_a = asyncio.Event() if hold_a else None
    fleet.kill(B)
    fleet.crash.set()
    if fleet.hold_a is not None:
        await wait_until(lambda: sum(url == A for url, _ in fleet.posts)
                         + sum(t.done() for t in plain + streams) == 15, "every retry placed")
        fleet.hold_a.set()
    return ([await asyncio.wait_for(t, WAIT_S) for t in plain],
            [await asyncio.wait_for(t, WAIT_S) for t in streams])


def assert_all_landed_on_a(fleet: Fleet, plain: list, streams: list) -> None:
    assert [status for status, _ in plain] == [200] * 6
    for _, got in streams:
        assert got[-1] == b"[DONE]" and not any("error" in e for e in got[:-1]), got
        assert "".join(c["text"] for e in got[:-1] for c in e["choices"]) == "He more"
    assert migrations(fleet.fwd) == {"success": 9.0}
    resumed = [body for url, body in fleet.posts if url == A and body.get("stream")]
    assert len(resumed) == 9 and all(b["resume_token_ids"] == [1] for b in resumed)
    assert all(w.in_flight == 0 for w in fleet.registry.list())


def test_a_second_crash_lands_every_retry_and_stream_on_the_restarted_worker():
    """Kill A, restart it, then kill B with 6 requests and 9 streams in flight on it: every
    request succeeds on A and every stream continues there (before the fix A's breaker was
    still open or half-open: 8 of 9 streams ended with an error)."""
    async def scenario(fleet: Fleet) -> tuple[list, list]:
        await fleet.checks()
        fleet.kill(A)
        await fleet.checks(3)
        fleet.instance[A] = "a2"
        await fleet.checks()
        return await crash_b(fleet)

    fleet = Fleet()
    assert_all_landed_on_a(fleet, *asyncio.run(scenario(fleet)))


def test_retries_with_nowhere_else_to_go_share_a_half_open_worker():
    """A's breaker is half-open (its failures were not a restart) when B crashes: the first
    retry takes the probe and the rest go to A too rather than fail for sure (Envoy's panic
    routing); their successes close A's breaker."""
    async def scenario(fleet: Fleet) -> tuple[list, list]:
        fleet.kill(A)
        fleet.instance[A] = "a1"
        fleet.clock.now += fleet.cfg.cb_timeout_s
        assert fleet.registry.get(A).breaker.state == "half_open"
        return await crash_b(fleet, hold_a=True)

    fleet = Fleet()
    assert_all_landed_on_a(fleet, *asyncio.run(scenario(fleet)))
    assert fleet.registry.get(A).breaker.state == "closed"


async def send(fwd: Forwarder, stream: bool) -> tuple[int, list]:
    raw = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
    response = await fwd.forward("/v1/completions", raw, {}, RouteKey("hi"), stream,
                                 time.perf_counter())
    if isinstance(response, RelayResponse):
        body = b"".join([chunk async for chunk in response.body_iterator])
        return response.status_code, events(body)
    return response.status_code, []


async def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
