"""Router-side state of each worker: health, breaker, in-flight count and predicted load."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from radixserve.router.breaker import CircuitBreaker
from radixserve.router.config import RouterConfig
from radixserve.router.validate import finite_number

if TYPE_CHECKING:
    from radixserve.router.eject import StreamWatch

logger = logging.getLogger(__name__)

KV_HIGH = 0.8  # KV usage above which a worker is under pressure (llm-d saturation default)


@dataclass(slots=True)
class WorkerState:
    """One worker as the router sees it. Mutated only by the router's event loop.

    Predicted load, in requests (see `load`):

        load(now) = in_flight + ema_external + kv_term + stale_penalty

    - `in_flight`: requests this router has dispatched there and not yet finished, counted
      at dispatch and released on finish, error or disconnect (SGLang `WorkerLoadGuard`,
      smg#1714 / sglang#27547: counting at first byte sent every burst to one worker);
    - `ema_external`: exponential moving average (weight `smoothing` on the newest reading,
      alpha = 2/(N+1) for an N-reading window) of the worker's reported
      running + queued requests minus our own in_flight at that poll, floored at 0: load
      from other routers or direct clients, which our counter cannot see;
    - `kv_term`: stale_penalty x (token_usage - 0.8) / 0.2 when reported KV usage is above
      0.8 (a worker near full KV preempts; llm-d treats KV 0.8 as saturated);
    - `stale_penalty` (the dead-band width, balance_abs_threshold) is added when the last
      reading is older than `stale_s`: a worker that stopped answering polls counts as busy
      (llm-d: stale metrics = saturated). A worker never polled is judged by in_flight alone.
    """

    url: str
    weight: float = 1.0
    draining: bool = False         # drained by the router's admin API
    reports_draining: bool = False  # the worker's own /health says draining (SIGTERM, its admin)
    healthy: bool = True
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(5, 2, 30.0))
    in_flight: int = 0
    health_failures: int = 0  # consecutive failed health checks
    health_successes: int = 0  # consecutive passed health checks
    num_running: int = 0
    num_queue: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    reported_at: float | None = None  # clock seconds of the last load reading
    ema_external: float = 0.0
    num_requests: int = 0
    num_failures: int = 0
    routed_len: int = 0  # key length routed here (tokens or characters)
    matched_len: int = 0  # of which the prefix tree had already seen for this worker
    stale_s: float = 5.0
    stale_penalty: float = 16.0
    smoothing: float = 0.5
    # Streams the router is reading from this worker now (cut by eject_streams).
    streams: set[StreamWatch] = field(default_factory=set, repr=False, compare=False)

    def load(self, now: float) -> float:
        """Predicted load in requests at clock time `now` (seconds); formula above."""
        load = float(self.in_flight)
        if self.reported_at is None:
            return load
        load += self.ema_external
        if self.token_usage > KV_HIGH:
            load += self.stale_penalty * (self.token_usage - KV_HIGH) / (1.0 - KV_HIGH)
        if now - self.reported_at > self.stale_s:
            load += self.stale_penalty
        return load

    def is_routable(self) -> bool:
        """Healthy, not draining (by our admin API or by its own word), weight > 0 and the
        breaker lets a request through."""
        return (self.healthy and not self.draining and not self.reports_draining
                and self.weight > 0 and self.breaker.can_execute())

    def report(self, num_running: int, num_queue: int, token_usage: float,
               cache_hit_rate: float, now: float) -> None:
        """Record one load reading (GET /get_server_info) taken at clock time `now` (s)."""
        external = max(0.0, float(num_running + num_queue - self.in_flight))
        if self.reported_at is None:
            self.ema_external = external
        else:
            self.ema_external += self.smoothing * (external - self.ema_external)
        self.num_running, self.num_queue = num_running, num_queue
        self.token_usage, self.cache_hit_rate = token_usage, cache_hit_rate
        self.reported_at = now

    def record(self, outcome: str) -> None:
        """Record a request outcome ("success", "failure", "neutral") on the breaker and the
        failure counter. Raises ValueError on any other value."""
        self.breaker.record(outcome)
        if outcome == "failure":
            self.num_failures += 1

    def record_health(self, ok: bool, failure_threshold: int, success_threshold: int) -> bool:
        """Count one active health check; flip `healthy` after `failure_threshold` consecutive
        failures or `success_threshold` consecutive passes (SGLang / Kubernetes readiness).
        Returns True if `healthy` changed."""
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
        """Cut every stream the router is reading from this worker (it turned unhealthy):
        each relay sees Ejected at its current or next read and retries or continues the
        stream elsewhere (eject.py). Returns the number of streams cut."""
        watches = [watch for watch in self.streams if not watch.ejected]
        for watch in watches:
            watch.eject()
        return len(watches)

    def note_routed(self, key_len: int, matched_len: int) -> None:
        """Count a routed request of `key_len` keys of which `matched_len` were in the tree."""
        self.routed_len += key_len
        self.matched_len += matched_len

    @property
    def hit_estimate(self) -> float:
        """Share of the keys routed here that the prefix tree had seen for this worker."""
        return self.matched_len / self.routed_len if self.routed_len else 0.0

    def to_json(self, now: float) -> dict:
        """State for GET /admin/workers (times in seconds)."""
        age = None if self.reported_at is None else round(now - self.reported_at, 3)
        return {
            "url": self.url, "healthy": self.healthy, "draining": self.draining,
            "reports_draining": self.reports_draining,
            "weight": self.weight, "in_flight": self.in_flight,
            "load": round(self.load(now), 3), "breaker": self.breaker.state,
            "reported": {"num_running": self.num_running, "num_queue": self.num_queue,
                         "token_usage": self.token_usage,
                         "cache_hit_rate": self.cache_hit_rate, "age_s": age},
            "hit_estimate": round(self.hit_estimate, 4),
            "num_requests": self.num_requests, "num_failures": self.num_failures,
            "health_failures": self.health_failures,
            "health_successes": self.health_successes,
        }


def check_weight(weight: float) -> float:
    """Return `weight` as a float; raise ValueError unless it is a finite number >= 0
    (validate.finite_number: an integer too large for a float is refused too)."""
    value = finite_number(weight, "weight")
    if value < 0:
        raise ValueError(f"weight must be a finite number >= 0, got {value}")
    return value


class WorkerRegistry:
    """The router's workers by URL, in the order added, with in-flight accounting.

    `on_remove` callbacks (url) run when a worker is removed (the policy drops its tree
    entries). `clock` returns seconds (monotonic); policies read `now` from it.
    `stale_penalty` (requests) is what a stale load reading adds; it follows the dead-band
    width, balance_abs_threshold, also when the policy changes it at runtime.
    """

    def __init__(self, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self._workers: dict[str, WorkerState] = {}
        self.on_remove: list[Callable[[str], None]] = []
        self.stale_penalty = self.config.balance_abs_threshold

    def set_stale_penalty(self, penalty: float) -> None:
        """Set the load a stale reading adds (requests), on every worker now and later."""
        self.stale_penalty = penalty
        for worker in self._workers.values():
            worker.stale_penalty = penalty

    def add(self, url: str, weight: float = 1.0, healthy: bool = True) -> WorkerState:
        """Add a worker (healthy=False: it gets traffic once health checks pass).
        Raises ValueError if the URL is already there or the weight is bad."""
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
        """Remove a worker; requests in flight there still release on the returned object.
        Raises KeyError if unknown."""
        worker = self._workers.pop(url)
        for callback in self.on_remove:
            callback(url)
        return worker

    def get(self, url: str) -> WorkerState | None:
        """The worker at `url`, or None."""
        return self._workers.get(url)

    def list(self) -> list[WorkerState]:
        """All workers, in the order added."""
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def routable(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[WorkerState]:
        """Workers a request may go to now, minus the URLs in `exclude` (already tried)."""
        return [w for w in self._workers.values() if w.url not in exclude and w.is_routable()]

    def acquire(self, url: str) -> WorkerState:
        """Count one request dispatched to `url`. Raises KeyError if unknown.
        Prefer `dispatch`, which cannot leak."""
        worker = self._workers[url]
        worker.in_flight += 1
        worker.num_requests += 1
        return worker

    def release(self, url: str) -> None:
        """Undo one acquire(url); a worker removed meanwhile is ignored."""
        worker = self._workers.get(url)
        if worker is not None:
            _release(worker)

    @contextlib.contextmanager
    def dispatch(self, worker: WorkerState) -> Iterator[WorkerState]:
        """`with registry.dispatch(worker):` counts one request in flight on `worker` from
        entry until the block ends, however it ends (return, exception, task cancellation,
        generator close on client disconnect); released exactly once. Also claims the
        breaker's half-open probe slot for the duration (freed by worker.record())."""
        worker.in_flight += 1
        worker.num_requests += 1
        token = worker.breaker.begin()
        try:
            yield worker
        finally:
            worker.breaker.end(token)
            _release(worker)


def _release(worker: WorkerState) -> None:
    assert worker.in_flight > 0, f"in-flight count of {worker.url} would go negative"
    worker.in_flight -= 1
