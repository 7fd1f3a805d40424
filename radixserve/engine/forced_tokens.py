"""The `sampler.force_tokens` fault point: the next requests emit a given token-id sequence.

Armed through the worker's fault API (POST /admin/fault with kind "sampler.force_tokens",
--enable-fault-injection only), so that finish, accounting and output-parser cases (tool calls,
reasoning) run without the weights of the model whose output format they test:

    arm(token_ids, count)   the next `count` requests added to the engine (in add_request
                            order, every engine request counts: each of n choices, a
                            /health_generate probe) each get `token_ids`
    request k-th sample     replaced by token_ids[k] while k < len(token_ids); the model's own
                            samples resume after the last one (put an eos id last to end there)

A forced token goes through the same per-token finish checks as a sampled one (eos,
stop_token_ids, min_tokens, max_tokens), so a sequence longer than max_tokens is cut with
finish_reason "length" and one holding an eos id ends with "stop" there. Nothing changes for a
request that was not handed a sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.outputs import TokenLogprob


@dataclass(slots=True)
class ForcedTokens:
    """An armed force_tokens fault: `token_ids` for the next `num_left` requests, until `ends_s`
    (time.monotonic(); None: no end)."""

    token_ids: tuple[int, ...]
    num_left: int
    ends_s: float | None

    def take(self, now_s: float) -> tuple[int, ...] | None:
        """The sequence for one new request, or None once used up or expired (then spent)."""
        if self.ends_s is not None and now_s >= self.ends_s:
            self.num_left = 0
        if self.num_left <= 0:
            return None
        self.num_left -= 1
        return self.token_ids

    @property
    def is_spent(self) -> bool:
        return self.num_left <= 0


def forced_or_sampled(forced_ids: tuple[int, ...] | None, num_output_ids: int,
                      sampled: TokenLogprob) -> TokenLogprob:
    """The token a request emits at output position `num_output_ids`: forced_ids[that position]
    while the forced sequence lasts, else the runner's sample. A forced token's logprob is 0.0
    (it was chosen with certainty); its `top` list is the model's, as sampled."""
    if forced_ids is None or num_output_ids >= len(forced_ids):
        return sampled
    return TokenLogprob(forced_ids[num_output_ids], 0.0, sampled.top)
