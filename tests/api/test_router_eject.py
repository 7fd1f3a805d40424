"""Streams of a worker the router ejects (its health checks turn it unhealthy) against fake workers (httpx MockTransport): cut, closed upstream, continued or retried elsewhere; drains and other workers' ejections cut nothing."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from radixserve.router.health import HealthMonitor
from radixserve.router.proxy import Forwarder
from tests.api.test_router_migration import (
    ROLE, SSE, USAGE, Chunks, chat_chunk, events, make, migrations, sse, stream, text_chunk)

WAIT_S = 60.0          # generous bound on every wait for a state change (never pass/fail timing)
THRESHOLD = 2          # --health-failure-threshold of these tests
CHAT = "/v1/chat/completions"


class Stalls(httpx.AsyncByteStream):
    """A worker body that sends `chunks`, then holds the connection open without a byte (a
    hung engine) until `release` is set, then sends `rest`. `stalled`: it is holding;
    `closed`: the router closed the response (on a real connection: the worker sees the
    disconnect and aborts); `cut_while_holding`: that close (or a cancel) came mid-hold."""

    def __init__(self, chunks: list[bytes], rest: list[bytes] = ()):
        self.chunks, self.rest = chunks, list(rest)
        self.stalled, self.release, self.closed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.cut_while_holding = False

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        self.stalled.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cut_while_holding = True
            raise
        for chunk in self.rest:
            yield chunk

    async def aclose(self) -> None:
        self.closed.set()


class NoAnswer:
    """A worker that takes the request and holds it without a byte of answer (a hung
    server: no headers). `asked`: the request arrived; `cut`: the router gave up on it."""

    def __init__(self):
        self.asked = asyncio.Event()
        self.cut = False

    async def __call__(self) -> httpx.Response:
        self.asked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cut = True
            raise
        raise AssertionError("unreachable")


async def wait(event: asyncio.Event, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), WAIT_S)
    except asyncio.TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


class Scene:
    """Three fake workers behind a Forwarder and a HealthMonitor (checks run by the test, one
    at a time: no timing). `bodies[n]` answers POST attempt n (1-based) with a stream;
    `sick`: URLs whose /health fails; `draining`, `degraded`: URLs whose /health says so."""

    def __init__(self, bodies: dict[int, httpx.AsyncByteStream | NoAnswer], **config):
        self.bodies, self.sick = bodies, set()
        self.draining, self.degraded = set(), set()
        self.fwd, self.registry, self.calls = make(
            lambda url, n, body: self.answer(self.bodies[n]),
            self.health, health_failure_threshold=THRESHOLD, **config)
        f: Forwarder = self.fwd
        self.monitor = HealthMonitor(f.config, f.registry, f.metrics, f.http)

    @staticmethod
    def answer(body):
        return body() if isinstance(body, NoAnswer) else httpx.Response(200, headers=SSE,
                                                                          stream=body)

    def health(self, url: str) -> httpx.Response:
        for status in ("draining", "degraded"):
            if url in getattr(self, status):
                return httpx.Response(503, json={"status": status})
        return httpx.Response(500 if url in self.sick else 200, json={})

    def url(self, n: int) -> str:
        """The worker POST attempt n went to."""
        return self.calls[n - 1][0]

    async def fail_checks(self, url: str, times: int = THRESHOLD) -> None:
        """Make `url`'s /health fail and run `times` checks of it."""
        self.sick.add(url)
        for _ in range(times):
            await self.monitor.check(self.registry.get(url))

    def go(self, body: dict, action, path: str = "/v1/completions") -> list:
        """Stream `body`; run `await action(self)` meanwhile; returns the client's events."""
        async def main() -> bytes:
            task = asyncio.create_task(stream(self.fwd, body, path))
            await action(self)
            out = await asyncio.wait_for(task, WAIT_S)
            await self.monitor.stop()
            return out
        got = events(asyncio.run(main()))
        assert all(w.in_flight == 0 and not w.streams for w in self.registry.list())
        return got

    def failures(self, url: str) -> tuple[int, float]:
        """(breaker-counted failures, requests_total{outcome=transport_error}) of `url`."""
        samples = [s.value for m in self.fwd.metrics.requests.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels == {"worker": url,
                                                                 "outcome": "transport_error"}]
        return self.registry.get(url).num_failures, sum(samples)


