"""The `sampler.force_tokens` fault point: the next requests emit a given token-id sequence.

Armed through the worker's fault API (POST /admin/fault with kind "sampler.force_tokens",
--enable-fault-injection only), so that finish, accounting and output-parser cases (tool calls,
reasoning) run without the weights of the model whose output format they test:

    arm(token_ids, count)   the next `count` requests added to the engine (in add_request
                            order, every engine request counts: each of n choices, a
                            /health_generate probe) each get `token_ids`
    request k-th sample     replaced by token_ids[k] while k < len(token_ids); the model's own
                            samples resume after the last one (put an eos id last to end there)
    speculative run         cut after its first replaced token (later samples were conditioned
                            on the replaced one), whose draft KV is not kept

A forced token goes through the same per-token finish checks as a sampled one (eos,
stop_token_ids, min_tokens, max_tokens), so a sequence longer than max_tokens is cut with
finish_reason "length" and one holding an eos id ends with "stop" there. Nothing changes for a
request that was not handed a sequence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from radixserve.errors import InvalidRequest
from radixserve.outputs import TokenLogprob


@dataclass(slots=True)
class ForcedTokens:
    """An armed force_tokens fault: `token_ids` for the next `num_left` requests, until `ends_s`
    (time.monotonic(); None: no end)."""

    token_ids: tuple[int, ...]
    num_left: int
    ends_s: float | None

    @classmethod
    def armed(cls, token_ids: list[int], count: int, duration_s: float | None,
              vocab_size: int) -> ForcedTokens:
        """A new fault from the fault API's parameters. Raises InvalidRequest for an empty
        list, an id outside [0, vocab_size), or count < 1."""
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


def force_run(forced_ids: tuple[int, ...] | None, num_output_ids: int,
              sampled: list[TokenLogprob]) -> tuple[list[TokenLogprob], int]:
    """The tokens a request emits for one step's samples (one token, or a verified speculative
    run starting at output position `num_output_ids`): each is forced_ids[its position] while
    the forced sequence lasts, else the sample. A run is cut after the first token that differs
    from its sample, since the samples after it were conditioned on the sample. Returns the
    tokens and how many leading ones are their samples unchanged (the KV a verify step computed
    for those positions is valid). A forced token's logprob is 0.0 (it was chosen with
    certainty); its `top` list and `top_logprob` are the model's."""
    out: list[TokenLogprob] = []
    for k, token in enumerate(sampled):
        position = num_output_ids + k
        if forced_ids is None or position >= len(forced_ids):
            out.append(token)
            continue
        out.append(TokenLogprob(forced_ids[position], 0.0, token.top, token.top_logprob))
        if forced_ids[position] != token.token_id:
            return out, k
    return out, len(out)
