"""Wire messages between the HTTP process and the engine loop (msgpack via msgspec).

One PUSH/PULL socket per direction; the HTTP process binds both ipc:// endpoints:

    HTTP -> engine   Submit(group_id, adds)     all choices of one HTTP request, added atomically
                     Abort(request_ids)         fire and forget; the final output is not sent back
                     Call(call_id, method, args) loop.py's CALL_METHODS: stats, flush_cache, ...,
                                                and `fault` (chaos/engine_faults.py)
                     Shutdown()
    engine -> HTTP   Ready(info)                once, after the model is loaded
                     Submitted(group_id, error) one per Submit, before any output of its requests
                     list[EngineOutput]         one per step that produced any
                     CallResult(call_id, value, error)
                     Fatal(message)             the engine loop crashed; the process exits
                     Heartbeat()                between steps, at most every HEARTBEAT_S; the HTTP
                                                side's watchdog declares a silent engine wedged
"""
from __future__ import annotations

from typing import Any

import msgspec

from radixserve.errors import RadixServeError
from radixserve.outputs import EngineOutput
from radixserve.sampling_params import SamplingParams


class PDTarget(msgspec.Struct, frozen=True):
    """Prefill/decode disaggregation: the prefill worker's bootstrap address and the room both
    legs of a request share (radixserve/disagg/protocol.py re-exports it)."""

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


class Submit(msgspec.Struct, frozen=True, tag=True):
    group_id: str
    adds: list[AddReq]


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
    """What the HTTP process learns about the engine at start-up."""

    max_context_len: int      # effective limit on prompt + output tokens of one request
    page_size: int            # KV page size in tokens
    disaggregation_mode: str = "null"          # null | prefill | decode
    bootstrap_address: str | None = None       # prefill: tcp://host:port of its bootstrap service


class WireError(msgspec.Struct, frozen=True):
    """A RadixServeError in transit: enough to rebuild the OpenAI error body."""

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
    group_id: str
    error: WireError | None = None


class CallResult(msgspec.Struct, frozen=True, tag=True):
    """A Call's return value, or its error; `wire_error` is set when the engine refused the
    call's arguments (a RadixServeError), so the HTTP side answers with that error's status."""

    call_id: int
    value: Any = None
    error: str | None = None
    wire_error: WireError | None = None


class Fatal(msgspec.Struct, frozen=True, tag=True):
    message: str


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    pass


ToEngine = Submit | Abort | Call | Shutdown
FromEngine = Ready | Submitted | list[EngineOutput] | CallResult | Fatal | Heartbeat
