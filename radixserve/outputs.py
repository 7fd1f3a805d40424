"""Typed results the engine and the offline API hand out."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's natural-log probability under the raw model distribution (log-softmax of
    the logits, before penalties and warpers), with the k most likely (token_id, logprob),
    most likely first, and `top_logprob`, the most likely token's logprob (the model's
    confidence at this position, which the output-anomaly guard's confidence detector reads;
    NaN where not computed). The sampler makes them; the engine, server and offline API pass
    them on."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    top_logprob: float = math.nan


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """One request's speculative decoding so far (cumulative): verify steps, draft tokens
    proposed and draft tokens accepted. Steps in which the request drafted nothing are ordinary
    decode steps and are not counted."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step: (accepted + verify steps) / verify steps, in
        [1, 1 + K]; 0.0 before the first verify step (SGLang's `spec_accept_length`)."""
        v = self.verify_steps
        return (self.accepted_tokens + v) / v if v else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed draft tokens, in [0, 1]; 0.0 before the first draft."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def usage_fields(self) -> dict[str, int | float]:
        """The extra fields of an OpenAI `usage` object (SGLang reports them in meta_info)."""
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_length": round(self.accept_length, 4),
                "spec_accept_rate": round(self.accept_rate, 4)}

    def __add__(self, other: SpecCounts) -> SpecCounts:
        """Counts of two requests (or choices) together."""
        return SpecCounts(self.verify_steps + other.verify_steps,
                          self.draft_tokens + other.draft_tokens,
                          self.accepted_tokens + other.accepted_tokens)

    def __sub__(self, earlier: SpecCounts) -> SpecCounts:
        """The counts between `earlier` and these (a window)."""
        return SpecCounts(self.verify_steps - earlier.verify_steps,
                          self.draft_tokens - earlier.draft_tokens,
                          self.accepted_tokens - earlier.accepted_tokens)


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """One step's news about one request: the tokens it gained and whether it finished.

    Sent by Engine.step() and over ZMQ to the server. `prompt_logprobs` arrives once, in the
    first output after the prompt is fully computed (first entry is for prompt position 1).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_token_id: int | None = None        # the eos / stop token that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None                # set when finish_reason == "abort" for a reason
    error_code: str | None = None           # "kv_transfer_failed": a PD failure; KV_CHECKSUM_ERROR (both HTTP 500)
    queue_time_s: float | None = None       # arrival to first admission; None while still waiting
    spec: SpecCounts | None = None          # speculative decoding so far; None: never verified
    num_cached_tokens_host: int | None = None   # of num_cached_tokens: loaded from the host tier (None: tier off)


KV_CHECKSUM_ERROR = "kv_checksum_mismatch"   # error_code: KV overwritten after it was computed (engine/kv_checksum.py)


@dataclass(slots=True)
class CompletionOutput:
    """One of the n choices of a finished request (offline API)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """Result of one prompt in `LLM.generate` / `LLM.chat`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = True
    spec: SpecCounts | None = None      # speculative decoding over all choices; None: none ran
    num_cached_tokens_host: int | None = None   # of num_cached_tokens: from the host tier (None: off)
