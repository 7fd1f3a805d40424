"""A worker's SSE stream relayed to the client event by event, continued on another worker when it breaks (stream migration)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import anyio
import httpx

from radixserve.http_common import ClosingStreamingResponse
from radixserve.router.eject import Ejected
from radixserve.router.lease import Lease
from radixserve.router.metrics import RouterMetrics
from radixserve.router.outcome import classify, event_status
from radixserve.router.stream import DONE, StreamLedger, error_event, error_of

logger = logging.getLogger(__name__)

# Response headers of a worker that are relayed to the client (hop-by-hop ones are not).
RELAYED_HEADERS = ("content-type", "cache-control", "x-request-id")


def wire_header(headers: httpx.Headers, name: str) -> str | None:
    """The first `name` header (lower-case) as its bytes on the wire decoded latin-1, which
    Starlette encodes back to the same bytes (httpx may decode it as UTF-8 instead, and a
    character beyond latin-1 would then fail to encode: a 500). None if absent."""
    for key, value in headers.raw:
        if key.lower() == name.encode():
            return value.decode("latin-1")
    return None


class Forwarding(Protocol):
    """What a Relay needs of the Forwarder that opened its stream (proxy.py)."""

    metrics: RouterMetrics

    @property
    def migration_on(self) -> bool: ...

    def record(self, worker: Any, status: int | None, transport_error: bool,
               kind: str | None = None) -> None: ...


@dataclass
class Opened:
    """A worker stream the client may be given: its lease, the upstream response, its event
    iterator, and the events read before the stream was committed (to be sent first)."""

    lease: Lease
    upstream: httpx.Response
    events: AsyncIterator[bytes]
    pending: list[bytes] = field(default_factory=list)


class StreamCut(Exception):
    """A worker's stream broke after content reached the client. `event`: the worker's own
    error event (None: a transport error); `status`, `kind`: what it counts as (outcome.py)."""

    def __init__(self, message: str, event: bytes | None = None, status: int | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.event, self.status, self.kind = event, status, kind


class Relay:
    """One client stream: the events of `opened` passed through `ledger`, then, when the
    worker breaks (transport error, or an error event that is the worker's fault) or is
    ejected (it turned unhealthy: Ejected, counted as a transport error) and the ledger can
    continue, the events of a continuation on another worker
    (Forwarder.continue_stream), as often as the attempt budget allows. When none can go on,
    the stream ends with an error event and `data: [DONE]`: the worker's own error event,
    else a router-made `worker_error` (field case C20: never a silent replay). `close()` runs
    once however the response ends; each worker's outcome is recorded as it is left."""

    def __init__(self, forwarder: Forwarding, ledger: StreamLedger, opened: Opened,
                 resend: Any):
        self.forwarder, self.ledger, self.opened = forwarder, ledger, opened
        self.resend = resend   # async () -> Opened | None: a continuation, or None
        self.upstream = opened.upstream  # the first worker's (status and headers)
        self.outcome: tuple[int | None, bool, str | None] | None = None
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                try:
                    async for out in self._relay():
                        yield out
                    self.outcome = (self.opened.upstream.status_code, False, None)
                    return
                except (httpx.TransportError, StreamCut, Ejected) as exc:
                    cut = exc if isinstance(exc, StreamCut) else None
                    url = self.opened.lease.worker.url
                    logger.warning("stream from %s %s after content: %r", url, "was cut"
                                   if isinstance(exc, Ejected) else "broke", exc)
                    self.outcome = (cut.status, False, cut.kind) if cut else (None, True, None)
                    await self._leave()
                    self.outcome = None
                    if await self._continued():
                        continue
                    why = "was ejected (failed health checks)" if isinstance(
                        exc, Ejected) else f"failed ({type(exc).__name__})"
                    yield cut.event if cut and cut.event else error_event(
                        f"worker {url} {why} mid-stream; the response is incomplete")
                    yield DONE
                    return
        finally:
            await self.close()

    async def _relay(self) -> AsyncIterator[bytes]:
        opened, ledger = self.opened, self.ledger
        pending, opened.pending = opened.pending, []
        for event in pending:
            if (out := ledger.relay(event)) is not None:
                yield out
        last = pending[-1] if pending else b""
        async for event in opened.events:
            last = event
            error = error_of(event)
            if error is not None and self.forwarder.migration_on:
                status, kind = event_status(error), error.get("type")
                if classify(status, False, kind).retry:
                    raise StreamCut(f"error event {kind}", event, status, kind)
            if (out := ledger.relay(event)) is not None:
                yield out
        if last.strip() != DONE.strip():   # a worker ends every stream with [DONE]: this one was cut
            raise httpx.RemoteProtocolError("the worker's stream ended without data: [DONE]")

    async def _continued(self) -> bool:
        """Move to a continuation if the stream can go on; count the migration's outcome."""
        metrics = self.forwarder.metrics.migrations
        if not self.forwarder.migration_on:
            return False
        if not self.ledger.can_continue():
            metrics.labels("unsupported").inc()
            return False
        opened, outcome = await self.resend()
        metrics.labels(outcome).inc()
        if opened is None:
            return False
        self.opened = opened
        return True

    async def _leave(self) -> None:
        """Close the current worker's response, record its outcome, release its lease."""
        opened, self.opened = self.opened, None
        if opened is None:
            return
        try:
            # Shielded: on client disconnect this runs inside a cancelled (anyio, level-triggered)
            # scope, where an unshielded await would be cut short and leave the worker running.
            with anyio.CancelScope(shield=True):
                await opened.upstream.aclose()  # mid-body: drops the connection, the worker aborts
        finally:
            if self.outcome is not None:  # None: the client left; nothing to hold against the worker
                self.forwarder.record(opened.lease.worker, *self.outcome)
            opened.lease.release()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._leave()


class RelayResponse(ClosingStreamingResponse):
    """The client's response of a Relay: the first worker's status and relayed headers; it
    closes the relay however it ends."""

    def __init__(self, relay: Relay):
        headers = {k: v for k in RELAYED_HEADERS if (v := wire_header(relay.upstream.headers, k))}
        super().__init__(relay.events(), relay.close, status_code=relay.upstream.status_code,
                         headers=headers)
        self.relay = relay
