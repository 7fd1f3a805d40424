"""Forward one client request to workers: selection, retries with jittered backoff, stream commit and continuation."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import anyio
import httpx
from fastapi.responses import JSONResponse, Response

from radixserve.errors import error_body
from radixserve.router.config import RouterConfig
from radixserve.router.eject import Ejected
from radixserve.router.lease import Attempts, Lease
from radixserve.router.metrics import RouterMetrics
from radixserve.router.outcome import anomaly_kind, classify, error_kind, error_of_body, event_status
from radixserve.router.relay import Opened, Relay, RelayResponse, wire_header
from radixserve.router.stream import StreamLedger, error_in, sse_batches

logger = logging.getLogger(__name__)

# A worker that cannot be reached (a bad URL included: never a 500).
UNREACHABLE = (httpx.TransportError, httpx.InvalidURL)
Post = Callable[[str, bytes, dict[str, bytes]], Awaitable[httpx.Response]]


def outcome_label(status: int | None, transport_error: bool, kind: str | None = None) -> str:
    """requests_total's `outcome`: success, client_error, backpressure, failure or transport_error."""
    if transport_error:
        return "transport_error"
    outcome = classify(status, False, kind)
    if outcome.breaker == "neutral":
        return "backpressure"
    if outcome.breaker == "failure":
        return "failure"
    return "client_error" if status is not None and status >= 400 else "success"


@dataclass
class Failure:
    """A retryable failed attempt; `status` None: no response; `anomaly`: the detector of the worker's anomaly stop."""

    url: str
    status: int | None
    message: str
    content: bytes = b""
    content_type: str = "application/json"
    anomaly: str | None = None

    def to_response(self) -> Response:
        if self.status is not None:
            return Response(self.content, status_code=self.status, media_type=self.content_type)
        return JSONResponse(error_body(f"no worker available: last attempt failed ({self.message})",
                                       "no_worker_available", 503), status_code=503)


