"""Classify a worker's answer for the circuit breaker and the retry loop."""
from __future__ import annotations

import json
from typing import Literal, NamedTuple

BreakerOutcome = Literal["success", "failure", "neutral"]

# Backpressure: the worker is alive but full. Retry elsewhere; never count it against the
# worker (SGLang #39464: counting 503/429 shed a saturated worker for the whole cool-down).
_BACKPRESSURE = frozenset({429, 503})
# ... unless the body says the worker is broken: a 503 `engine_dead` is a fault.
_FAULT_TYPES = frozenset({"engine_dead"})


class Outcome(NamedTuple):
    """What one attempt means: `breaker` is recorded on the worker's breaker; `retry` says
    whether another worker may be tried."""

    breaker: BreakerOutcome
    retry: bool


def classify(status: int | None, transport_error: bool, kind: str | None = None) -> Outcome:
    """Map an HTTP status (None when no response arrived), a transport fault and the error
    body's `type` (`kind`, see error_kind; None if unknown) to an Outcome.

    Rules (SGLang router #25811/#25822/#39464, retryable set from SGLang
    `is_retryable_status`):
    - transport error or timeout (also a stream that broke after a 200): failure, retry;
    - no status and no transport error (the client went away): neutral, no retry;
    - 1xx/2xx/3xx: success;
    - 408: failure, retry; 429 and 503: neutral (backpressure: queue full, draining), retry,
      except a 503 of type engine_dead: failure, retry;
    - any other 4xx (400, 401, 403, 404, 413, 422, ...): the client's fault, so success for
      the breaker and never retried;
    - any other 5xx (500, 502, 504, ...): failure, retry.
    """
    if transport_error:
        return Outcome("failure", True)
    if status is None:
        return Outcome("neutral", False)
    if status in _BACKPRESSURE and kind not in _FAULT_TYPES:
        return Outcome("neutral", True)
    if status == 408 or status >= 500:
        return Outcome("failure", True)
    return Outcome("success", False)


def error_kind(content: bytes) -> str | None:
    """The `type` of an OpenAI error body ({"error": {"type": ...}}), or None if `content` is
    not one."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


# Error types of a client's own mistake; an SSE error event of another type is the worker's.
_CLIENT_TYPES = frozenset({"invalid_request_error", "authentication_error", "not_found_error"})
_UNAVAILABLE_TYPES = frozenset({"service_unavailable", "server_overloaded", "engine_dead"})


def event_status(error: dict) -> int:
    """The HTTP status an SSE error event's body (`{"message", "type", "code", ...}`, sent after
    the stream's 200) stands for: its `code` when that is an integer status, else by `type`:
    a client error 400, draining / overload / a dead engine 503, anything else 500."""
    code, kind = error.get("code"), error.get("type")
    if type(code) is int and 400 <= code <= 599:
        return code
    if kind in _CLIENT_TYPES:
        return 400
    return 503 if kind in _UNAVAILABLE_TYPES else 500
