"""Router-side state of each worker: health, breaker, in-flight count and predicted load."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from radixserve.router.breaker import HALF_OPEN, CircuitBreaker
from radixserve.router.config import RouterConfig
from radixserve.router.validate import finite_number

if TYPE_CHECKING:
    from radixserve.router.eject import StreamWatch

logger = logging.getLogger(__name__)

KV_HIGH = 0.8  # KV usage above which a worker is under pressure (llm-d saturation default)
# Who drained a worker through the admin API (POST /admin/drain's "by"; absent: the operator).
OPERATOR, AGENT = "operator", "agent"
DRAIN_OWNERS = (OPERATOR, AGENT)


@dataclass(slots=True)
class WorkerState:
    """One worker as the router sees it; mutated only by the router's event loop.

        load(now) = in_flight + ema_external + kv_term + stale_penalty    (requests)

    in_flight: from dispatch to finish (SGLang WorkerLoadGuard). ema_external: EMA (weight `smoothing`) of reported
    running + queued minus our in_flight, >= 0. kv_term: above KV_HIGH. stale_penalty: when the reading is older than
    stale_s (llm-d: stale = saturated). A worker never polled is judged by in_flight alone."""

    url: str
    weight: float = 1.0
    draining: bool = False         # by the router's admin API
    drained_by: str | None = None  # DRAIN_OWNERS while drained through it (`drain`), else None
    reports_draining: bool = False  # by the worker's own /health
    healthy: bool = True
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(5, 2, 30.0))
    in_flight: int = 0
    health_failures: int = 0
    health_successes: int = 0
    num_running: int = 0
    num_queue: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    reported_at: float | None = None  # clock seconds of the last load reading
    ema_external: float = 0.0
    num_requests: int = 0
    num_failures: int = 0
    routed_len: int = 0
    matched_len: int = 0  # of routed_len, already in the prefix tree for this worker
    instance_id: str | None = None  # the worker process's, from /health (None: not reported)
    stale_s: float = 5.0
    stale_penalty: float = 16.0
    smoothing: float = 0.5
    streams: set[StreamWatch] = field(default_factory=set, repr=False, compare=False)

    def load(self, now: float) -> float:
        load = float(self.in_flight)
        if self.reported_at is None:
            return load
        load += self.ema_external
        if self.token_usage > KV_HIGH:
            load += self.stale_penalty * (self.token_usage - KV_HIGH) / (1.0 - KV_HIGH)
        if now - self.reported_at > self.stale_s:
            load += self.stale_penalty
        return load

    def is_in_rotation(self) -> bool:
        """Healthy, not draining, weight > 0: routable whatever its breaker says."""
        return (self.healthy and not self.draining and not self.reports_draining
                and self.weight > 0)

    def drain(self, by: str) -> None:
        """Out of rotation, owned by `by` (DRAIN_OWNERS); an operator's drain stays the operator's."""
        if self.drained_by != OPERATOR:
            self.drained_by = by
        self.draining = True

    def undrain(self) -> None:
        self.draining, self.drained_by = False, None

    def is_routable(self) -> bool:
        return self.is_in_rotation() and self.breaker.can_execute()

    def report(self, num_running: int, num_queue: int, token_usage: float,
               cache_hit_rate: float, now: float) -> None:
        """One load reading (GET /get_server_info) at clock time `now` (s)."""
        external = max(0.0, float(num_running + num_queue - self.in_flight))
        if self.reported_at is None:
            self.ema_external = external
        else:
            self.ema_external += self.smoothing * (external - self.ema_external)
        self.num_running, self.num_queue = num_running, num_queue
        self.token_usage, self.cache_hit_rate = token_usage, cache_hit_rate
        self.reported_at = now

    def forget_load(self) -> None:
        """Drop the load reading: judged by in_flight alone until the next one."""
        self.num_running, self.num_queue = 0, 0
        self.token_usage, self.cache_hit_rate = 0.0, 0.0
        self.reported_at, self.ema_external = None, 0.0

    def note_instance(self, instance_id: str | None) -> bool:
        """Remember the process id /health reported; True if it replaced another (a restart)."""
        if instance_id is None:
            return False
        old, self.instance_id = self.instance_id, instance_id
        return old is not None and old != instance_id

    def rejoin(self) -> None:
        """A new process on this URL: healthy, breaker closed, no load reading; old requests release as usual."""
        self.healthy = True
        self.health_failures, self.health_successes = 0, 0
        self.breaker.reset()
        self.forget_load()

    def record(self, outcome: str) -> None:
        """Raises ValueError unless `outcome` is "success", "failure" or "neutral"."""
        self.breaker.record(outcome)
        if outcome == "failure":
            self.num_failures += 1

    def record_health(self, ok: bool, failure_threshold: int, success_threshold: int) -> bool:
        """Flip `healthy` after that many consecutive failures or passes; True if it flipped."""
        if ok:
            self.health_failures, self.health_successes = 0, self.health_successes + 1
            flip = not self.healthy and self.health_successes >= success_threshold
        else:
            self.health_successes, self.health_failures = 0, self.health_failures + 1
            flip = self.healthy and self.health_failures >= failure_threshold
        if flip:
            self.healthy = not self.healthy
            logger.warning("worker %s is now %s", self.url,
                           "healthy" if self.healthy else "unhealthy")
        return flip

    def eject_streams(self) -> int:
        """Cut the streams read from this worker (eject.py); returns how many were cut."""
        watches = [watch for watch in self.streams if not watch.ejected]
        for watch in watches:
            watch.eject()
        return len(watches)

    def note_routed(self, key_len: int, matched_len: int) -> None:
        self.routed_len += key_len
        self.matched_len += matched_len

    @property
    def hit_estimate(self) -> float:
        return self.matched_len / self.routed_len if self.routed_len else 0.0

    def to_json(self, now: float) -> dict:
        age = None if self.reported_at is None else round(now - self.reported_at, 3)
        return {
            "url": self.url, "healthy": self.healthy, "draining": self.draining,
            "drained_by": self.drained_by, "reports_draining": self.reports_draining,
            "weight": self.weight, "in_flight": self.in_flight,
            "load": round(self.load(now), 3), "breaker": self.breaker.state,
            "reported": {"num_running": self.num_running, "num_queue": self.num_queue,
                         "token_usage": self.token_usage,
                         "cache_hit_rate": self.cache_hit_rate, "age_s": age},
            "hit_estimate": round(self.hit_estimate, 4),
            "num_requests": self.num_requests, "num_failures": self.num_failures,
            "health_failures": self.health_failures,
            "health_successes": self.health_successes, "instance_id": self.instance_id,
        }


def check_weight(weight: float) -> float:
    """Raises ValueError unless `weight` is a finite number >= 0."""
    value = finite_number(weight, "weight")
    if value < 0:
        raise ValueError(f"weight must be a finite number >= 0, got {value}")
    return value


class WorkerRegistry:
    """Workers by URL in add order; `on_remove(url)` on removal; `clock` in s; stale_penalty = balance_abs_threshold."""

    def __init__(self, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self._workers: dict[str, WorkerState] = {}
        self.on_remove: list[Callable[[str], None]] = []
        self.stale_penalty = self.config.balance_abs_threshold

    def set_stale_penalty(self, penalty: float) -> None:
        self.stale_penalty = penalty
        for worker in self._workers.values():
            worker.stale_penalty = penalty

    def add(self, url: str, weight: float = 1.0, healthy: bool = True) -> WorkerState:
        """Raises ValueError if the URL is already there or the weight is bad."""
        if url in self._workers:
            raise ValueError(f"worker {url} already exists")
        cfg = self.config
        breaker = CircuitBreaker(cfg.cb_failure_threshold, cfg.cb_success_threshold,
                                 cfg.cb_timeout_s, clock=self.clock,
                                 disabled=cfg.disable_circuit_breaker, name=url)
        worker = WorkerState(url, weight=check_weight(weight), healthy=healthy,
                             breaker=breaker, stale_s=cfg.load_stale_s,
                             stale_penalty=self.stale_penalty,
                             smoothing=cfg.load_smoothing)
        self._workers[url] = worker
        return worker

    def remove(self, url: str) -> WorkerState:
        """Raises KeyError if unknown; requests in flight release on the returned worker."""
        worker = self._workers.pop(url)
        for callback in self.on_remove:
            callback(url)
        return worker

    def get(self, url: str) -> WorkerState | None:
        return self._workers.get(url)

    def list(self) -> list[WorkerState]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def routable(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[WorkerState]:
        return [w for w in self._workers.values() if w.url not in exclude and w.is_routable()]

    def candidates(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[WorkerState]:
        """The routable workers; if none, those in rotation whose half-open breaker has its
        probe out, since the request fails for sure otherwise (Envoy's panic routing)."""
        return self.routable(exclude) or [
            w for w in self._workers.values() if w.url not in exclude and w.is_in_rotation()
            and w.breaker.state == HALF_OPEN]

    @contextlib.contextmanager
    def dispatch(self, worker: WorkerState) -> Iterator[WorkerState]:
        """Holds a request in flight on `worker` (the object: one re-added under its URL is not miscounted) and its
        breaker's half-open probe slot until the block exits. The only place in_flight changes."""
        token = worker.breaker.begin()
        worker.in_flight += 1
        worker.num_requests += 1
        try:
            yield worker
        finally:
            worker.breaker.end(token)
            assert worker.in_flight > 0, f"in-flight count of {worker.url} would go negative"
            worker.in_flight -= 1
