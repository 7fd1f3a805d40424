"""Scheduler -> runner step contract: ScheduledSeq list in (decodes first, then prefills), one SeqResult each out.

    positions  0 .......... start_pos .......... start_pos + len(input_ids) - 1
    KV         [ already cached ][ written by this step (input_ids)          ]
    page_ids   page_ids[i] holds positions [i*P, (i+1)*P), P = page_size
The runner attends over [0, start_pos + len(input_ids)) and, if `sample`, samples from the last position."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    request_id: str
    input_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool
    params: SamplingParams
    seed: int                     # request seed; the runner seeds step k with (seed, num_output_ids)
    prompt_ids: list[int]
    output_ids: list[int]
    min_tokens_left: int          # > 0: eos and stop_token_ids are masked out
    # Set (== start_pos): prompt logprobs of q in [start_pos + 1, min(start_pos + len(input_ids),
    # len(prompt_ids) - 1)], each from the logits at q - 1 (top-k, k = params.prompt_logprobs).
    prompt_logprob_start: int | None
    # input_ids = [last token, *draft]; verified against all 1 + len(draft) positions' logits
    draft: tuple[int, ...] = ()
    # draft tokens to propose after the sampled one (SeqResult.next_draft); page_ids cover them
    propose: int = 0


@dataclass(frozen=True, slots=True)
class SeqResult:
    request_id: str
    token_ids: tuple[int, ...]                      # accepted drafts, then the sampled token; () if none sampled
    logprobs: tuple[TokenLogprob, ...] | None       # one per token id, only when the request wants logprobs
    prompt_logprobs: list[TokenLogprob] | None
    next_draft: tuple[int, ...] = ()


class Runner(Protocol):
    num_pages: int
    page_size: int
    max_context_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        ...

    def info(self) -> dict:
        ...

    def validate_params(self, params: SamplingParams) -> None:
        """Raises InvalidRequest for what only the runner can judge (a schema it cannot compile)."""
        ...

    def grammar_pending(self, params: SamplingParams) -> bool:
        """Optional: validate_params(params) must compile a grammar first (thread-safe, frees the GIL)."""
        ...
