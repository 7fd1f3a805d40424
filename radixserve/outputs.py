"""Typed results the engine and the offline API hand out."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Natural-log probability under the raw model distribution (before penalties and warpers);
    `top`: the k most likely (token_id, logprob), best first; `top_logprob`: the best's (NaN: unknown)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    top_logprob: float = math.nan


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """One request's speculative decoding so far (steps that drafted nothing are not counted)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens a verify step emits, the bonus token counted: (accepted + steps) / steps, in [1, 1 + K]; 0.0 before
        the first. SGLang's per-request spec_accept_length (completion tokens / verify steps) where every decode step
        verifies, less its 1 / steps for the token sampled at prefill."""
        v = self.verify_steps
        return (self.accepted_tokens + v) / v if v else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted drafts / proposed drafts, in [0, 1] (SGLang's spec_accept_rate); 0.0 before any."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def usage_fields(self) -> dict[str, int | float]:
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_length": round(self.accept_length, 4),
                "spec_accept_rate": round(self.accept_rate, 4)}

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.verify_steps + other.verify_steps,
                          self.draft_tokens + other.draft_tokens,
                          self.accepted_tokens + other.accepted_tokens)

    def __sub__(self, earlier: SpecCounts) -> SpecCounts:
        return SpecCounts(self.verify_steps - earlier.verify_steps,
                          self.draft_tokens - earlier.draft_tokens,
                          self.accepted_tokens - earlier.accepted_tokens)


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """One step's news about one request; `prompt_logprobs` comes once (entry 0: prompt position 1)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_code: str | None = None           # "kv_transfer_failed" or KV_CHECKSUM_ERROR (HTTP 500)
    queue_time_s: float | None = None       # arrival to first admission
    spec: SpecCounts | None = None          # None: never verified
    num_cached_tokens_host: int | None = None   # of num_cached_tokens, from the host tier (None: off)


KV_CHECKSUM_ERROR = "kv_checksum_mismatch"


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = True
    spec: SpecCounts | None = None
    num_cached_tokens_host: int | None = None
