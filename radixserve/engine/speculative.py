"""N-gram speculation (prompt lookup): draft tokens copied from earlier in the request's own prompt and output, or from recent requests' outputs.

Coding-agent and editing traffic copies long spans from its context; when the last few tokens
occurred before, the tokens that followed them then are a good guess for what follows now.
Per request, an index maps every n-gram (n = MIN_MATCH..MAX_MATCH) of the sequence to the position
after its latest earlier occurrence; proposing looks up the longest suffix n-gram that occurred
before and copies k tokens from there (continuing periodically when the match is closer than
k tokens to the end: a loop repeats). The index grows by MAX_MATCH entries per new
token, so a proposal costs O(MAX_MATCH + k) whatever the context length. (Prompt lookup
decoding: Saxena 2023; SGLang's `--speculative-algorithm NGRAM` adds a shared trie.)

Shared table: when a request's own tokens have no match, its last MAX_MATCH tokens are looked up in
a bounded table of what followed them in recently finished requests' outputs (LRU, at most
`shared_entries` n-grams, each with up to SHARED_CONTINUATION tokens; filled by `release`).
Agents and chat users send the same questions and get the same answers again; a request's own
prompt only holds what it was given. (SGLang's NGRAM shares a trie across requests the same way.)

Adaptive k: each request keeps an exponential moving average of the drafts it got accepted per
verify step; the next draft is `clamp(round(avg) + 1, 1, max_draft)` tokens, or one more than
the last draft when all of that was accepted (a copy grows its draft by one token a step), so
requests whose drafts keep failing cost at most one extra position per step, and requests that
copy reach `max_draft`. Drafting stops for a request while its average is below MIN_USEFUL.

Batch gate: a step's time is about a + b * n for n tokens (a: reading the weights once, b:
compute per token; break_even_tokens = a / b). With B requests decoding, d more draft positions
of which a fraction r is accepted raise the output per second only while r > B / (B + a/b)
(throughput (B + r d) / (a + b (B + d)) against B / (a + b B)). Each request keeps an average
of r (starting from the average over all requests' verify steps, so that short requests need
not each learn it), and drafts only while it is above that bound (probing every RETRY_EVERY
steps): at batch 1 nearly any draft pays, at batch 16 with a/b = 16 only one that is accepted
half the time.
The default a/b = 16 is measured on a 2-core AVX2 CPU (docs/benchmarks.md); a GPU's is larger.
The gate changes only which steps carry drafts, never a token: greedy output is the same.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_MATCH = 3        # longest suffix n-gram looked up
MIN_MATCH = 3        # shortest: shorter matches (", and", "the") draft badly in prose
EMA = 0.3            # weight of the latest verify step in the acceptance average
PRIOR_EMA = 0.05     # ... in the all-requests acceptance rate a new request starts from
MIN_USEFUL = 0.15    # below this average accepted drafts per step, stop drafting ...
RETRY_EVERY = 16     # ... except one probe every this many steps
SHARED_CONTINUATION = 16   # tokens kept after each n-gram of the shared table


@dataclass(slots=True)
class _State:
    index: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> position after it
    indexed: int = 0          # tokens [0, indexed) are in the index
    avg_accepted: float = 1.0
    rate: float = 1.0         # average fraction of draft tokens accepted
    last_full: int = 0        # length of the last draft if all of it was accepted, else 0
    steps_since_draft: int = 0


class _AdaptiveProposer:
    """Per-request draft length from recent acceptance (module doc): `record` feeds it back."""

    def __init__(self, max_draft: int, break_even_tokens: float = 16.0):
        """`break_even_tokens`: a / b of the batch gate (module doc); 0 turns the gate off."""
        self.max_draft = max_draft
        self.break_even_tokens = break_even_tokens
        self._min_rate = 0.0
        self._prior_rate = 1.0
        self._states: dict[str, _State] = {}

    def _state(self, request_id: str) -> _State:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _State(rate=self._prior_rate)
        return state

    def set_batch(self, num_decoding: int) -> None:
        """Start a step with `num_decoding` requests decoding: sets the acceptance rate a
        request's drafts need to pay at this batch size (module doc, batch gate)."""
        r = self.break_even_tokens
        self._min_rate = num_decoding / (num_decoding + r) if r > 0 and num_decoding > 1 else 0.0

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Feed back one verify step: `accepted` of `proposed` draft tokens were kept."""
        state = self._states.get(request_id)
        if state is not None and proposed:
            state.avg_accepted = (1 - EMA) * state.avg_accepted + EMA * accepted
            state.rate = (1 - EMA) * state.rate + EMA * accepted / proposed
            self._prior_rate = (1 - PRIOR_EMA) * self._prior_rate + PRIOR_EMA * accepted / proposed
            state.last_full = proposed if accepted == proposed else 0

    def flush(self) -> None:
        """Forget what finished requests' outputs taught (NgramProposer: the shared table); the
        acceptance prior stays, as it describes the traffic, not the cached text."""

    def _paying(self, state: _State) -> bool:
        """Whether the request's drafts pay at this step's batch size (or a probe is due)."""
        return ((state.avg_accepted >= MIN_USEFUL and state.rate >= self._min_rate)
                or state.steps_since_draft >= RETRY_EVERY)

    def _draft_len(self, state: _State, limit: int) -> int:
        """Tokens to draft now: 0 while backing off (and no probe is due) or at the limit."""
        k = min(self.max_draft, max(1, round(state.avg_accepted) + 1, state.last_full + 1), limit)
        if k <= 0:
            return 0
        if not self._paying(state):
            state.steps_since_draft += 1
            return 0
        return k


class NgramProposer(_AdaptiveProposer):
    """Drafts for running requests, keyed by request id. Call `release(id, tokens)` when a
    request ends (its output then feeds the shared table)."""

    def __init__(self, max_draft: int, shared_entries: int = 1 << 16,
                 break_even_tokens: float = 16.0):
        super().__init__(max_draft, break_even_tokens)
        self.shared_entries = shared_entries
        self._shared: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow `tokens` (the request's prompt + output)."""
        state = self._state(request_id)
        self._extend(state, tokens)
        k = self._draft_len(state, limit)
        if k <= 0:
            return []
        for n in range(min(MAX_MATCH, len(tokens) - 1), MIN_MATCH - 1, -1):
            start = state.index.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                state.steps_since_draft = 0
                # Past the end the copy continues with the same period (a repeated pattern).
                period = len(tokens) - start
                return [tokens[start + i % period] for i in range(k)]
        shared = self._shared.get(tuple(tokens[-MAX_MATCH:]))
        if shared is not None:
            state.steps_since_draft = 0
            self._shared.move_to_end(tuple(tokens[-MAX_MATCH:]))
            return list(shared[:k])
        return []

    def release(self, request_id: str, tokens: list[int] | None = None,
                num_output: int = 0) -> None:
        """Forget a request; with its `tokens` (prompt + output), the n-grams of its last
        `num_output` tokens (and the MAX_MATCH before them) enter the shared table with what
        followed them, evicting the least recently used beyond `shared_entries`."""
        self._states.pop(request_id, None)
        if not tokens or num_output <= 0 or self.shared_entries <= 0:
            return
        table = self._shared
        for end in range(max(len(tokens) - num_output, MAX_MATCH), len(tokens)):
            key = tuple(tokens[end - MAX_MATCH:end])
            table[key] = tuple(tokens[end:end + SHARED_CONTINUATION])
            table.move_to_end(key)
        while len(table) > self.shared_entries:
            table.popitem(last=False)

    def flush(self) -> None:
        self._shared.clear()

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


