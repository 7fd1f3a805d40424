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
    """Health checks every health_check_interval_s, load polls every load_poll_interval_s.

    Consecutive-check thresholds as SGLang's router (Kubernetes readiness); a check fails on anything but a 200. A
    never-checked worker turns healthy at its first pass; a restarted one (new `instance_id` in its 200) too, with a
    closed breaker. Every pass counts as a half-open breaker success (C40). Turning healthy drops its load reading and
    polls it at once. A 503 "draining" only takes it out of rotation; a "degraded" one fails but never ejects."""

    def __init__(self, config: RouterConfig, registry: Any, metrics: RouterMetrics,
                 http: httpx.AsyncClient):
        self.config, self.registry, self.metrics, self.http = config, registry, metrics, http
        self.fresh_http = fresh_client(http.trust_env)
        self.headers = ({"Authorization": f"Bearer {config.worker_api_key}"}
                        if config.worker_api_key else {})
        self._tasks: list[asyncio.Task] = []
        self._never_checked: set[str] = set()

    def expect_new(self, url: str) -> None:
        self._never_checked.add(url)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(self.check_all,
                                                      self.config.health_check_interval_s)),
                       asyncio.create_task(self._loop(self.poll_all,
                                                      self.config.load_poll_interval_s))]

    async def stop(self) -> None:
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
            except Exception:
                logger.exception("router background sweep %s failed", step.__name__)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.registry.list()))

    async def check(self, worker: Any) -> bool:
        url = worker.url
        try:
            r = await send_resending_once(self.http, self.fresh_http, "GET",
                                          url + self.config.health_check_endpoint,
                                          headers=self.headers,
                                          timeout=self.config.health_check_timeout_s)
            ok, why = r.status_code == 200, f"status {r.status_code}"
            draining, degraded = says(r, "draining"), says(r, "degraded")
            instance = body_of(r).get("instance_id") if ok else None
        except UNREACHABLE as exc:
            ok, why, draining, degraded = False, f"{type(exc).__name__}: {exc}", False, False
            instance = None
        if self.registry.get(url) is not worker:
            return ok
        self.metrics.health_checks.labels(url, "draining" if draining else "pass" if ok
                                          else "fail").inc()
        if draining or ok:
            if worker.reports_draining != draining:
                logger.warning("worker %s %s", url, "is draining: out of rotation" if draining
                               else "admits again: back in rotation")
            worker.reports_draining = draining
        if draining:
            return False
        back = worker.note_instance(instance if isinstance(instance, str) else None)
        if back:
            logger.warning("worker %s restarted (instance %s): back in rotation with a closed "
                           "breaker and no load reading", url, worker.instance_id)
            worker.rejoin()
        elif ok and url in self._never_checked:
            worker.healthy = True
        else:
            back = worker.record_health(ok, self.config.health_failure_threshold,
                                        self.config.health_success_threshold) and worker.healthy
            if back:
                worker.forget_load()   # read before it went down: stale, and stale is "busy"
        if ok:
            worker.breaker.probe_passed()
        if not ok and not degraded and not worker.healthy:
            self.eject(worker)
        self._never_checked.discard(url)
        if not ok:
            logger.info("health check of %s failed (%s); %d in a row", url, why,
                        worker.health_failures)
        if back:
            await self.poll(worker)
        return ok

    def eject(self, worker: Any) -> None:
        """Cut the streams of an unhealthy worker, to be retried or continued elsewhere."""
        num_cut = worker.eject_streams()
        if num_cut:
            logger.warning("worker %s ejected: cutting the %d stream(s) it serves (each is "
                           "retried or continued elsewhere where it can be)", worker.url, num_cut)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in self.registry.list() if w.healthy))

    async def poll(self, worker: Any) -> None:
        """A failed read keeps the old reading, which turns stale after load_stale_s."""
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


def body_of(response: httpx.Response) -> dict:
    """A health answer's JSON object; {} for anything else."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def says(response: httpx.Response, status: str) -> bool:
    """Whether a health answer is a 503 {"status": `status`}."""
    return response.status_code == 503 and body_of(response).get("status") == status
