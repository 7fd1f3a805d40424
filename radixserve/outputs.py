"""Typed results the engine and the offline API hand out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's natural-log probability under the raw model distribution (log-softmax of
    the logits, before penalties and warpers), with the k most likely (token_id, logprob),
    most likely first. The sampler makes them; the engine, server and offline API pass them on."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


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
    queue_time_s: float | None = None       # arrival to first admission; None while still waiting
    spec_verify_steps: int = 0              # speculative decoding so far: verify steps ...
    spec_accepted_tokens: int = 0           # ... and the draft tokens they accepted


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
