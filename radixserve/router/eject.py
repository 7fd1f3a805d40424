"""Cutting the streams of a worker the router ejects: each worker stream is read through a StreamWatch that the worker can cut from outside (docs/stream_migration.md)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio

T = TypeVar("T")


class Ejected(Exception):
    """The read was cut because its worker was ejected; handled as a transport error."""


class StreamWatch:
    """Reads of one worker stream, in `worker.streams` until close(). eject() cuts the read in
    progress, or else the next one: it raises Ejected. The caller still closes the upstream."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.ejected = False
        self._scope: anyio.CancelScope | None = None
        worker.streams.add(self)

    def eject(self) -> None:
        self.ejected = True
        if self._scope is not None:
            self._scope.cancel()

    def close(self) -> None:
        self.worker.streams.discard(self)

    async def read(self, step: Callable[[], Awaitable[T]]) -> T:
        if not self.ejected:
            # an outer cancellation (client gone) is re-raised at this scope's exit
            with anyio.CancelScope() as scope:
                self._scope = scope
                try:
                    return await step()
                finally:
                    self._scope = None
        raise Ejected(f"worker {self.worker.url} was ejected (failed health checks)")

    async def events(self, source: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        while True:
            try:
                event = await self.read(source.__anext__)
            except StopAsyncIteration:
                return
            yield event
