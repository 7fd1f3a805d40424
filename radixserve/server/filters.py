"""Output filters: what every choice update of a request passes before it is sent (the corrupt fault, the anomaly guard)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from radixserve.server.tracker import ChoiceUpdate


class Detection(NamedTuple):
    """`kind` (anomaly.KINDS or another detector's) and a human-readable reason."""

    kind: str
    detail: str


class OutputFilter(Protocol):
    """Fed each non-empty update of choice `index` before it is sent; may replace its text; a Detection ends it."""

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None: ...


# Where a filter sends a detection it only reports (choice index, detection): counted and logged.
Reporter = Callable[[int, Detection], None]
