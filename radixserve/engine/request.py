"""Request: one sequence's state inside the engine (tokens, progress, pages, finish reason).

    WAITING --admit--> RUNNING --finish/abort--> FINISHED
       |  ^--preempt------+      (KV freed; the computed prefix stays in the radix cache)
       v
    WAITING_FOR_KV --landed--> WAITING / RUNNING   (pages filled by a disk fetch or PD transfer)"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixserve.outputs import SpecCounts, TokenLogprob
from radixserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """Mutable per-request state, scheduler thread only.

    token ids:  [ prompt_ids ............... ][ output_ids ...... ]
    KV:         [ 0 ...... num_computed_tokens )   (the last sampled token has no KV yet)
    pages:      page_ids[:num_tree_pages] are the radix tree's (path locked via last_node),
                page_ids[num_tree_pages:] this request's private tail."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int                       # resolved: never None inside the engine
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prefix-cache hit at first admission
    queue_time_s: float | None = None
    page_ids: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: object | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    spec: SpecCounts | None = None
    # Tiers: loads it reads, host-hit tokens of its last match / first admission; skip_*: after a failure.
    loads: list = field(default_factory=list)
    num_host_hit_tokens: int = 0
    num_host_cached_tokens: int = 0
    skip_host_tier: bool = False
    fetch: object | None = None
    skip_disk: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(end - n, 0)]

    @property
    def is_admitted(self) -> bool:
        return self.queue_time_s is not None

    @property
    def is_prefilling(self) -> bool:
        """KV is missing for some known token other than the newest."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
