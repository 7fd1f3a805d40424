"""The HTTP side of prefill/decode disaggregation: a request's bootstrap fields -> the engine's PDTarget, and PD failures -> errors (never 200 with text)."""
from __future__ import annotations

from typing import Any

from radixserve.engine.messages import PDTarget
from radixserve.errors import InvalidRequest, KVTransferFailed
from radixserve.outputs import EngineOutput

ROOM_MOD = 1 << 63


def pd_target(mode: str, req: Any) -> PDTarget | None:
    """The PDTarget of a completion or chat request on a worker in `mode` (null, prefill,
    decode). Raises InvalidRequest when a PD worker gets a request without all three
    bootstrap fields, or a colocated worker gets one with any of them."""
    fields = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if mode == "null":
        if any(f is not None for f in fields):
            raise InvalidRequest("bootstrap_host / bootstrap_port / bootstrap_room are for workers "
                                 "started with --disaggregation-mode prefill|decode",
                                 param="bootstrap_room")
        return None
    if any(f is None for f in fields):
        raise InvalidRequest(f"this worker runs with --disaggregation-mode {mode}: a request needs "
                             "bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                             "`radixserve route --prefill ... --decode ...`)", param="bootstrap_room")
    return PDTarget(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)


def child_target(target: PDTarget | None, index: int) -> PDTarget | None:
    """The target of engine request `index` of a run (choice i of prompt j, numbered over
    the run): room + index, so both legs derive the same room per choice."""
    if target is None:
        return None
    return PDTarget(target.bootstrap_host, target.bootstrap_port, (target.room + index) % ROOM_MOD)


def raise_if_failed(out: EngineOutput) -> None:
    """Raise KVTransferFailed (500) for an output that ended a request by a PD failure."""
    if out.error_code == "kv_transfer_failed":
        raise KVTransferFailed(f"prefill/decode handoff failed: {out.error}")
