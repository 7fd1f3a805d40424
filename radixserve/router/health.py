"""Background tasks of the router: active health checks and load polling of every worker."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from radixserve.http_common import fresh_client, send_resending_once
from radixserve.router.config import RouterConfig
from radixserve.router.metrics import RouterMetrics
from radixserve.router.proxy import UNREACHABLE

logger = logging.getLogger(__name__)


class HealthMonitor:
    """Probes each worker's health endpoint every health_check_interval_s and reads its load
    (GET /get_server_info) every load_poll_interval_s.

    Health (SGLang router §1.5, the Kubernetes readiness 3/2 rule): a worker turns unhealthy
    after health_failure_threshold consecutive failed checks and healthy again after
    health_success_threshold consecutive passes (WorkerState.record_health). A check fails on
    a transport error, a timeout (health_check_timeout_s), a URL httpx refuses or any status
    but 200; a check that failed on a dead pooled connection is sent once more first
    (http_common.send_resending_once), so the router's own pool cannot fail it. A worker
    added unchecked (healthy=False, never probed) is promoted by its first passed check:
    there is no history to confirm against, and the router should not wait two intervals
    to serve at start-up. The turn to unhealthy ejects the worker: the streams the router is
    reading from it are cut and continued elsewhere (`eject`), unless the failed checks were
    503 `degraded` answers: a saturated worker is routed away from, its streams go on.

    Drain: a 503 whose body says {"status": "draining"} (the worker got SIGTERM or its own
    POST /admin/drain) takes the worker out of rotation at once (WorkerState.reports_draining)
    without counting as a failed check: it is alive and finishing its requests. The next
    200 puts it back at once.
    """

    def __init__(self, config: RouterConfig, registry: Any, metrics: RouterMetrics,
                 http: httpx.AsyncClient):
        self.config, self.registry, self.metrics, self.http = config, registry, metrics, http
        self.fresh_http = fresh_client(http.trust_env)   # second attempts, on new connections
        self.headers = ({"Authorization": f"Bearer {config.worker_api_key}"}
                        if config.worker_api_key else {})
        self._tasks: list[asyncio.Task] = []
        self._never_checked: set[str] = set()

    def expect_new(self, url: str) -> None:
        """Mark `url` as never checked: its first passed check makes it healthy."""
        self._never_checked.add(url)

    def start(self) -> None:
        """Start both loops as tasks of the running event loop."""
        self._tasks = [asyncio.create_task(self._loop(self.check_all,
                                                      self.config.health_check_interval_s)),
                       asyncio.create_task(self._loop(self.poll_all,
                                                      self.config.load_poll_interval_s))]

    async def stop(self) -> None:
        """Cancel both loops, wait for them, and close the client of second attempts."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.fresh_http.aclose()

    async def _loop(self, step: Any, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:  # a bug in one sweep must not stop health checking for good
                logger.exception("router background sweep %s failed", step.__name__)

    async def check_all(self) -> None:
        """One health check of every worker, concurrently."""
        await asyncio.gather(*(self.check(w) for w in self.registry.list()))

    async def check(self, worker: Any) -> bool:
        """Probe one worker; count the result; returns whether the check passed."""
        url = worker.url
        try:
            r = await send_resending_once(self.http, self.fresh_http, "GET",
                                          url + self.config.health_check_endpoint,
                                          headers=self.headers,
                                          timeout=self.config.health_check_timeout_s)
            ok, why = r.status_code == 200, f"status {r.status_code}"
            draining, degraded = says(r, "draining"), says(r, "degraded")
        except UNREACHABLE as exc:
            ok, why, draining, degraded = False, f"{type(exc).__name__}: {exc}", False, False
        if self.registry.get(url) is not worker:
            return ok  # removed (or replaced) while the probe was out
        self.metrics.health_checks.labels(url, "draining" if draining else "pass" if ok
                                          else "fail").inc()
        if draining or ok:
            if worker.reports_draining != draining:
                logger.warning("worker %s %s", url, "is draining: out of rotation" if draining
                               else "admits again: back in rotation")
            worker.reports_draining = draining
        if draining:
            return False
        if ok and url in self._never_checked:
            worker.healthy = True
        else:
            worker.record_health(ok, self.config.health_failure_threshold,
                                 self.config.health_success_threshold)
        if not ok and not degraded and not worker.healthy:
            self.eject(worker)
        self._never_checked.discard(url)
        if not ok:
            logger.info("health check of %s failed (%s); %d in a row", url, why,
                        worker.health_failures)
        return ok

    def eject(self, worker: Any) -> None:
        """The worker is unhealthy and its last check failed as a sick worker's does: cut the
        streams it is serving, so that each is retried or continued on another worker now
        rather than wait for the silence timeout or keep reading from a worker judged sick
        (eject.py). Only streams not cut yet are cut, and an unhealthy worker gets no new ones,
        so in effect this acts once, at the turn to unhealthy (or at the first sick answer
        after a turn caused by `degraded` answers). Drains, removals and a saturated worker's
        `degraded` answers do not come here: their requests in flight finish."""
        num_cut = worker.eject_streams()
        if num_cut:
            logger.warning("worker %s ejected: cutting the %d stream(s) it serves (each is "
                           "retried or continued elsewhere where it can be)", worker.url, num_cut)

    async def poll_all(self) -> None:
        """One load reading of every healthy worker, concurrently."""
        await asyncio.gather(*(self.poll(w) for w in self.registry.list() if w.healthy))

    async def poll(self, worker: Any) -> None:
        """Read GET /get_server_info of one worker into WorkerState.report. A failed read
        leaves the old reading, which turns stale (busy) after load_stale_s."""
        try:
            r = await send_resending_once(self.http, self.fresh_http, "GET",
                                          worker.url + "/get_server_info",
                                          headers=self.headers,
                                          timeout=self.config.health_check_timeout_s)
            r.raise_for_status()
            engine = r.json()["engine"]
            worker.report(int(engine["num_running"]), int(engine["num_waiting"]),
                          float(engine["token_usage"]), float(engine.get("cache_hit_rate", 0.0)),
                          self.registry.clock())
        except (*UNREACHABLE, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.debug("load poll of %s failed: %r", worker.url, exc)


def says(response: httpx.Response, status: str) -> bool:
    """Whether a health answer is a 503 {"status": `status`, ...}: "draining" (the worker
    got SIGTERM or its own drain) or "degraded" (every request slot is held: alive and
    busy, so routed away but never ejected)."""
    if response.status_code != 503:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == status
