"""The HTTP side of prefill/decode disaggregation, on prefill and decode workers only: a request's bootstrap fields -> its engine requests' PDTargets."""
from __future__ import annotations

from typing import Any

from radixserve.engine.messages import AddReq, PDTarget
from radixserve.errors import InvalidRequest

ROOM_MOD = 1 << 63


def pd_target(mode: str, req: Any) -> PDTarget:
    """The PDTarget of a completion or chat request; InvalidRequest (400) when a bootstrap field is missing."""
    fields = (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if any(f is None for f in fields):
        raise InvalidRequest(f"this worker runs with --disaggregation-mode {mode}: a request needs "
                             "bootstrap_host, bootstrap_port and bootstrap_room (send it through "
                             "`radixserve route --prefill ... --decode ...`)", param="bootstrap_room")
    return PDTarget(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)


def with_rooms(adds: list[AddReq], target: PDTarget) -> list[AddReq]:
    """`adds` bound for `target`: the run's k-th request gets room + k, the same on both legs."""
    return [AddReq(a.request_id, a.prompt_ids, a.params,
                   PDTarget(target.bootstrap_host, target.bootstrap_port, (target.room + k) % ROOM_MOD))
            for k, a in enumerate(adds)]
