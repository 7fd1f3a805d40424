"""Classify a worker's answer for the circuit breaker and the retry loop."""
from __future__ import annotations

import json
from typing import Literal, NamedTuple

BreakerOutcome = Literal["success", "failure", "neutral"]

_BACKPRESSURE = frozenset({429, 503})
_FAULT_TYPES = frozenset({"engine_dead"})


class Outcome(NamedTuple):
    """`breaker`: recorded on the worker's breaker; `retry`: another worker may be tried."""

    breaker: BreakerOutcome
    retry: bool


def classify(status: int | None, transport_error: bool, kind: str | None = None) -> Outcome:
    """`status` None: no response (client gone); `kind`: the error type. Retryable statuses:
    SGLang's `is_retryable_status`; 429/503 are backpressure (neutral) unless engine_dead."""
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
    """The `type` of an OpenAI error body, or None if `content` is not one."""
    error = error_of_body(content)
    kind = error.get("type") if error is not None else None
    return kind if isinstance(kind, str) else None


_CLIENT_TYPES = frozenset({"invalid_request_error", "authentication_error", "not_found_error"})
_UNAVAILABLE_TYPES = frozenset({"service_unavailable", "server_overloaded", "engine_dead"})


def event_status(error: dict) -> int:
    """The HTTP status an SSE error event stands for: its `code`, else by its `type`."""
    code, kind = error.get("code"), error.get("type")
    if type(code) is int and 400 <= code <= 599:
        return code
    if kind in _CLIENT_TYPES:
        return 400
    return 503 if kind in _UNAVAILABLE_TYPES else 500


ANOMALY_TYPE = "output_anomaly"


def anomaly_kind(error: dict | None) -> str | None:
    """The detector behind an output_anomaly error (its `anomaly_kind`, else "unknown"); None for
    any other error: the worker judged its own output suspect, so no token of it may be reused."""
    if not isinstance(error, dict) or error.get("type") != ANOMALY_TYPE:
        return None
    kind = error.get("anomaly_kind")
    return kind if isinstance(kind, str) and kind else "unknown"


def error_of_body(content: bytes) -> dict | None:
    """The `error` object of an OpenAI error body, or None."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None
