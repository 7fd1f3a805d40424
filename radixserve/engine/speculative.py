"""N-gram speculation (prompt lookup): draft tokens copied from earlier in the request's own prompt and output.

Coding-agent and editing traffic copies long spans from its context; when the last few tokens
occurred before, the tokens that followed them then are a good guess for what follows now.
Per request, an index maps every n-gram (n = MIN_MATCH..MAX_MATCH) of the sequence to the position
after its latest earlier occurrence; proposing looks up the longest suffix n-gram that occurred
before and copies k tokens from there (continuing periodically when the match is closer than
k tokens to the end: a loop repeats). The index grows by MAX_MATCH entries per new
token, so a proposal costs O(MAX_MATCH + k) whatever the context length. (Prompt lookup
decoding: Saxena 2023; SGLang's `--speculative-algorithm NGRAM` adds a shared trie.)

Adaptive k: each request keeps an exponential moving average of the drafts it got accepted per
verify step; the next draft is `clamp(round(avg) + 1, 1, max_draft)` tokens, so requests whose
drafts keep failing cost at most one extra position per step, and requests that copy get the
full `max_draft`. Drafting stops for a request while its average is below MIN_USEFUL.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_MATCH = 3        # longest suffix n-gram looked up
MIN_MATCH = 3        # shortest: shorter matches (", and", "the") draft badly in prose
EMA = 0.3            # weight of the latest verify step in the acceptance average
MIN_USEFUL = 0.15    # below this average accepted drafts per step, stop drafting ...
RETRY_EVERY = 16     # ... except one probe every this many steps


@dataclass(slots=True)
class _State:
    index: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> position after it
    indexed: int = 0          # tokens [0, indexed) are in the index
    avg_accepted: float = 1.0
    steps_since_draft: int = 0


class NgramProposer:
    """Drafts for running requests, keyed by request id. Call `release(id)` when a request ends."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self._states: dict[str, _State] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow `tokens` (the request's prompt + output)."""
        state = self._states.setdefault(request_id, _State())
        self._extend(state, tokens)
        k = min(self.max_draft, max(1, round(state.avg_accepted) + 1), limit)
        if k <= 0:
            return []
        if state.avg_accepted < MIN_USEFUL and state.steps_since_draft < RETRY_EVERY:
            state.steps_since_draft += 1
            return []
        for n in range(min(MAX_MATCH, len(tokens) - 1), MIN_MATCH - 1, -1):
            start = state.index.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                state.steps_since_draft = 0
                # Past the end the copy continues with the same period (a repeated pattern).
                period = len(tokens) - start
                return [tokens[start + i % period] for i in range(k)]
        return []

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Feed back one verify step: `accepted` of `proposed` draft tokens were kept."""
        state = self._states.get(request_id)
        if state is not None and proposed:
            state.avg_accepted = (1 - EMA) * state.avg_accepted + EMA * accepted

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @staticmethod
    def _extend(state: _State, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the last one is the query)."""
        if state.indexed > len(tokens):      # the sequence shrank (never today): rebuild
            state.index.clear()
            state.indexed = 0
        for end in range(max(state.indexed, 1), len(tokens)):
            for n in range(MIN_MATCH, MAX_MATCH + 1):
                if end - n >= 0:
                    state.index[tuple(tokens[end - n:end])] = end
        state.indexed = max(state.indexed, len(tokens))
