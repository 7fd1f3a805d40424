"""Errors radixserve raises at its boundaries, each mapped to an HTTP status and OpenAI error type."""
from __future__ import annotations


def error_body(message: str, type_: str, code: int | str, param: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}, as OpenAI."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RadixServeError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        return error_body(self.message, self.type, self.code or self.status, self.param)


class InvalidRequest(RadixServeError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt + max_tokens exceed the context or KV capacity (HTTP 400)."""

    code = "context_length_exceeded"


class BodyTooLarge(InvalidRequest):
    status = 413


class RequestTimeout(RadixServeError):
    """The body stalled past the read timeout (HTTP 408)."""

    status = 408
    type = "request_timeout"
    code = "request_timeout"


class Unauthorized(RadixServeError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(RadixServeError):
    status = 404
    type = "not_found_error"
    code = "model_not_found"


class Overloaded(RadixServeError):
    """Too many requests in flight (HTTP 503)."""

    status = 503
    type = "server_overloaded"


class EngineDead(RadixServeError):
    """The engine died or wedged (HTTP 503)."""

    status = 503
    type = "engine_dead"


class Draining(RadixServeError):
    """Not admitted while draining, or cut off after the grace period (HTTP 503, safe to retry)."""

    status = 503
    type = "service_unavailable"
    code = "draining"


# Every OutputAnomaly.kind: the text detectors (server/anomaly.py), the acceptance and confidence
# detectors, and a KV checksum mismatch. Metrics start a zero series for each.
OUTPUT_ANOMALY_KINDS = ("repetition", "garbled", "rare_chars", "spec_acceptance", "low_confidence", "kv_checksum")


class OutputAnomaly(RadixServeError):
    """The anomaly guard stopped a request (HTTP 500, so a router retries); `kind`: detector or "kv_checksum"."""

    type = "output_anomaly"
    code = "output_anomaly"

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    def to_dict(self) -> dict:
        """The OpenAI body plus error.anomaly_kind (the detector), which a router counts by."""
        body = super().to_dict()
        body["error"]["anomaly_kind"] = self.kind
        return body


class InjectedFault(RadixServeError):
    """The "fail" fault (HTTP 500)."""

    type = "injected_fault"
    code = "injected_fault"


class KVTransferFailed(RadixServeError):
    """PD prefill or KV transfer failed or timed out (HTTP 500, retryable before any byte)."""

    type = "kv_transfer_failed"
    code = "kv_transfer_failed"
