"""What the prefill and decode sides need from the PD worker that owns them, and the fault seam they consult."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Fired:
    """A fault point that fired: its action and, for delay, the seconds to hold."""

    action: str
    delay_s: float = 0.0


class FaultPoints(Protocol):
    """The PD fault points a worker consults (chaos/pd_faults.py installs them)."""

    generation: int     # bumps on every disarm: items a hang holds are released when it moves

    def fire(self, point: str) -> Fired | None:
        """Whether `point` fires now, and how (None: it does not)."""
        ...