class Forwarder:
    """Sends requests to policy-picked workers, retrying on untried ones (SGLang router retry rules)."""

    def __init__(self, config: RouterConfig, registry: Any, policy: Any, metrics: RouterMetrics,
                 http: httpx.AsyncClient, post: Post | None = None):
        self.config, self.registry, self.policy = config, registry, policy
        self.metrics, self.http = metrics, http
        self.post = post or self._post
        self.max_attempts = 1 if config.disable_retries else config.retry_max_attempts

    async def _post(self, url: str, body: bytes, headers: dict[str, bytes]) -> httpx.Response:
        request = self.http.build_request("POST", url, content=body, headers=headers)
        return await self.http.send(request, stream=True)

    def backoff_s(self, retry: int) -> float:
        """Seconds before 1-based retry `retry`: capped exponential, times 1 + U[-jitter, jitter] (SGLang `retry.rs`)."""
        c = self.config
        delay_ms = min(c.retry_initial_backoff_ms * c.retry_backoff_multiplier ** (retry - 1),
                       c.retry_max_backoff_ms)
        return delay_ms * (1.0 + random.uniform(-c.retry_jitter, c.retry_jitter)) / 1000.0

    def record(self, worker: Any, status: int | None, transport_error: bool,
               kind: str | None = None) -> None:
        worker.record(classify(status, transport_error, kind).breaker)
        self.metrics.requests.labels(worker.url,
                                     outcome_label(status, transport_error, kind)).inc()

    @property
    def migration_on(self) -> bool:
        return not self.config.disable_stream_migration

    async def forward(self, path: str, body: bytes, headers: dict[str, bytes], key: Any,
                      stream: bool, t_start: float) -> Response:
        """POST to a worker chosen for `key`; retries transport errors, 408, 429, 5xx, and a stream's
        error before content. Returns the response (a RelayResponse for a stream), or 503."""
        tried: set[str] = set()
        attempts = Attempts()
        ledger = StreamLedger(path, body, self.migration_on) if stream else None
        send = ledger.first_body() if ledger is not None else body
        result = await self._dispatch(path, send, headers, key, ledger, tried, attempts, t_start)
        if isinstance(result, Opened):
            assert ledger is not None, "only a stream opens"

            async def resend() -> tuple[Opened | None, str]:
                return await self.continue_stream(path, headers, key, ledger, tried, attempts)
            return RelayResponse(Relay(self, ledger, result, resend))
        if result is None:
            self.metrics.no_worker.inc()
            return JSONResponse(error_body("no worker available", "no_worker_available", 503),
                                status_code=503)
        if isinstance(result, Failure):
            self.metrics.retries_exhausted.inc()
            logger.warning("request failed on %d worker(s): last %s", len(tried), result.message)
            return result.to_response()
        return result

    async def continue_stream(self, path: str, headers: dict[str, bytes], key: Any,
                              ledger: StreamLedger, tried: set[str],
                              attempts: Attempts) -> tuple[Opened | None, str]:
        result = await self._dispatch(path, ledger.continuation_body(), headers, key, ledger,
                                      tried, attempts, None)
        if isinstance(result, Opened):
            logger.info("stream continued on %s after %d tokens", result.lease.worker.url,
                        len(ledger.token_ids))
            return result, "success"
        if isinstance(result, Response):
            logger.warning("continuation refused (%d): %s", result.status_code, result.body[:200])
            return None, "refused"
        return None, "exhausted"

    async def _dispatch(self, path: str, body: bytes, headers: dict[str, bytes], key: Any,
                        ledger: StreamLedger | None, tried: set[str], attempts: Attempts,
                        t_start: float | None) -> Response | Opened | Failure | None:
        """Attempts on untried workers within the budget; None when none could be tried."""
        last: Failure | None = None
        while attempts.made < self.max_attempts:
            if attempts.made and self.registry.candidates(exclude=tried):
                await asyncio.sleep(self.backoff_s(attempts.made))
            candidates = self.registry.candidates(exclude=tried)
            if not candidates:
                break
            if attempts.made:
                self.metrics.retries.inc()
            if last is not None and last.anomaly is not None:
                self.metrics.anomalies.labels(last.anomaly, "retried").inc()
            attempts.made += 1
            decision = self.policy.select(key, candidates)
            self.metrics.routing_decisions.labels(decision.reason).inc()
            worker = decision.worker
            tried.add(worker.url)
            lease = Lease(self.registry, worker)
            if t_start is not None and attempts.made == 1:
                self.metrics.added_latency.observe(time.perf_counter() - t_start)
            result: Response | Opened | Failure | None = None
            try:
                result = await self._attempt(lease, path, body, headers, ledger)
            finally:
                if not isinstance(result, Opened):
                    lease.release()  # an Opened stream's relay releases it
            if not isinstance(result, Failure):
                return result
            last = result
        if last is not None and last.anomaly is not None:
            self.metrics.anomalies.labels(last.anomaly, "exhausted").inc()
        return last

    async def _attempt(self, lease: Lease, path: str, body: bytes, headers: dict[str, bytes],
                       ledger: StreamLedger | None) -> Response | Opened | Failure:
        """An Opened stream owns the lease and upstream; otherwise upstream is closed on every exit."""
        worker = lease.worker
        upstream: httpx.Response | None = None
        read = lease.watch().read if ledger is not None else _call
        try:
            try:
                upstream = await read(lambda: self.post(worker.url + path, body, headers))
                if ledger is not None and upstream.status_code == 200:
                    opened = await self._open(lease, upstream, ledger)
                    if isinstance(opened, Opened):
                        upstream = None
                    return opened
                content = await read(upstream.aread)
            except (*UNREACHABLE, Ejected) as exc:
                self.record(worker, None, True)
                logger.info("attempt on %s failed: %r", worker.url, exc)
                return Failure(worker.url, None, f"{worker.url}: {type(exc).__name__}: {exc}")
        finally:
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
        status = upstream.status_code
        kind = error_kind(content) if status == 503 else None
        self.record(worker, status, False, kind)
        content_type = wire_header(upstream.headers, "content-type") or "application/json"
        if classify(status, False, kind).retry:
            return Failure(worker.url, status, f"{worker.url} answered {status}", content,
                           content_type, anomaly_kind(error_of_body(content)))
        return Response(content, status_code=status, media_type=content_type)

    async def _open(self, lease: Lease, upstream: httpx.Response,
                    ledger: StreamLedger) -> Opened | Failure:
        """Read up to the first content event, so earlier failures retry from the prompt as if
        nothing was sent: a retryable error event is a Failure; transport errors and Ejected propagate."""
        batches = lease.watch().events(sse_batches(upstream.aiter_raw()))
        pending: list[bytes] = []
        async for batch in batches:
            for i, event in enumerate(batch):
                error = error_in(ledger.parse(event))
                if error is not None:
                    status, kind = event_status(error), error.get("type")
                    if classify(status, False, kind).retry:
                        self.record(lease.worker, status, False, kind)
                        return Failure(lease.worker.url, status, f"{lease.worker.url} failed before "
                                       f"any content ({kind})", json.dumps({"error": error}).encode(),
                                       anomaly=anomaly_kind(error))
                pending.append(event)
                if not ledger.is_held(event):
                    return Opened(lease, upstream, batches, pending, batch[i + 1:])
        return Opened(lease, upstream, batches, pending)


async def _call(step: Callable[[], Awaitable[Any]]) -> Any:
    return await step()
