"""Errors radixserve raises at its boundaries, each mapped to an HTTP status and OpenAI error type."""
from __future__ import annotations


def error_body(message: str, type_: str, code: int | str, param: str | None = None) -> dict:
    """OpenAI-style error body: {"error": {"message", "type", "param", "code"}} (worker,
    router and agent all answer errors with it)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RadixServeError(Exception):
    """Base class. `status` is the HTTP status code, `type` the OpenAI error type."""

    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        """This error as an OpenAI-style body (see error_body)."""
        return error_body(self.message, self.type, self.code or self.status, self.param)


class InvalidRequest(RadixServeError):
    """The request is malformed or a value is out of range (HTTP 400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt tokens + max_tokens exceed the model's context or the KV capacity (HTTP 400)."""

    code = "context_length_exceeded"


class BodyTooLarge(InvalidRequest):
    """The request body exceeds the server's size limit (HTTP 413)."""

    status = 413


class RequestTimeout(RadixServeError):
    """The request body stalled past the read timeout (HTTP 408)."""

    status = 408
    type = "request_timeout"
    code = "request_timeout"


class Unauthorized(RadixServeError):
    """Missing or wrong API key (HTTP 401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(RadixServeError):
    """The `model` field names a model this server does not serve (HTTP 404)."""

    status = 404
    type = "not_found_error"
    code = "model_not_found"


class Overloaded(RadixServeError):
    """The request queue is full (HTTP 503)."""

    status = 503
    type = "server_overloaded"


class EngineDead(RadixServeError):
    """The engine process has died or wedged; the worker cannot serve (HTTP 503)."""

    status = 503
    type = "engine_dead"


class Draining(RadixServeError):
    """The server is draining (SIGTERM, or an operator's /admin/drain): it admits no new request,
    and one still running when its grace period ran out is cut off (HTTP 503; safe to retry
    elsewhere)."""

    status = 503
    type = "service_unavailable"
    code = "draining"


class OutputAnomaly(RadixServeError):
    """The output-anomaly guard stopped a request whose text went wrong (HTTP 500, so a router
    retries it elsewhere). `kind`: the detector ("repetition", "garbled", "rare_chars",
    "spec_acceptance", "low_confidence") or "kv_checksum" (the engine found its KV overwritten)."""

    type = "output_anomaly"
    code = "output_anomaly"

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class InjectedFault(RadixServeError):
    """A request failed on purpose by the "fail" fault (--enable-fault-injection; HTTP 500)."""

    type = "injected_fault"
    code = "injected_fault"


class KVTransferFailed(RadixServeError):
    """Prefill/decode disaggregation: the request's prefill or its KV transfer failed or timed
    out (HTTP 500, so a router may retry it on another pair before any byte is streamed; never
    a 200 with text: field case C24)."""

    type = "kv_transfer_failed"
    code = "kv_transfer_failed"
