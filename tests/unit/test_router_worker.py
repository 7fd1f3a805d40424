"""WorkerState load prediction and health; WorkerRegistry in-flight accounting never drifts."""
from __future__ import annotations

import asyncio
import random

import pytest

from radixserve.router.config import RouterConfig
from radixserve.router.worker import WorkerRegistry, WorkerState


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def registry(**cfg):
    clock = FakeClock()
    return WorkerRegistry(RouterConfig(**cfg), clock=clock), clock


def test_load_is_in_flight_until_the_first_reading():
    w = WorkerState("http://w", stale_s=5.0, stale_penalty=16.0, smoothing=0.5)
    w.in_flight = 3
    assert w.load(1000.0) == 3.0


def test_reported_load_is_smoothed_and_excludes_our_own_requests():
    w = WorkerState("http://w", stale_s=5.0, stale_penalty=16.0, smoothing=0.5)
    w.in_flight = 4
    w.report(num_running=6, num_queue=2, token_usage=0.1, cache_hit_rate=0.5, now=0.0)
    assert w.ema_external == 4.0  # 6 + 2 - 4 of ours; the first reading is taken whole
    assert w.load(0.0) == 8.0
    w.report(num_running=4, num_queue=0, token_usage=0.1, cache_hit_rate=0.5, now=1.0)
    assert w.ema_external == 2.0  # 4 + 0.5 x (0 - 4)
    w.in_flight = 0
    w.report(num_running=0, num_queue=0, token_usage=0.1, cache_hit_rate=0.5, now=2.0)
    assert w.ema_external == 1.0 and w.load(2.0) == 1.0
    w.in_flight = 9  # the worker has not seen all of ours yet: external floors at 0
    w.report(num_running=2, num_queue=0, token_usage=0.1, cache_hit_rate=0.5, now=3.0)
    assert w.ema_external == 0.5


def test_stale_reading_counts_as_busy_and_kv_pressure_adds_load():
    w = WorkerState("http://w", stale_s=5.0, stale_penalty=16.0, smoothing=0.5)
    w.report(num_running=0, num_queue=0, token_usage=0.5, cache_hit_rate=0.0, now=10.0)
    assert w.load(15.0) == 0.0
    assert w.load(15.1) == 16.0
    w.report(num_running=0, num_queue=0, token_usage=0.9, cache_hit_rate=0.0, now=20.0)
    assert w.load(20.0) == pytest.approx(8.0)  # half-way from 0.8 to full KV
    w.report(num_running=0, num_queue=0, token_usage=1.0, cache_hit_rate=0.0, now=20.0)
    assert w.load(20.0) == pytest.approx(16.0)


def test_health_thresholds_need_consecutive_results():
    w = WorkerState("http://w")
    results = [False, False, True, False, False]
    assert [w.record_health(ok, 3, 2) for ok in results] == [False] * 5 and w.healthy
    assert w.record_health(False, 3, 2) and not w.healthy
    assert not w.record_health(True, 3, 2) and not w.healthy
    assert not w.record_health(False, 3, 2)
    assert not w.record_health(True, 3, 2)
    assert w.record_health(True, 3, 2) and w.healthy


def test_routable_excludes_unhealthy_draining_weight_zero_and_open_breaker():
    reg, _ = registry(cb_failure_threshold=1)
    urls = [f"http://w{i}" for i in range(6)]
    for url in urls:
        reg.add(url)
    reg.get(urls[1]).healthy = False
    reg.get(urls[2]).draining = True
    reg.get(urls[3]).weight = 0.0
    reg.get(urls[4]).record("failure")
    assert [w.url for w in reg.routable()] == [urls[0], urls[5]]
    assert [w.url for w in reg.routable(exclude={urls[0]})] == [urls[5]]
    assert reg.get(urls[4]).num_failures == 1 and reg.get(urls[4]).breaker.state == "open"


def test_registry_add_remove():
    reg, _ = registry()
    removed = []
    reg.on_remove.append(removed.append)
    w = reg.add("http://a", weight=2)
    assert w.weight == 2.0 and reg.get("http://a") is w and len(reg) == 1
    assert w.breaker.failure_threshold == RouterConfig().cb_failure_threshold
    with pytest.raises(ValueError):
        reg.add("http://a")
    for bad in (-1, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError):
            reg.add("http://b", weight=bad)
    assert reg.add("http://c", healthy=False).healthy is False
    assert reg.remove("http://a") is w and removed == ["http://a"]
    assert [x.url for x in reg.list()] == ["http://c"]
    with pytest.raises(KeyError):
        reg.remove("http://a")


