"""The PD fault points (table in docs/disaggregation.md) for the PD worker's `faults` seam; nothing sleeps: owners check held items between steps."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from radixserve.disagg.api import Fired
from radixserve.errors import InvalidRequest

POINT_ACTIONS = {
    "pd.bootstrap": ("delay", "fail"),
    "pd.prefill.start": ("delay", "hang"),
    "pd.transfer.write": ("delay", "fail", "hang", "duplicate", "late"),
    "pd.transfer.done": ("delay", "fail", "hang"),
    "pd.decode.prealloc": ("delay", "hang"),
}


@dataclass(slots=True)
class _Armed:
    action: str
    delay_ms: float
    delay_max_ms: float | None
    probability: float
    count: int | None
    ends_s: float | None


class PDFaults:
    def __init__(self, seed: int | None = None):
        self._armed: dict[str, _Armed] = {}
        self._rng = random.Random(seed)
        self.generation = 0

    def arm(self, point: str, action: str, delay_ms: float = 0.0, delay_max_ms: float | None = None,
            probability: float = 1.0, count: int | None = None,
            duration_s: float | None = None) -> None:
        """Raises InvalidRequest for an unknown point, an action it does not take, or bad numbers."""
        if point not in POINT_ACTIONS:
            raise InvalidRequest(f"unknown PD fault point {point!r}", param="kind")
        if action not in POINT_ACTIONS[point]:
            raise InvalidRequest(f"{point} takes action {POINT_ACTIONS[point]}, not {action!r}",
                                 param="action")
        if not 0.0 <= probability <= 1.0 or delay_ms < 0 or (count is not None and count < 1):
            raise InvalidRequest("need 0 <= probability <= 1, delay_ms >= 0, count >= 1",
                                 param="probability")
        if delay_max_ms is not None and delay_max_ms < delay_ms:
            raise InvalidRequest("delay_max_ms must be >= delay_ms", param="delay_max_ms")
        ends = None if duration_s is None else time.monotonic() + duration_s
        self._armed[point] = _Armed(action, delay_ms, delay_max_ms, probability, count, ends)

    def disarm(self, point: str | None = None) -> None:
        if point is None:
            self._armed.clear()
        else:
            self._armed.pop(point, None)
        self.generation += 1

    def fire(self, point: str) -> Fired | None:
        armed = self._armed.get(point)
        if armed is None:
            return None
        if armed.ends_s is not None and time.monotonic() >= armed.ends_s:
            del self._armed[point]
            return None
        if self._rng.random() >= armed.probability:
            return None
        if armed.count is not None:
            armed.count -= 1
            if armed.count <= 0:
                del self._armed[point]
        delay_ms = armed.delay_ms
        if armed.delay_max_ms is not None:
            delay_ms = self._rng.uniform(armed.delay_ms, armed.delay_max_ms)
        return Fired(armed.action, delay_ms / 1000)
