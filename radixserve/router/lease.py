"""One request's claim on workers: a Lease per dispatch (in-flight count, stream watch) and the Attempts budget its retries and continuations share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.router.eject import StreamWatch


@dataclass(slots=True)
class Attempts:
    """One client request's attempts, continuations included, against retry_max_attempts."""

    made: int = 0


class Lease:
    """One dispatch: the registry's in-flight context, exited exactly once by `release()`."""

    def __init__(self, registry: Any, worker: Any):
        self.worker = worker
        self._ctx = registry.dispatch(worker)
        self._ctx.__enter__()
        self._open = True
        self._watch: StreamWatch | None = None

    def watch(self) -> StreamWatch:
        """Reads through it raise Ejected once the worker is ejected (eject.py)."""
        assert self._open, "a stream is watched only while its lease is held"
        if self._watch is None:
            self._watch = StreamWatch(self.worker)
        return self._watch

    def release(self) -> None:
        if self._open:
            self._open = False
            if self._watch is not None:
                self._watch.close()
            self._ctx.__exit__(None, None, None)
