"""Prefill side's per-room records: states (diagram in prefill_side.py), write ledger, writes held by a fault."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.disagg.protocol import Expect, KVDone, KVWrite
from radixserve.engine.request import Request


class RoomState(enum.Enum):
    BOOTSTRAP = "bootstrap"
    EXPECTED = "expected"
    STARTING = "starting"
    PREFILLING = "prefilling"
    SENT = "sent"
    CLOSED = "closed"


@dataclass(slots=True, eq=False)
class Room:
    room: int
    created_s: float
    state: RoomState
    req: Request | None = None
    peer: bytes | None = None
    dest_page_ids: list[int] = field(default_factory=list)
    expect: Expect | None = None
    ready_s: float = 0.0
    start_due_s: float | None = None       # pd.prefill.start delay; hang: start_hang_gen
    start_hang_gen: int | None = None
    num_pages_sent: int = 0
    num_writes: int = 0                    # writes started (duplicates not counted)
    num_in_flight: int = 0                 # started, not yet handed to the ordered stream
    closing: str | None = None             # "abort" (answer SafeToFree) or a failure message
    done: KVDone | None = None             # sent once num_in_flight == 0
    done_due_s: float | None = None
    done_hang_gen: int | None = None


@dataclass(slots=True, eq=False)
class HeldWrite:
    room: Room
    msg: KVWrite
    due_s: float | None          # None: hung (hang_gen) or late (until its room closes)
    hang_gen: int | None = None
    late: bool = False

    def is_due(self, now_s: float, fault_generation: int) -> bool:
        return ((self.due_s is not None and self.due_s <= now_s)
                or (self.hang_gen is not None and self.hang_gen != fault_generation)
                or (self.late and self.room.closing is not None))


def held_over(due_s: float | None, hang_gen: int | None, now_s: float, fault_generation: int) -> bool:
    """Whether an item held by a delay (`due_s`) or a hang (`hang_gen`) may go now."""
    return ((due_s is not None and due_s <= now_s)
            or (hang_gen is not None and hang_gen != fault_generation))
