"""Cutting the streams of a worker the router ejects: each worker stream is read through a StreamWatch that the worker can cut from outside (docs/stream_migration.md)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio

T = TypeVar("T")


class Ejected(Exception):
    """The worker of a stream being read was ejected (it turned unhealthy): the read was cut.
    The router counts it as a transport error: the stream is retried before its first
    content and continued after it, exactly like a broken stream."""


class StreamWatch:
    """The router's reads of one worker stream, registered in the worker's `streams` from
    creation until `close()`, so that `WorkerState.eject_streams` can cut them.

    Each read (`read`: the request's response headers, or its error body; `events`: the
    next event) runs in its own anyio cancel scope, which `eject()` cancels; no scope spans
    a yield. A read in progress ends at once; a read that starts later raises at once, so an
    ejection that lands while the event before is still being relayed is not lost:

        reader:  read ──(event)── relay to client ── read ──(event)── ...
        eject():      cancels the read's scope  or  sets `ejected`: the next read raises

    Cut reads raise Ejected. The caller must still close the upstream response (the worker
    aborts the request only when the connection drops) and then `close()` the watch.
    """

    def __init__(self, worker: Any):
        self.worker = worker
        self.ejected = False
        self._scope: anyio.CancelScope | None = None
        worker.streams.add(self)

    def eject(self) -> None:
        """Cut the stream: the read in progress, or else the next one, raises Ejected."""
        self.ejected = True
        if self._scope is not None:
            self._scope.cancel()

    def close(self) -> None:
        """Unregister from the worker (idempotent); later ejections leave this stream alone."""
        self.worker.streams.discard(self)

    async def read(self, step: Callable[[], Awaitable[T]]) -> T:
        """`await step()`, cut short by `eject()`: raises Ejected (and whatever step raises)."""
        if not self.ejected:
            # Level-triggered: if an outer scope is cancelled too (the client left), anyio
            # re-raises its CancelledError at the scope's exit instead of swallowing it here.
            with anyio.CancelScope() as scope:
                self._scope = scope
                try:
                    return await step()
                finally:
                    self._scope = None
        raise Ejected(f"worker {self.worker.url} was ejected (failed health checks)")

    async def events(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The events of `source`, each read cut short by `eject()` (raises Ejected)."""
        while True:
            try:
                event = await self.read(source.__anext__)
            except StopAsyncIteration:
                return
            yield event
