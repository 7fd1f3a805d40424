"""Cutting the streams of a worker the router ejects: each worker stream is read through a StreamWatch that the worker can cut from outside (docs/stream_migration.md)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

T = TypeVar("T")


class Ejected(Exception):
    """The read was cut because its worker was ejected; handled as a transport error."""


class StreamWatch:
    """Reads of one worker stream, in `worker.streams` until close(). eject() cancels the task of the
    read in progress, or else marks the next one: it raises Ejected. The caller closes the upstream."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.ejected = False
        self._reader: asyncio.Task | None = None
        self._cut = False
        worker.streams.add(self)

    def eject(self) -> None:
        self.ejected = True
        if self._reader is not None and not self._cut:
            self._cut = self._reader.cancel()

    def close(self) -> None:
        self.worker.streams.discard(self)

    async def read(self, step: Callable[[], Awaitable[T]]) -> T:
        if not self.ejected:
            self._reader = asyncio.current_task()
            try:
                return await step()
            except asyncio.CancelledError:
                # an outer cancellation too (client gone) leaves the task cancelled: re-raised
                if not self._cut or self._reader.uncancel() > 0:
                    raise
            finally:
                self._reader = None
        raise Ejected(f"worker {self.worker.url} was ejected (failed health checks)")

    async def events(self, source: AsyncIterator[T]) -> AsyncIterator[T]:
        while True:
            try:
                item = await self.read(source.__anext__)
            except StopAsyncIteration:
                return
            yield item
