"""Request: one sequence's state inside the engine (tokens, progress, pages, finish reason).

Lifecycle:

    WAITING --admit--> RUNNING --finish/abort--> FINISHED
       |  ^               |
       |  +---preempt-----+   (KV released; computed prefix stays in the radix cache)
       v
    WAITING_FOR_KV --KV landed--> WAITING (admitted at once) / RUNNING
                   --load failed or abort--> pages released, recompute or FINISHED

WAITING_FOR_KV: the request's pages are being filled by someone other than the forward pass
(a host/disk-tier load, or a prefill->decode KV transfer); the scheduler never reads them
until the filler says they landed (docs/architecture.md).
"""
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
    """Mutable per-request state owned by the scheduler thread.

    token ids:   [ prompt_ids .................. ][ output_ids ...... ]
    KV:          [ 0 ......... num_computed_tokens )   (the last sampled token has no KV yet)
    pages:       page_ids[:num_tree_pages] belong to the radix tree (locked via `last_node`),
                 page_ids[num_tree_pages:] are this request's private tail.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int                       # resolved: never None inside the engine
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prefix-cache hit at first admission (0 before it)
    queue_time_s: float | None = None     # arrival to first admission (seconds); None = not yet admitted
    page_ids: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: object | None = None       # radix node locked for page_ids[:num_tree_pages]
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    spec: SpecCounts | None = None        # speculative decoding so far (None: never verified)
    # Host KV tier (engine/hicache.py): loads this request's pages wait on, tokens its last
    # match loaded from host, tokens of its first admission's hit that came from host, and
    # whether to skip host hits (after a failed load: recompute, never a hit).
    loads: list = field(default_factory=list)
    num_host_hit_tokens: int = 0
    num_host_cached_tokens: int = 0
    skip_host_tier: bool = False
    fetch: object | None = None           # disk fetch it waits on in WAITING_FOR_KV (hicache_disk.py)
    skip_disk: bool = False               # one disk fetch per request: it has had its own

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) without copying the whole sequence (hot path: decode)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(end - n, 0)]

    @property
    def is_admitted(self) -> bool:
        """True once the scheduler has admitted the request (it stays True after a preemption)."""
        return self.queue_time_s is not None

    @property
    def is_prefilling(self) -> bool:
        """True while the KV of some known token other than the newest is missing."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