def test_dispatch_releases_on_success_and_on_error():
    reg, _ = registry()
    w = reg.add("http://a")
    with reg.dispatch(w):
        assert w.in_flight == 1
    with pytest.raises(RuntimeError):
        with reg.dispatch(w):
            assert w.in_flight == 1
            raise RuntimeError("upstream broke")
    assert w.in_flight == 0 and w.num_requests == 2


def test_dispatch_releases_on_cancellation_and_disconnect():
    reg, _ = registry()
    w = reg.add("http://a")

    async def request(started: asyncio.Event):
        with reg.dispatch(w):
            started.set()
            await asyncio.sleep(3600)

    async def stream():
        with reg.dispatch(w):
            for i in range(100):
                yield i
                await asyncio.sleep(0)

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(request(started))
        await started.wait()
        assert w.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.in_flight == 0
        gen = stream()  # a streamed response whose client disconnects after two chunks
        assert [await gen.__anext__(), await gen.__anext__()] == [0, 1]
        assert w.in_flight == 1
        await gen.aclose()
        assert w.in_flight == 0

    asyncio.run(main())


def test_in_flight_never_drifts_under_mixed_endings():
    reg, _ = registry()
    workers = [reg.add(f"http://w{i}") for i in range(3)]
    rng = random.Random(7)

    async def request(worker, ending, hold):
        with reg.dispatch(worker):
            await asyncio.sleep(0)
            for _ in range(hold):
                await asyncio.sleep(0)
            if ending == "error":
                raise ConnectionError("reset by peer")

    async def main():
        tasks = []
        for _ in range(300):
            worker = rng.choice(workers)
            ending = rng.choice(["ok", "error", "cancel"])
            task = asyncio.create_task(request(worker, ending, rng.randint(0, 5)))
            tasks.append((task, ending))
        await asyncio.sleep(0)
        assert sum(w.in_flight for w in workers) == 300  # all counted at dispatch
        for task, ending in tasks:
            if ending == "cancel":
                task.cancel()
        results = await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)
        kinds = {type(r).__name__ for r in results}
        assert kinds == {"NoneType", "ConnectionError", "CancelledError"}

    asyncio.run(main())
    assert [w.in_flight for w in workers] == [0, 0, 0]
    assert sum(w.num_requests for w in workers) == 300


def test_removed_worker_still_releases_and_one_readded_under_its_url_is_not_miscounted():
    reg, _ = registry()
    w = reg.add("http://a")
    with reg.dispatch(w):
        reg.remove("http://a")
        again = reg.add("http://a")
        with reg.dispatch(again):
            assert (w.in_flight, again.in_flight) == (1, 1)
        assert (w.in_flight, again.in_flight) == (1, 0)
    assert w.in_flight == 0


def test_dispatch_claims_and_frees_the_half_open_probe():
    reg, clock = registry(cb_failure_threshold=1, cb_timeout_s=10.0)
    w = reg.add("http://a")
    w.record("failure")
    clock.now = 10
    assert w.is_routable()
    with pytest.raises(asyncio.CancelledError):
        with reg.dispatch(w):
            assert not w.is_routable()  # one probe at a time
            raise asyncio.CancelledError
    assert w.is_routable() and w.breaker.state == "half_open"
    with reg.dispatch(w):
        w.record("success")
    with reg.dispatch(w):
        w.record("success")
    assert w.breaker.state == "closed"


def test_to_json_for_the_admin_api():
    reg, clock = registry()
    w = reg.add("http://a", weight=0.5)
    w.report(num_running=3, num_queue=1, token_usage=0.25, cache_hit_rate=0.75, now=0.0)
    w.note_routed(100, 60)
    w.note_routed(100, 20)
    clock.now = 2.0
    doc = w.to_json(clock())
    assert doc["url"] == "http://a" and doc["weight"] == 0.5 and doc["breaker"] == "closed"
    assert doc["load"] == 4.0 and doc["in_flight"] == 0
    assert doc["reported"] == {"num_running": 3, "num_queue": 1, "token_usage": 0.25,
                               "cache_hit_rate": 0.75, "age_s": 2.0}
    assert doc["hit_estimate"] == 0.4
    assert {"healthy", "draining", "num_requests", "num_failures"} <= set(doc)
