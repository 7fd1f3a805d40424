"""Benchmark workload types (requests, sessions), exact-length text from a tokenizer, arrival schedules, ideal prefix reuse."""
from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request as `prompt` (completions) and `messages` (chat); `output_len` is max_tokens."""

    prompt: str
    messages: tuple[dict[str, str], ...]
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class Session:
    """Requests one client sends in order; `arrival_s` offset from the run start, None: --request-rate."""

    requests: tuple[BenchRequest, ...]
    arrival_s: float | None = None


@dataclass(slots=True)
class Workload:
    """A dataset ready to send; `info` goes into the output JSON (`theory_reuse`: ideal hit rate)."""

    name: str
    sessions: list[Session]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> list[BenchRequest]:
        """All requests, round by round across sessions."""
        depth = max((len(s.requests) for s in self.sessions), default=0)
        return [s.requests[k] for k in range(depth) for s in self.sessions if k < len(s.requests)]


_WORD = re.compile(r"^ [A-Za-z]{2,12}$")


class WordSource:
    """`text(n)` encodes to exactly n tokens: random words that are one vocabulary token each (" word")
    and that the pre-tokenizer keeps apart (decoded random ids, SGLang's way, drift when re-encoded)."""

    def __init__(self, tokenizer: Any, max_words: int = 4000):
        self.tokenizer = tokenizer
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        candidates = sorted({p for p in pieces if _WORD.match(p)})[: max_words * 2]
        encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"]
        self.words = [p for p, ids in zip(candidates, encoded) if len(ids) == 1][:max_words]
        if len(self.words) < 100:
            raise ValueError(f"tokenizer has only {len(self.words)} single-token words")

    def text(self, rng: random.Random, num_tokens: int) -> str:
        return "".join(rng.choices(self.words, k=num_tokens))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


ROLE_MARK = {"system": "", "user": "\n\nUser:", "assistant": "\n\nAssistant:", "tool": "\n\nTool:"}


def render(messages: Sequence[dict[str, str]]) -> str:
    """Plain text with role markers, ending in the assistant marker; a longer conversation extends a shorter one's."""
    return "".join(ROLE_MARK[m["role"]] + m["content"] for m in messages) + ROLE_MARK["assistant"]


def make_request(messages: list[dict[str, str]], output_len: int, source: WordSource) -> BenchRequest:
    prompt = render(messages)
    return BenchRequest(prompt, tuple(dict(m) for m in messages), source.count(prompt), output_len)


def poisson_offsets(num: int, request_rate: float, rng: np.random.Generator) -> list[float]:
    """Poisson arrival offsets (s), first gap included, as SGLang draws them; rate inf -> all at 0."""
    if num == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / request_rate, size=num))]


def schedule(workload: Workload, request_rate: float, seed: int) -> list[float]:
    """Each session's start offset (s): its own `arrival_s` (trace replay) or a Poisson draw."""
    drawn = iter(poisson_offsets(sum(s.arrival_s is None for s in workload.sessions), request_rate,
                                 np.random.default_rng(seed)))
    return [s.arrival_s if s.arrival_s is not None else next(drawn) for s in workload.sessions]


def reuse_ratio(prompts: Sequence[Sequence[int]], page_size: int = 1) -> float:
    """No-eviction hit rate: sum of longest earlier-shared prefixes (page-aligned down, <= len - 1) / sum of lengths."""
    root: dict[int, dict] = {}
    hit = total = 0
    for ids in prompts:
        node, depth = root, 0
        while depth < len(ids) and ids[depth] in node:
            node = node[ids[depth]]
            depth += 1
        matched = min(depth, len(ids) - 1) if ids else 0
        hit += matched // page_size * page_size
        total += len(ids)
        for tok in ids[depth:]:
            node = node.setdefault(tok, {})
    return hit / total if total else 0.0


def range_lengths(rng: random.Random, length: int, range_ratio: float, num: int) -> list[int]:
    """SGLang's --random-range-ratio: uniform in [max(int(L*r), 1), L] (vLLM's: [L(1-r), L(1+r)])."""
    low = max(int(length * range_ratio), 1)
    return [rng.randint(low, max(low, length)) for _ in range(num)]
