"""Wire messages between the HTTP process and the engine loop (msgpack via msgspec; docs/architecture.md).

A list of AddReq (one HTTP request's engine requests, a group) is added all or none, answered by one Submitted,
named by the group's first request id, before any of their outputs; an Abort gets no final output back; Heartbeat comes between steps at most every HEARTBEAT_S."""
from __future__ import annotations

from typing import Any

import msgspec

from radixserve.errors import RadixServeError
from radixserve.outputs import EngineOutput
from radixserve.sampling_params import SamplingParams


class PDTarget(msgspec.Struct, frozen=True):
    """PD disaggregation: the prefill worker's bootstrap address and the room both legs share."""

    bootstrap_host: str
    bootstrap_port: int
    room: int

    @property
    def address(self) -> str:
        return f"tcp://{self.bootstrap_host}:{self.bootstrap_port}"


class AddReq(msgspec.Struct, frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    pd: PDTarget | None = None        # set on prefill and decode workers only


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]
    reason: str = "abort"      # "stop": ended on a matched stop string (Engine.abort)


class Call(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    method: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class EngineInfo(msgspec.Struct, frozen=True):
    max_context_len: int
    page_size: int
    disaggregation_mode: str = "null"          # null | prefill | decode
    bootstrap_address: str | None = None


class WireError(msgspec.Struct, frozen=True):
    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def from_exc(cls, exc: Exception) -> WireError:
        if isinstance(exc, RadixServeError):
            code = exc.code if isinstance(exc.code, str) else None
            return cls(exc.status, exc.type, exc.message, exc.param, code)
        return cls(500, "internal_error", f"{type(exc).__name__}: {exc}")


class Ready(msgspec.Struct, frozen=True, tag=True):
    info: EngineInfo


class Submitted(msgspec.Struct, frozen=True, tag=True):
    group_id: str               # the group's first request id
    error: WireError | None = None


class CallResult(msgspec.Struct, frozen=True, tag=True):
    """`wire_error`: the call's arguments were refused (a RadixServeError), answered with its status."""

    call_id: int
    value: Any = None
    error: str | None = None
    wire_error: WireError | None = None


class Fatal(msgspec.Struct, frozen=True, tag=True):
    message: str


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    pass


ToEngine = list[AddReq] | Abort | Call | Shutdown
FromEngine = Ready | Submitted | list[EngineOutput] | CallResult | Fatal | Heartbeat
