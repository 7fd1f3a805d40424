"""N-gram speculation (prompt lookup): draft tokens copied from earlier in the request's own prompt and output, or from recent requests' outputs.

Prompt lookup decoding (Saxena 2023), with a cross-request table like SGLang's NGRAM; adaptive draft length and
the batch gate (draft only while the acceptance rate r > B / (B + a/b)): docs/speculative.md."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_MATCH = 3
MIN_MATCH = 3        # shorter matches (", and", "the") draft badly in prose
EMA = 0.3
PRIOR_EMA = 0.05     # EMA weight of the all-requests rate a new request starts from
MIN_USEFUL = 0.15    # stop drafting below this many accepted tokens per step, but probe every RETRY_EVERY
RETRY_EVERY = 16
SHARED_CONTINUATION = 16
# The batch gate's R when --speculative-break-even-tokens is unset: float weights read once per step cost about 16
# tokens of compute (docs/speculative.md); the CPU int4/int8 kernels are compute-bound, each token costs nearly as
# much as the step's fixed part does over 4.
FLOAT_BREAK_EVEN = 16.0
KERNEL_BREAK_EVEN = 4.0
KERNEL_QUANTIZATIONS = frozenset({"int4", "int8", "int4-int8", "int4-fp32"})


def resolve_break_even(configured: float | None, quantization: str | None) -> float:
    """R of the batch gate: `configured` (--speculative-break-even-tokens) if set, else by the runner's resolved
    --quantization (None where the runner does not say: float)."""
    if configured is not None:
        return configured
    return KERNEL_BREAK_EVEN if quantization in KERNEL_QUANTIZATIONS else FLOAT_BREAK_EVEN


@dataclass(slots=True)
class _State:
    index: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> position after it
    indexed: int = 0
    avg_accepted: float = 1.0
    rate: float = 1.0
    last_full: int = 0        # length of the last draft if all of it was accepted, else 0
    steps_since_draft: int = 0


class _AdaptiveProposer:
    def __init__(self, max_draft: int, break_even_tokens: float = 16.0):
        """`break_even_tokens`: a / b of the batch gate; 0 turns the gate off."""
        self.max_draft = max_draft
        self.break_even_tokens = break_even_tokens
        self._min_rate = 0.0
        self._batch = 1
        self._prior_rate = 1.0
        self._states: dict[str, _State] = {}

    def _state(self, request_id: str) -> _State:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _State(rate=self._prior_rate)
        return state

    def set_batch(self, num_decoding: int) -> None:
        r = self.break_even_tokens
        self._batch = max(1, num_decoding)
        self._min_rate = num_decoding / (num_decoding + r) if r > 0 and num_decoding > 1 else 0.0

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        state = self._states.get(request_id)
        if state is not None and proposed:
            state.avg_accepted = (1 - EMA) * state.avg_accepted + EMA * accepted
            state.rate = (1 - EMA) * state.rate + EMA * accepted / proposed
            self._prior_rate = (1 - PRIOR_EMA) * self._prior_rate + PRIOR_EMA * accepted / proposed
            state.last_full = proposed if accepted == proposed else 0

    def flush(self) -> None:
        """Forget the shared table; the acceptance prior stays (it describes the traffic)."""

    def _retry_every(self) -> int:
        """Steps a backing-off request waits before it probes again."""
        return RETRY_EVERY

    def _paying(self, state: _State) -> bool:
        return ((state.avg_accepted >= MIN_USEFUL and state.rate >= self._min_rate)
                or state.steps_since_draft >= self._retry_every())

    def _draft_len(self, state: _State, limit: int) -> int:
        k = min(self.max_draft, max(1, round(state.avg_accepted) + 1, state.last_full + 1), limit)
        if k <= 0:
            return 0
        if not self._paying(state):
            state.steps_since_draft += 1
            return 0
        return k


class NgramProposer(_AdaptiveProposer):
    def __init__(self, max_draft: int, shared_entries: int = 1 << 16,
                 break_even_tokens: float = 16.0):
        super().__init__(max_draft, break_even_tokens)
        self.shared_entries = shared_entries
        self._shared: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        state = self._state(request_id)
        self._extend(state, tokens)
        k = self._draft_len(state, limit)
        if k <= 0:
            return []
        for n in range(min(MAX_MATCH, len(tokens) - 1), MIN_MATCH - 1, -1):
            start = state.index.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                state.steps_since_draft = 0
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
        """Forget a request; its output's n-grams (given `tokens`) enter the shared LRU table."""
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
        if state.indexed > len(tokens):
            state.index.clear()
            state.indexed = 0
        for end in range(max(state.indexed, 1), len(tokens)):
            for n in range(MIN_MATCH, MAX_MATCH + 1):
                if end - n >= 0:
                    state.index[tuple(tokens[end - n:end])] = end
        state.indexed = max(state.indexed, len(tokens))


class ModelDraftProposer(_AdaptiveProposer):
    """Drafts the runner's draft model made (SeqResult.next_draft) for the request's next step; an
    offer for another sequence length is dropped."""

    def __init__(self, max_draft: int, break_even_tokens: float = 16.0):
        super().__init__(max_draft, break_even_tokens)
        self._offers: dict[str, tuple[int, tuple[int, ...]]] = {}

    def _retry_every(self) -> int:
        """A model draft's probe runs its chain too: with the gate on, B decoding requests probe B times less often
        each, about one probe per RETRY_EVERY steps in all."""
        return RETRY_EVERY * (self._batch if self.break_even_tokens > 0 else 1)

    def offer(self, request_id: str, draft: tuple[int, ...], num_tokens: int) -> None:
        self._offers[request_id] = (num_tokens, draft)

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Call every decode step, offer or not, so a request backing off counts towards its probe."""
        state = self._state(request_id)
        offer = self._offers.pop(request_id, None)
        k = self._draft_len(state, limit)
        if k <= 0 or offer is None or offer[0] != len(tokens) or not offer[1]:
            return []
        state.steps_since_draft = 0
        return list(offer[1][:k])

    def wants_draft(self, request_id: str) -> bool:
        """False while the request backs off (no probe due): the runner need not draft."""
        state = self._states.get(request_id)
        return state is None or self._paying(state)

    def release(self, request_id: str, tokens: list[int] | None = None,
                num_output: int = 0) -> None:
        self._states.pop(request_id, None)
        self._offers.pop(request_id, None)