class ModelDraftProposer(_AdaptiveProposer):
    """Drafts a draft model made in the runner (ScheduledSeq.propose -> SeqResult.next_draft),
    offered after each step and taken by the request's next step, cut to the adaptive length.
    An offer made for another sequence length (the request was cut, preempted or had a token
    forced since) is dropped."""

    def __init__(self, max_draft: int, break_even_tokens: float = 16.0):
        super().__init__(max_draft, break_even_tokens)
        self._offers: dict[str, tuple[int, tuple[int, ...]]] = {}

    def offer(self, request_id: str, draft: tuple[int, ...], num_tokens: int) -> None:
        """`draft` follows the request's first `num_tokens` tokens."""
        self._offers[request_id] = (num_tokens, draft)

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """The offered draft for `tokens`, up to the adaptive length and `limit`. Called every
        decode step, offer or not, so that a request backing off counts towards its probe."""
        state = self._state(request_id)
        offer = self._offers.pop(request_id, None)
        k = self._draft_len(state, limit)
        if k <= 0 or offer is None or offer[0] != len(tokens) or not offer[1]:
            return []
        state.steps_since_draft = 0
        return list(offer[1][:k])

    def wants_draft(self, request_id: str) -> bool:
        """Whether the request's next step will take a draft: False while it backs off and no
        probe is due, so the runner need not make one (K draft forwards)."""
        state = self._states.get(request_id)
        return state is None or self._paying(state)

    def release(self, request_id: str, tokens: list[int] | None = None,
                num_output: int = 0) -> None:
        self._states.pop(request_id, None)
        self._offers.pop(request_id, None)
