"""SamplingParams: how one request samples and when it stops, validated once at the boundary."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixserve.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
MAX_N = 128                 # choices of one request
MAX_LOGIT_BIAS = 1024       # logit_bias entries per request
MAX_JSON_SCHEMA_CHARS = 64 << 10
# Temperatures below this are clamped to 0, greedy (vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
# The smallest normal float32: dividing logits by a smaller penalty overflows.
MIN_REPETITION_PENALTY = 1.1754943508222875e-38


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping settings (OpenAI / vLLM meanings). temperature < MIN_TEMPERATURE
    is greedy; top_k <= 0, top_p 1, min_p 0 disable filters; max_tokens None: up to the context.
    logprobs=k: the chosen token's plus the top k, from the raw logits' log-softmax (before penalties
    and filters). seed fixes the draws; bit-identical logits need --enable-deterministic-inference."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)   # (token id, bias)
    json_schema: str | None = None   # the output must match this JSON schema (text)
    structural_tag: str | None = None   # ... or this xgrammar structural tag (JSON text)
    json_schema_param: str = "response_format"   # the request field named in errors
    guard_confidence: bool = False   # server-set: the confidence detector reads top_logprob

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias or ()))

    def check_n(self) -> None:
        """Raise InvalidRequest unless n is an integer in [1, MAX_N]; checked where choices fan out."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", param="n")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.guard_confidence

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.logit_bias))

    @property
    def client_constrained(self) -> bool:
        """The client steered which tokens are sampled (logit_bias, penalties, a grammar, min_tokens'
        stop-token ban): odd output is then what it asked for, never an anomaly to act on."""
        return self.adjusts_logits or self.grammar is not None or self.min_tokens > 0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """("json_schema" | "structural_tag", text) the output must match; None when free."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return None

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field's range but n (check_n); raises InvalidRequest naming the field."""
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param} {why}", param=param)

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            finite(name, getattr(self, name))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", f"must be a non-negative integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty",
                      f"must be at least {MIN_REPETITION_PENALTY:.4g}, got {self.repetition_penalty:.4g}: "
                      "float32 logits cannot represent a smaller penalty (rejected, not clamped)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", f"allows at most 16 strings, got {len(self.stop)}")
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise bad("stop_token_ids", f"contains an invalid token id {tid!r}")
        for grammar in (self.json_schema, self.structural_tag):
            if grammar is not None and (not isinstance(grammar, str) or len(grammar) > MAX_JSON_SCHEMA_CHARS):
                size = f"{len(grammar)} characters" if isinstance(grammar, str) else "not text"
                raise bad(self.json_schema_param, f"make a grammar (JSON schema or tool-call tags) of "
                          f"{size}; at most {MAX_JSON_SCHEMA_CHARS} are allowed")
        if self.json_schema is not None and self.structural_tag is not None:
            raise bad(self.json_schema_param, "a request has one grammar: a JSON schema or a structural tag")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"allows at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tid, bias in self.logit_bias:
            if not isinstance(tid, int) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise bad("logit_bias", f"has an invalid token id {tid!r}")
            finite("logit_bias", bias)
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tid}")
