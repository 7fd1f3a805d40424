"""Stream migration on the worker: a choice resumed after output tokens another worker already delivered (docs/stream_migration.md)."""
from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams


def resumed_params(req: Any, params: SamplingParams, num_prompts: int) -> SamplingParams:
    """The SamplingParams that continue `req` (a completion or chat request with
    `resume_token_ids`) after its resumed tokens: max_tokens and min_tokens less their count.

    A resumed choice must come out as the same choice would have without the cut, so what
    cannot is refused (InvalidRequest, 400): several prompts or n > 1 (the ids are one
    choice's), echo and logprobs (the prompt and the offsets were sent before the cut),
    frequency and presence penalties (they count output tokens; resumed ones are prompt
    tokens to the engine), structured output (its grammar would start over), and a
    max_tokens the resumed tokens already reach."""
    num_resumed = len(req.resume_token_ids or ())
    why = None
    if num_prompts != 1 or params.n != 1:
        why = "one prompt and n = 1"
    elif getattr(req, "echo", False) or params.logprobs is not None:
        why = "no echo and no logprobs"
    elif params.frequency_penalty or params.presence_penalty:
        why = "no frequency or presence penalty"
    elif params.grammar is not None:
        why = "no structured output"
    elif params.max_tokens is not None and params.max_tokens <= num_resumed:
        why = "max_tokens larger than the number of resumed tokens"
    if why is not None:
        raise InvalidRequest(f"resume_token_ids needs {why}", param="resume_token_ids")
    max_tokens = None if params.max_tokens is None else params.max_tokens - num_resumed
    return dataclasses.replace(params, max_tokens=max_tokens,
                               min_tokens=max(params.min_tokens - num_resumed, 0))


def token_ids_field(req: Any, token_ids: list[int]) -> dict[str, list[int]]:
    """{"token_ids": ids} for a stream choice when the request set return_token_ids, else {}."""
    return {"token_ids": token_ids} if req.return_token_ids else {}
