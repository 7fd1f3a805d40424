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
    action: str
    delay_s: float = 0.0   # action "delay": seconds to hold


class FaultPoints(Protocol):
    """Installed by chaos/pd_faults.py; `generation` bumps on every disarm (releases hangs)."""

    generation: int

    def fire(self, point: str) -> Fired | None: ...


class SideHost(Protocol):
    engine: Engine
    pd_stats: PDStats
    clock: Callable[[], float]        # seconds, monotonic

    def fire(self, point: str) -> Fired | None: ...

    @property
    def fault_generation(self) -> int: ...

    def end_request(self, req: Request, error: str | None) -> None:
        ...

    def land(self, req: Request, token: TokenLogprob | None) -> None:
        """Decode: `req` (RUNNING, prompt KV in) gets its first token; None (max_tokens 0): it finishes."""
        ...
