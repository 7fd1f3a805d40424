"""RouterConfig: every router threshold as a flag; defaults from SGLang's router unless the help says why."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import (BODY_TIMEOUT_HELP, GRACE_HELP, GRACEFUL_SHUTDOWN_TIMEOUT_S, READ_TIMEOUT_HELP,
                               REQUEST_BODY_TIMEOUT_S, REQUEST_READ_TIMEOUT_S, check_timeouts, opt)

POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "session")


@dataclass(frozen=True)
class RouterConfig:
    """Settings of `radixserve route` (worker URLs are separate flags)."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(30080, "port to listen on")
    policy: str = opt("cache_aware", "how a worker is chosen for each request", POLICIES)
    log_level: str = opt("info", "logging level", ("debug", "info", "warning", "error"))
    graceful_shutdown_timeout: float = opt(GRACEFUL_SHUTDOWN_TIMEOUT_S, GRACE_HELP + " (fleet: "
                                           "the workers get it too)")
    cache_threshold: float = opt(0.3, "prefix match ratio above which the longest-match worker "
                                      "wins; below it the least-loaded worker does (SGLang: 0.3)")
    balance_abs_threshold: float = opt(16.0, "dead-band, absolute: a chosen worker whose load "
                                             "exceeds the fleet mean by more than this (and by "
                                             "the relative factor) spills to a less-loaded one "
                                             "(SGLang: 64; ours is smaller because one CPU/GPU "
                                             "worker runs at most --max-running-requests)")
    balance_rel_threshold: float = opt(1.5, "dead-band, relative: load > this x fleet mean "
                                            "(SGLang: 1.5)")
    max_tree_size: int = opt(1 << 22, "most keys (tokens, or characters without a tokenizer) "
                                      "the approximate prefix trees hold in all; LRU leaves "
                                      "are evicted past it")
    tree_ttl_s: float = opt(300.0, "tree entries not used for this long are dropped")
    tokenizer_path: str | None = opt(None, "tokenizer (HF folder or .gguf) to key the prefix "
                                           "trees by token ids, tokenized in a thread off the "
                                           "event loop; default: by characters")
    session_header: str = opt("x-session-id", "header the session policy hashes (falls back "
                                              "to the body's `user` field)")
    load_poll_interval_s: float = opt(1.0, "how often each worker's queue and KV usage are read")
    load_stale_s: float = opt(5.0, "a load reading older than this counts the worker as busy")
    load_smoothing: float = opt(0.5, "EMA weight of the newest load reading (alpha = 2/(N+1) "
                                     "for an N-reading window)")
    retry_max_attempts: int = opt(5, "attempts per request, the first included (SGLang: 5)")
    retry_initial_backoff_ms: float = opt(50.0, "backoff before the first retry")
    retry_backoff_multiplier: float = opt(1.5, "backoff growth per retry")
    retry_max_backoff_ms: float = opt(5000.0, "backoff cap (SGLang: 30000; a TTFT SLO of "
                                              "seconds cannot wait 30 s)")
    retry_jitter: float = opt(0.2, "backoff is multiplied by 1 + U[-j, +j]")
    disable_retries: bool = opt(False, "one attempt per request")
    disable_stream_migration: bool = opt(False, "end a stream whose worker fails after its first "
                                                "content with an error event instead of "
                                                "continuing it on another worker "
                                                "(docs/stream_migration.md)")
    cb_failure_threshold: int = opt(5, "consecutive faults that open a worker's breaker "
                                       "(SGLang CLI: 10, struct: 5)")
    cb_success_threshold: int = opt(2, "consecutive half-open successes that close it")
    cb_timeout_s: float = opt(30.0, "seconds open before a half-open probe")
    disable_circuit_breaker: bool = opt(False, "never open breakers")
    health_check_interval_s: float = opt(5.0, "seconds between active health checks "
                                              "(SGLang: 60; Dynamo: 10)")
    health_check_timeout_s: float = opt(5.0, "timeout of one health check")
    health_check_endpoint: str = opt("/health", "worker path probed by health checks")
    health_failure_threshold: int = opt(3, "consecutive failed checks that mark a worker unhealthy")
    health_success_threshold: int = opt(2, "consecutive passed checks that mark it healthy again")
    connect_timeout_s: float = opt(5.0, "timeout to connect to a worker")
    silence_timeout_s: float = opt(300.0, "a worker silent this long mid-request is a fault")
    request_body_timeout: float = opt(REQUEST_BODY_TIMEOUT_S, BODY_TIMEOUT_HELP + " (fleet: the "
                                      "workers get it too)")
    request_read_timeout: float = opt(REQUEST_READ_TIMEOUT_S, READ_TIMEOUT_HELP + " (fleet: the workers get it too)")
    max_request_body_bytes: int = opt(64 << 20, "largest /v1 request body in bytes; larger get 413 "
                                                 "before the rest is read")
    admin_api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /admin routes; "
                                          "unset: admin routes are open (a warning is logged)")
    worker_api_key: str | None = opt(None, "key sent to workers on the router's own health "
                                           "checks and load polls only (client requests carry "
                                           "their own header through)")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if not 0.0 < self.load_smoothing <= 1.0:
            raise ValueError("load_smoothing must be in (0, 1]")
        if self.retry_max_attempts < 1:
            raise ValueError("retry_max_attempts must be >= 1")
        if self.cb_failure_threshold < 1 or self.cb_success_threshold < 1:
            raise ValueError("circuit breaker thresholds must be >= 1")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be >= 1")
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError("graceful_shutdown_timeout must be >= 0")
        check_timeouts(self.request_body_timeout, self.request_read_timeout)
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
