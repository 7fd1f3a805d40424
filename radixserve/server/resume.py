"""Stream migration on the worker: a choice resumed after output tokens another worker already delivered (docs/stream_migration.md)."""
from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.errors import InvalidRequest
from radixserve.sampling_params import SamplingParams


def resumed_params(req: Any, params: SamplingParams, num_prompts: int) -> SamplingParams:
    """`params` continuing `req` after its `resume_token_ids`: max_tokens and min_tokens less their count.
    Raises InvalidRequest (400) for what would not reproduce the uncut choice: several prompts or
    n > 1, echo, logprobs, frequency/presence penalties, a grammar, max_tokens already reached."""
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

