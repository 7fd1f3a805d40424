"""Classify a worker's answer for the circuit breaker and the retry loop (routers.md §5.2)."""
from __future__ import annotations

from typing import Literal, NamedTuple

BreakerOutcome = Literal["success", "failure", "neutral"]

# Backpressure: the worker is alive but full. Retry elsewhere; never count it against the
# worker (SGLang #39464: counting 503/429 shed a saturated worker for the whole cool-down).
_BACKPRESSURE = frozenset({429, 503})


class Outcome(NamedTuple):
    """What one attempt means: `breaker` is recorded on the worker's breaker; `retry` says
    whether another worker may be tried."""

    breaker: BreakerOutcome
    retry: bool


def classify(status: int | None, transport_error: bool) -> Outcome:
    """Map an HTTP status (None when no response arrived) and a transport fault to an Outcome.

    Rules (routers.md §5.2, SGLang router #25811/#25822/#39464, retryable set from SGLang
    `is_retryable_status`):
    - transport error or timeout (also a stream that broke after a 200): failure, retry;
    - no status and no transport error (the client went away): neutral, no retry;
    - 1xx/2xx/3xx: success;
    - 408: failure, retry; 429 and 503: neutral (backpressure), retry;
    - any other 4xx (400, 401, 403, 404, 413, 422, ...): the client's fault, so success for
      the breaker and never retried;
    - any other 5xx (500, 502, 504, ...): failure, retry.
    """
    if transport_error:
        return Outcome("failure", True)
    if status is None:
        return Outcome("neutral", False)
    if status in _BACKPRESSURE:
        return Outcome("neutral", True)
    if status == 408 or status >= 500:
        return Outcome("failure", True)
    return Outcome("success", False)