def texts(got: list) -> str:
    return "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                   for e in got if isinstance(e, dict) for c in e.get("choices", []))


def finish_b(text: str, ids: list[int]) -> Chunks:
    return Chunks([text_chunk("b", text, ids), text_chunk("b", "", [], "length"),
                   sse({"id": "b", "created": 9, "choices": [], "usage": USAGE}),
                   b"data: [DONE]\n\n"])


BODY = {"prompt": "hi", "max_tokens": 3, "stream_options": {"include_usage": True}}


def test_ejected_worker_mid_stream_is_cut_and_the_stream_continues_elsewhere():
    stall = Stalls([text_chunk("a", "He", [1]), text_chunk("a", "", [2])])
    scene = Scene({1: stall, 2: finish_b("llo", [3])})

    async def eject(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        victim = s.registry.get(s.url(1))
        await s.fail_checks(s.url(1), THRESHOLD - 1)
        assert victim.healthy and [w.ejected for w in victim.streams] == [False]
        await s.fail_checks(s.url(1), 1)
        assert not victim.healthy
    got = scene.go(BODY, eject)
    assert stall.closed.is_set() and stall.cut_while_holding
    assert got[-1] == b"[DONE]" and not any("error" in e for e in got[:-1])
    assert texts(got) == "Hello" and {e["id"] for e in got[:-1]} == {"a"}
    assert got[-2]["usage"] == USAGE
    assert len(scene.calls) == 2 and scene.url(2) != scene.url(1)
    assert scene.calls[1][1]["resume_token_ids"] == [1, 2]
    assert migrations(scene.fwd) == {"success": 1.0}
    assert scene.failures(scene.url(1)) == (1, 1.0)   # the cut counts as a failed attempt


def test_a_continuation_whose_worker_is_ejected_too_is_continued_again():
    first = Stalls([text_chunk("a", "He", [1])])
    second = Stalls([text_chunk("b", "l", [2])])
    scene = Scene({1: first, 2: second, 3: finish_b("lo", [3])})

    async def eject_both(s: Scene) -> None:
        await wait(first.stalled, "the first worker to stall")
        await s.fail_checks(s.url(1))
        await wait(second.stalled, "the continuation to stall")
        await s.fail_checks(s.url(2))
    got = scene.go(BODY, eject_both)
    assert first.closed.is_set() and second.closed.is_set() and second.cut_while_holding
    assert texts(got) == "Hello" and got[-1] == b"[DONE]"
    assert [c[1].get("resume_token_ids") for c in scene.calls] == [None, [1], [1, 2]]
    assert len({scene.url(n) for n in (1, 2, 3)}) == 3
    assert migrations(scene.fwd) == {"success": 2.0}


def test_chat_stream_ejected_before_content_is_retried_with_one_role_chunk():
    stall = Stalls([chat_chunk("a", ROLE)])
    retry = Chunks([chat_chunk("b", ROLE), chat_chunk("b", {"content": "Hi"}, [4]),
                    chat_chunk("b", {}, [], "stop"), b"data: [DONE]\n\n"])
    scene = Scene({1: stall, 2: retry})

    async def eject(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        await s.fail_checks(s.url(1))
    got = scene.go({"messages": [{"role": "user", "content": "x"}]}, eject, CHAT)
    assert stall.closed.is_set() and stall.cut_while_holding
    assert [e["choices"][0]["delta"] for e in got[:-1]] == [ROLE, {"content": "Hi"}, {}]
    assert "resume_token_ids" not in scene.calls[1][1]   # nothing had reached the client
    assert migrations(scene.fwd) == {} and scene.failures(scene.url(1)) == (1, 1.0)


def test_stream_whose_worker_is_ejected_before_answering_is_retried():
    hung = NoAnswer()
    scene = Scene({1: hung, 2: finish_b("Hello", [1, 2, 3])})

    async def eject(s: Scene) -> None:
        await wait(hung.asked, "the request to reach the worker")
        await s.fail_checks(s.url(1))
    got = scene.go(BODY, eject)
    assert hung.cut and texts(got) == "Hello" and got[-1] == b"[DONE]"
    assert len(scene.calls) == 2 and "resume_token_ids" not in scene.calls[1][1]
    assert migrations(scene.fwd) == {} and scene.failures(scene.url(1)) == (1, 1.0)


def test_ejected_stream_without_migration_ends_with_an_error_event_and_done():
    stall = Stalls([text_chunk("a", "He", [1])])
    scene = Scene({1: stall}, disable_stream_migration=True)

    async def eject(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        await s.fail_checks(s.url(1))
    got = scene.go(BODY, eject)
    assert stall.closed.is_set() and stall.cut_while_holding
    assert texts(got) == "He" and len(got) == 3 and got[-1] == b"[DONE]"
    assert got[1]["error"]["type"] == "worker_error" and "ejected" in got[1]["error"]["message"]
    assert len(scene.calls) == 1 and migrations(scene.fwd) == {}
    assert scene.failures(scene.url(1)) == (1, 1.0)


def test_a_worker_turning_unhealthy_without_streams_cuts_nothing_else():
    stall = Stalls([text_chunk("a", "He", [1])],
                   [text_chunk("a", "llo", [2, 3], "length"), b"data: [DONE]\n\n"])
    scene = Scene({1: stall})

    async def eject_another(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        other = next(w.url for w in s.registry.list() if w.url != s.url(1))
        await s.fail_checks(other)
        assert not s.registry.get(other).healthy and s.registry.get(s.url(1)).healthy
        assert [w.ejected for w in s.registry.get(s.url(1)).streams] == [False]
        stall.release.set()
    got = scene.go(BODY, eject_another)
    assert texts(got) == "Hello" and got[-1] == b"[DONE]" and not stall.cut_while_holding
    assert len(scene.calls) == 1 and migrations(scene.fwd) == {}
    assert all(w.num_failures == 0 for w in scene.registry.list())


def test_a_drain_mid_stream_lets_the_stream_finish_on_its_worker():
    stall = Stalls([text_chunk("a", "He", [1])],
                   [text_chunk("a", "llo", [2, 3], "length"), b"data: [DONE]\n\n"])
    scene = Scene({1: stall})

    async def drain(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        worker = s.registry.get(s.url(1))
        worker.draining = True                      # POST /admin/drain
        s.draining.add(s.url(1))                    # and its own /health says draining
        for _ in range(THRESHOLD + 1):
            assert not await s.monitor.check(worker)
        assert worker.reports_draining and worker.healthy and not worker.is_routable()
        assert [w.ejected for w in worker.streams] == [False]
        stall.release.set()
    got = scene.go(BODY, drain)
    assert texts(got) == "Hello" and got[-1] == b"[DONE]" and not stall.cut_while_holding
    assert len(scene.calls) == 1 and migrations(scene.fwd) == {}
    assert scene.failures(scene.url(1)) == (0, 0.0)


def test_a_saturated_worker_is_routed_away_from_but_its_streams_go_on_until_it_is_sick():
    stall = Stalls([text_chunk("a", "He", [1])])
    scene = Scene({1: stall, 2: finish_b("llo", [2, 3])})

    async def saturate_then_fail(s: Scene) -> None:
        await wait(stall.stalled, "the worker to stall")
        worker = s.registry.get(s.url(1))
        s.degraded.add(s.url(1))                    # every request slot held: 503 degraded
        for _ in range(THRESHOLD + 1):
            assert not await s.monitor.check(worker)
        assert not worker.healthy and not worker.is_routable()
        assert [w.ejected for w in worker.streams] == [False] and len(s.calls) == 1
        s.degraded.clear()
        await s.fail_checks(s.url(1), 1)            # then a sick answer: cut
    got = scene.go(BODY, saturate_then_fail)
    assert stall.closed.is_set() and stall.cut_while_holding
    assert texts(got) == "Hello" and scene.calls[1][1]["resume_token_ids"] == [1]
    assert migrations(scene.fwd) == {"success": 1.0}
