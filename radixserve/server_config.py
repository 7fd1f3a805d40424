"""ServerConfig: the HTTP-side settings of one worker, as frozen flags with their checks."""
from __future__ import annotations

import math
from dataclasses import dataclass

from radixserve.config import (BODY_TIMEOUT_HELP, GRACE_HELP, GRACEFUL_SHUTDOWN_TIMEOUT_S, READ_TIMEOUT_HELP,
                               REQUEST_BODY_TIMEOUT_S, REQUEST_READ_TIMEOUT_S, check_timeouts, opt)
from radixserve.parsers.chat_output import NATIVE_TOOL_FORMATS, REASONING_PARSERS, TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings of one worker."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(30000, "port to listen on")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1 routes")
    served_model_name: str | None = opt(None, "model id reported by /v1/models (default: file name)")
    log_level: str = opt("info", "logging level", ("debug", "info", "warning", "error"))
    max_queued_requests: int = opt(1024, "requests waiting beyond this get 503")
    max_request_body_bytes: int = opt(64 << 20, "largest /v1 request body in bytes; larger get 413 "
                                                 "before any of it is parsed")
    watchdog_timeout: float = opt(300.0, "seconds without a word from the engine, while work is "
                                         "pending, before it is declared wedged and killed")
    stay_up_on_engine_death: bool = opt(False, "keep serving 503s after the engine dies instead "
                                              "of exiting with code 1")
    enable_debug_endpoints: bool = opt(False, "serve GET /debug/pages (page pool and invariant check)")
    enable_fault_injection: bool = opt(False, "serve /admin/fault (inject latency, failures, hangs, "
                                              "leaks, corrupt output); for tests and demos only")
    disable_anomaly_guard: bool = opt(False, "do not judge whether output looks broken (repetition "
                                             "loops, garbled text, rare-char noise, speculative "
                                             "acceptance, confidence); KV checksums stay as set")
    anomaly_guard_action: str = opt(
        "report", "what the text heuristics (repetition, garbled, rare_chars) do on a detection: "
                  "report (count in /metrics and log) or abort (stop the request so a router "
                  "retries it); requests whose sampling the client constrained are only reported "
                  "(docs/anomaly_guard.md)", ("report", "abort"))
    speculative_anomaly_action: str = opt(
        "auto", "what the speculative acceptance detector does on a detection: auto = abort with a "
                "trained draft (--speculative-algorithm EAGLE / NEXTN), report with n-gram and "
                "self-drafts; report; abort", ("auto", "report", "abort"))
    speculative_anomaly_min_accept_length: float = opt(
        1.4, "acceptance detector: a request whose accept length (tokens per verify step, the "
             "bonus token counted) is below this ... (0: off)")
    speculative_anomaly_max_accept_rate: float = opt(
        0.96, "... or whose accept rate (accepted / proposed drafts) exceeds this ... (1: off)")
    speculative_anomaly_min_tokens: int = opt(128, "... once it has generated this many tokens ...")
    speculative_anomaly_min_verify_steps: int = opt(16, "... and verified drafts this many times "
                                                        "is an anomaly")
    enable_confidence_detector: bool = opt(
        False, "also stop greedy and low-temperature requests whose model confidence (largest raw "
               "logprob per token) collapses for a window of tokens, as after KV corruption "
               "(--confidence-*; docs/anomaly_guard.md)")
    confidence_window: int = opt(32, "confidence detector: tokens per judged window")
    confidence_min_mean_logprob: float = opt(
        -1.4, "confidence detector: a window whose mean top logprob is below this ...")
    confidence_min_drop: float = opt(
        0.6, "... and this far below the mean of the answer's first 16 tokens is an anomaly")
    confidence_max_temperature: float = opt(
        0.8, "confidence detector: requests sampled hotter than this are not judged")
    tool_call_parser: str | None = opt(None, "tool-call format of the model's output, parsed into "
                                             "OpenAI tool_calls (default: tools are refused)",
                                       tuple(TOOL_CALL_PARSERS))
    tool_call_constraint: str = opt(
        "json", "how tool_choice \"required\" or a named function is enforced while decoding: json "
                "(a JSON array of calls, as vLLM and SGLang do) or native (the --tool-call-parser's "
                "own format, thinking allowed first; qwen25, glm45, glm47, qwen3_coder)", ("json", "native"))
    reasoning_parser: str | None = opt(None, "split <think> text into reasoning_content "
                                             "(default: thinking stays in content)",
                                       REASONING_PARSERS)
    warmup_prompts: str | None = opt(
        None, "JSONL file of prompts (a string, {\"prompt\": ...} or {\"messages\": [...]} per "
              "line) prefilled into the prefix cache before /health turns 200 (docs/hicache.md)")
    graceful_shutdown_timeout: float = opt(GRACEFUL_SHUTDOWN_TIMEOUT_S, GRACE_HELP)
    request_body_timeout: float = opt(REQUEST_BODY_TIMEOUT_S, BODY_TIMEOUT_HELP)
    request_read_timeout: float = opt(REQUEST_READ_TIMEOUT_S, READ_TIMEOUT_HELP)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        check_timeouts(self.request_body_timeout, self.request_read_timeout)
        if not self.graceful_shutdown_timeout >= 0:
            raise ValueError("graceful_shutdown_timeout must be >= 0")
        self._check_guard()
        if self.tool_call_constraint == "native" and self.tool_call_parser not in NATIVE_TOOL_FORMATS:
            raise ValueError("--tool-call-constraint native needs --tool-call-parser "
                             + " | ".join(NATIVE_TOOL_FORMATS) + f", got {self.tool_call_parser}")

    def _check_guard(self) -> None:
        """The output detectors' thresholds: finite, and in the range their rule can use (ValueError)."""
        checks = {
            "--speculative-anomaly-min-accept-length (finite, >= 0)":
                math.isfinite(self.speculative_anomaly_min_accept_length)
                and self.speculative_anomaly_min_accept_length >= 0,
            "--speculative-anomaly-max-accept-rate (in (0, 1])":
                0 < self.speculative_anomaly_max_accept_rate <= 1,
            "--speculative-anomaly-min-tokens (>= 0)": self.speculative_anomaly_min_tokens >= 0,
            "--speculative-anomaly-min-verify-steps (>= 0)": self.speculative_anomaly_min_verify_steps >= 0,
            "--confidence-window (>= 1)": self.confidence_window >= 1,
            "--confidence-min-mean-logprob (finite, <= 0)":
                math.isfinite(self.confidence_min_mean_logprob) and self.confidence_min_mean_logprob <= 0,
            "--confidence-min-drop (finite)": math.isfinite(self.confidence_min_drop),
            "--confidence-max-temperature (finite, >= 0)":
                math.isfinite(self.confidence_max_temperature) and self.confidence_max_temperature >= 0,
        }
        bad = [flag for flag, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"out of range: {'; '.join(bad)}")
