"""Forward one client request to workers: selection, retries with jittered backoff, stream relay."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.errors import error_body
from radixserve.router.config import RouterConfig
from radixserve.router.metrics import RouterMetrics
from radixserve.router.outcome import classify, error_kind

logger = logging.getLogger(__name__)

# Response headers of a worker that are relayed to the client (hop-by-hop ones are not).
RELAYED_HEADERS = ("content-type", "cache-control", "x-request-id")
# A worker that cannot be reached: a transport error, or a URL httpx refuses (the admin API
# validates URLs; this keeps a bad one from turning into a 500 if one ever gets through).
UNREACHABLE = (httpx.TransportError, httpx.InvalidURL)


def wire_header(headers: httpx.Headers, name: str) -> str | None:
    """The first `name` header (lower-case) as its bytes on the wire decoded latin-1, which
    Starlette encodes back to the same bytes (httpx may decode it as UTF-8 instead, and a
    character beyond latin-1 would then fail to encode: a 500). None if absent."""
    for key, value in headers.raw:
        if key.lower() == name.encode():
            return value.decode("latin-1")
    return None


def outcome_label(status: int | None, transport_error: bool, kind: str | None = None) -> str:
    """`outcome` label of requests_total: success, client_error, backpressure, failure or
    transport_error (`kind`: the error body's type, see outcome.classify)."""
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
    """One attempt that failed in a way another worker may fix. `status` None: no response
    (transport error or timeout); else the worker's status, body and content type."""

    url: str
    status: int | None
    message: str
    content: bytes = b""
    content_type: str = "application/json"

    def to_response(self) -> Response:
        """The worker's own error response, or 503 when no worker answered at all."""
        if self.status is not None:
            return Response(self.content, status_code=self.status, media_type=self.content_type)
        return JSONResponse(error_body(f"no worker available: last attempt failed ({self.message})",
                                       "no_worker_available", 503), status_code=503)


class Lease:
    """One dispatch of a request to a worker: the registry's in-flight counting context,
    entered now and exited exactly once by `release()` (finish, error or disconnect)."""

    def __init__(self, registry: Any, worker: Any):
        self.worker = worker
        self._ctx = registry.dispatch(worker)
        self._ctx.__enter__()
        self._open = True

    def release(self) -> None:
        if self._open:
            self._open = False
            self._ctx.__exit__(None, None, None)


class Relay:
    """A worker's SSE response relayed chunk by chunk (httpx `aiter_raw`, nothing buffered).
    The first chunk was read before the client saw a byte (so the request could still be
    retried); a failure after it ends the client's stream with an error event and no replay
    (field case C20). `close()` runs once however the response ends."""

    def __init__(self, forwarder: Forwarder, lease: Lease, upstream: httpx.Response,
                 chunks: AsyncIterator[bytes], first: bytes):
        self.forwarder, self.lease, self.upstream = forwarder, lease, upstream
        self.chunks, self.first = chunks, first
        self.outcome: tuple[int | None, bool] | None = None  # (status, transport_error)
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        tail = self.first
        try:
            if self.first:
                yield self.first
            async for chunk in self.chunks:
                if chunk:
                    tail = chunk
                    yield chunk
            self.outcome = (self.upstream.status_code, False)
        except httpx.TransportError as exc:
            url = self.lease.worker.url
            logger.warning("stream from %s broke after its first byte: %r", url, exc)
            self.outcome = (None, True)
            event = error_body(f"worker {url} failed mid-stream ({type(exc).__name__}); "
                               "the response is incomplete", "worker_error", 502)
            gap = b"" if tail.endswith(b"\n\n") else b"\n\n"
            yield gap + b"data: " + json.dumps(event).encode() + b"\n\n"
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Shielded: on client disconnect this runs inside a cancelled (anyio, level-triggered)
            # scope, where an unshielded await would be cut short and leave the worker running.
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()  # mid-body: drops the connection, the worker aborts
        finally:
            if self.outcome is not None:  # None: the client left; nothing to hold against the worker
                self.forwarder.record(self.lease.worker, *self.outcome)
            self.lease.release()


class RelayResponse(StreamingResponse):
    """StreamingResponse that closes its relay even when the client left before the first
    event (then the event generator never starts and its own cleanup never runs)."""

    def __init__(self, relay: Relay):
        headers = {k: v for k in RELAYED_HEADERS if (v := wire_header(relay.upstream.headers, k))}
        super().__init__(relay.events(), status_code=relay.upstream.status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


class Forwarder:
    """Sends a request to the workers the policy picks, retrying per RouterConfig (SGLang
    router retry rules, routers.md §1.3 and §8 item 10, with tried workers excluded).
    `registry`, `policy`: router-core's WorkerRegistry and Policy; `http`: the shared client."""

    def __init__(self, config: RouterConfig, registry: Any, policy: Any, metrics: RouterMetrics,
                 http: httpx.AsyncClient):
        self.config, self.registry, self.policy = config, registry, policy
        self.metrics, self.http = metrics, http
        self.max_attempts = 1 if config.disable_retries else config.retry_max_attempts

    def backoff_s(self, retry: int) -> float:
        """Delay before retry number `retry` (1-based), in s: initial * multiplier^(retry-1),
        capped, times 1 + U[-jitter, +jitter] (SGLang router `retry.rs`)."""
        c = self.config
        delay_ms = min(c.retry_initial_backoff_ms * c.retry_backoff_multiplier ** (retry - 1),
                       c.retry_max_backoff_ms)
        return delay_ms * (1.0 + random.uniform(-c.retry_jitter, c.retry_jitter)) / 1000.0

    def record(self, worker: Any, status: int | None, transport_error: bool,
               kind: str | None = None) -> None:
        """Feed one attempt's outcome to the worker's breaker, counters and metrics (`kind`:
        the error body's type, see outcome.classify)."""
        worker.record(classify(status, transport_error, kind).breaker)
        self.metrics.requests.labels(worker.url,
                                     outcome_label(status, transport_error, kind)).inc()

    async def forward(self, path: str, body: bytes, headers: dict[str, bytes], key: Any,
                      stream: bool, t_start: float) -> Response:
        """POST `body` to `path` on a worker chosen for `key` (a policy RouteKey) with the
        client's `headers` (values as received, bytes); retries
        on transport errors, 408, 429 and 5xx on other workers. Returns the relayed
        response, a worker's error, or 503 when no worker could be tried."""
        tried: set[str] = set()
        last: Failure | None = None
        for attempt in range(self.max_attempts):
            if attempt and self.registry.routable(exclude=tried):
                await asyncio.sleep(self.backoff_s(attempt))
            candidates = self.registry.routable(exclude=tried)
            if not candidates:
                break
            if attempt:
                self.metrics.retries.inc()
            decision = self.policy.select(key, candidates)
            self.metrics.routing_decisions.labels(decision.reason).inc()
            worker = decision.worker
            tried.add(worker.url)
            lease = Lease(self.registry, worker)
            if attempt == 0:
                self.metrics.added_latency.observe(time.perf_counter() - t_start)
            result: Response | Failure | None = None
            try:
                result = await self._attempt(lease, path, body, headers, stream)
            finally:
                if not isinstance(result, RelayResponse):
                    lease.release()  # a relay releases its own lease when the stream ends
            if not isinstance(result, Failure):
                return result
            last = result
        if last is None:
            self.metrics.no_worker.inc()
            return JSONResponse(error_body("no worker available", "no_worker_available", 503),
                                status_code=503)
        self.metrics.retries_exhausted.inc()
        logger.warning("request failed on %d worker(s): last %s", len(tried), last.message)
        return last.to_response()

    async def _attempt(self, lease: Lease, path: str, body: bytes, headers: dict[str, bytes],
                       stream: bool) -> Response | Failure:
        """One attempt on `lease.worker`. Returns the response for the client (a RelayResponse
        for a stream, which then owns the lease and the upstream response) or a retryable
        Failure. The upstream response is closed on every other way out, cancellation included
        (closing it mid-body drops the connection, so the worker aborts the request)."""
        worker = lease.worker
        upstream: httpx.Response | None = None
        try:
            try:
                request = self.http.build_request("POST", worker.url + path, content=body,
                                                  headers=headers)
                upstream = await self.http.send(request, stream=True)
                if stream and upstream.status_code == 200:
                    chunks = upstream.aiter_raw()
                    first = await anext(chunks, b"")
                    relay, upstream = Relay(self, lease, upstream, chunks, first), None
                    return RelayResponse(relay)
                content = await upstream.aread()
            except UNREACHABLE as exc:
                self.record(worker, None, True)
                logger.info("attempt on %s failed: %r", worker.url, exc)
                return Failure(worker.url, None, f"{worker.url}: {type(exc).__name__}: {exc}")
        finally:
            if upstream is not None:
                with anyio.CancelScope(shield=True):  # see Relay.close
                    await upstream.aclose()
        status = upstream.status_code
        kind = error_kind(content) if status == 503 else None
        self.record(worker, status, False, kind)
        content_type = wire_header(upstream.headers, "content-type") or "application/json"
        if classify(status, False, kind).retry:
            return Failure(worker.url, status, f"{worker.url} answered {status}", content,
                           content_type)
        return Response(content, status_code=status, media_type=content_type)
