"""The contract between the scheduler and the model runner: what one step computes (a list of ScheduledSeq, decodes first, then prefills) and returns (a list of SeqResult, same order).

Index map of one sequence in a step (P = page_size):

    positions   0 ............ start_pos ........ start_pos+len(input_ids)-1
    KV          [ already in the KV cache ][ written by this step      ]
    page_ids    page_ids[i] holds the KV of positions [i*P, (i+1)*P)

The runner writes the KV of `input_ids` into the slots given by `page_ids`, attends over
positions [0, start_pos + len(input_ids)), and, when `sample` is set, samples one token from
the logits of the last position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step."""

    request_id: str
    input_ids: list[int]          # tokens whose KV this step computes (a prefill chunk, or 1 for decode)
    start_pos: int                # position of input_ids[0] in the sequence
    page_ids: list[int]           # page table covering positions [0, start_pos + len(input_ids))
    sample: bool                  # sample a token from the last position's logits
    params: SamplingParams
    seed: int                     # request seed; the runner seeds step k with (seed, num_output_ids)
    prompt_ids: list[int]         # whole prompt (repetition penalty reads it)
    output_ids: list[int]         # tokens generated so far (penalties; len() is the sampling step)
    min_tokens_left: int          # > 0: eos and stop_token_ids are masked out of this sample
    # When set (== start_pos), return prompt logprobs for this chunk: one TokenLogprob for each
    # prompt position q in [start_pos + 1, min(start_pos + len(input_ids), len(prompt_ids) - 1)],
    # taken from the logits at position q - 1 (token id = prompt_ids[q], top-k with
    # k = params.prompt_logprobs). A chunk's last position thus scores the next chunk's first token.
    prompt_logprob_start: int | None
    # Speculative decoding: input_ids = [last token, *draft]; the runner verifies the draft
    # against the logits of all 1 + len(draft) positions (SeqResult.accepted).
    draft: tuple[int, ...] = ()
    # Model-draft speculation: after sampling, propose this many draft tokens to follow the new
    # token (SeqResult.next_draft); page_ids then also cover that many positions past it.
    propose: int = 0


@dataclass(frozen=True, slots=True)
class SeqResult:
    """What the runner returns for one ScheduledSeq."""

    request_id: str
    token: TokenLogprob | None                 # sampled token (None when sample=False)
    prompt_logprobs: list[TokenLogprob] | None  # see ScheduledSeq.prompt_logprob_start
    accepted: tuple[TokenLogprob, ...] = ()     # draft tokens accepted; emitted before `token`
    next_draft: tuple[int, ...] = ()            # ScheduledSeq.propose draft tokens after `token`


class Runner(Protocol):
    """What the engine needs from a model runner (the real one lives in radixserve.runner)."""

    num_pages: int          # KV capacity in pages
    page_size: int
    max_context_len: int    # positions the model supports
    vocab_size: int
    eos_token_ids: frozenset[int]

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        """One forward pass over the step's sequences; one result per sequence, same order."""
        ...

    def info(self) -> dict:
        """JSON-able facts for /get_server_info (device, attention backend, KV dtype, ...)."""
        ...

    def validate_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequest for what only the runner can judge (a JSON schema it cannot
        compile); runners without such checks do nothing."""
        ...

    def grammar_pending(self, params: SamplingParams) -> bool:
        """Whether validate_params(params) has slow work to do first (a grammar to compile;
        thread-safe, releasing the GIL); optional, runners without it are never pending."""
        ...
