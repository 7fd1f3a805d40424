"""What the prefill and decode sides need from the PD worker that owns them, and the fault seam they consult."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from radixserve.disagg.stats import PDStats
from radixserve.engine.engine import Engine
from radixserve.engine.request import Request
from radixserve.outputs import TokenLogprob


@dataclass(frozen=True, slots=True)
class Fired:
    """A fault point that fired: its action and, for delay, the seconds to hold."""

    action: str
    delay_s: float = 0.0


class FaultPoints(Protocol):
    """The PD fault points a worker consults (chaos/pd_faults.py installs them)."""

    generation: int     # bumps on every disarm: items a hang holds are released when it moves

    def fire(self, point: str) -> Fired | None: ...


class SideHost(Protocol):
    """The PD worker (worker.py) as its side sees it."""

    engine: Engine
    pd_stats: PDStats
    clock: Callable[[], float]        # seconds, monotonic

    def fire(self, point: str) -> Fired | None: ...

    @property
    def fault_generation(self) -> int: ...

    def end_request(self, req: Request, error: str | None) -> None:
        """End `req` wherever it is; `error` set: its final output carries it."""
        ...

    def land(self, req: Request, token: TokenLogprob | None) -> None:
        """Decode: `req` (RUNNING, prompt KV in) gets the prefill side's first token."""
        ...
