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
from radixserve.router.outcome import anomaly_kind, classify, event_status
from radixserve.router.stream import DONE, StreamLedger, error_event, error_in

logger = logging.getLogger(__name__)

RELAYED_HEADERS = ("content-type", "cache-control", "x-request-id")


def wire_header(headers: httpx.Headers, name: str) -> str | None:
    """The first `name` header decoded latin-1, so Starlette re-encodes the same bytes."""
    for key, value in headers.raw:
        if key.lower() == name.encode():
            return value.decode("latin-1")
    return None


class Forwarding(Protocol):

    metrics: RouterMetrics

    @property
    def migration_on(self) -> bool: ...

    def record(self, worker: Any, status: int | None, transport_error: bool,
               kind: str | None = None) -> None: ...


@dataclass
class Opened:
    """A committable worker stream; `pending`: events read up to commit, sent first with `more`, those read with them."""

    lease: Lease
    upstream: httpx.Response
    batches: AsyncIterator[list[bytes]]
    pending: list[bytes] = field(default_factory=list)
    more: list[bytes] = field(default_factory=list)


class StreamCut(Exception):
    """A stream broke after content; `event`: the worker's error event (None: transport error);
    `anomaly`: the detector when the worker stopped its own output as suspect (never continued)."""

    def __init__(self, message: str, event: bytes | None = None, status: int | None = None,
                 kind: str | None = None, anomaly: str | None = None):
        super().__init__(message)
        self.event, self.status, self.kind, self.anomaly = event, status, kind, anomaly


class Relay:
    """One client stream via `ledger`, continued on other workers when one breaks or is ejected, else ended by an error
    event and `data: [DONE]` (never a silent replay). An output anomaly after content is never continued."""

    def __init__(self, forwarder: Forwarding, ledger: StreamLedger, opened: Opened,
                 resend: Any):
        self.forwarder, self.ledger, self.opened = forwarder, ledger, opened
        self.resend = resend   # async () -> (Opened | None, outcome)
        self.upstream = opened.upstream
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
                    if cut is not None and cut.anomaly is not None:
                        self.forwarder.metrics.anomalies.labels(cut.anomaly, "ended").inc()
                        yield cut.event or error_event(f"worker {url} stopped its output as suspect")
                        yield DONE
                        return
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
        batch, opened.more = opened.more, []
        outs = [out for event in pending if (out := ledger.relay(event)) is not None]
        last = pending[-1] if pending else b""
        while True:
            cut = None
            for event in batch:
                last = event
                if (cut := self._cut_by(event)) is not None:
                    break
                if (out := ledger.relay(event)) is not None:
                    outs.append(out)
            if outs:
                yield b"".join(outs)
                outs = []
            if cut is not None:
                raise cut
            try:
                batch = await anext(opened.batches)
            except StopAsyncIteration:
                break
        if last.strip() != DONE.strip():
            raise httpx.RemoteProtocolError("the worker's stream ended without data: [DONE]")

    def _cut_by(self, event: bytes) -> StreamCut | None:
        error = error_in(self.ledger.parse(event))
        if error is None:
            return None
        status, kind, anomaly = event_status(error), error.get("type"), anomaly_kind(error)
        if anomaly is not None or (self.forwarder.migration_on and classify(status, False, kind).retry):
            return StreamCut(f"error event {kind}", event, status, kind, anomaly)
        return None

    async def _continued(self) -> bool:
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
        opened, self.opened = self.opened, None
        if opened is None:
            return
        try:
            # Shielded: on disconnect this runs in a cancelled scope; closing mid-body aborts the worker.
            with anyio.CancelScope(shield=True):
                await opened.upstream.aclose()
        finally:
            if self.outcome is not None:  # None: the client left
                self.forwarder.record(opened.lease.worker, *self.outcome)
            opened.lease.release()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._leave()


class RelayResponse(ClosingStreamingResponse):
    """The first worker's status and RELAYED_HEADERS; closes the relay however it ends."""

    def __init__(self, relay: Relay):
        headers = {k: v for k in RELAYED_HEADERS if (v := wire_header(relay.upstream.headers, k))}
        super().__init__(relay.events(), relay.close, status_code=relay.upstream.status_code,
                         headers=headers)
        self.relay = relay
