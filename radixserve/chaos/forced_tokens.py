"""The `sampler.force_tokens` fault: the next `count` engine requests emit `token_ids`, then sample on (docs/tool_calls.md)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.errors import InvalidRequest
from radixserve.outputs import TokenLogprob


@dataclass(slots=True)
class ForcedTokens:
    """`token_ids` for the next `num_left` requests, until `ends_s` (time.monotonic(); None: no end)."""

    token_ids: tuple[int, ...]
    num_left: int
    ends_s: float | None

    @classmethod
    def armed(cls, token_ids: list[int], count: int, duration_s: float | None,
              vocab_size: int) -> ForcedTokens:
        """Raises InvalidRequest for an empty list, an id outside [0, vocab_size), or count < 1."""
        if not token_ids:
            raise InvalidRequest("token_ids must not be empty", param="token_ids")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is out of range [0, {vocab_size})",
                                 param="token_ids")
        if count < 1:
            raise InvalidRequest(f"count must be >= 1, got {count}", param="count")
        ends_s = None if duration_s is None else time.monotonic() + duration_s
        return cls(tuple(token_ids), count, ends_s)

    def take(self, now_s: float) -> tuple[int, ...] | None:
        if self.ends_s is not None and now_s >= self.ends_s:
            self.num_left = 0
        if self.num_left <= 0:
            return None
        self.num_left -= 1
        return self.token_ids

    @property
    def is_spent(self) -> bool:
        return self.num_left <= 0


def force_run(forced_ids: tuple[int, ...] | None, num_output_ids: int, sampled: Sequence[int],
              logprobs: Sequence[TokenLogprob] | None = None
              ) -> tuple[list[int], list[TokenLogprob] | None]:
    """Step samples from output position `num_output_ids` (`logprobs`: one per sample, or None), forced_ids[position]
    put in (logprob 0.0, the model's `top`), cut after the first replaced -> (ids, logprobs or None)."""
    ids: list[int] = []
    lps: list[TokenLogprob] | None = None if logprobs is None else []
    for k, token in enumerate(sampled):
        position = num_output_ids + k
        lp = logprobs[k] if logprobs is not None else None
        forced = forced_ids is not None and position < len(forced_ids)
        ids.append(forced_ids[position] if forced else token)
        if lps is not None:
            lps.append(TokenLogprob(ids[-1], 0.0, lp.top, lp.top_logprob) if forced else lp)
        if forced and ids[-1] != token:
            break
    return ids, lps
