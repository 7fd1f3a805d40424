"""Per-worker circuit breaker: closed -> open -> half_open -> closed (SGLang router, §1.4)."""
from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
OUTCOMES = ("success", "failure", "neutral")


class CircuitBreaker:
    """Consecutive-failure circuit breaker (SGLang `core/circuit_breaker.rs`).

        closed --failure_threshold consecutive failures--> open
        open   --timeout_s elapsed--> half_open (one probe request at a time)
        half_open --success_threshold consecutive successes--> closed
        half_open --any failure--> open (timer restarts)

    A success resets the consecutive-failure count; "neutral" (backpressure, client gone)
    changes no count but frees the half-open probe slot. Outcomes recorded while open are
    late answers to requests sent before it opened and are ignored. `disabled` keeps it
    closed forever. `on_transition(from_state, to_state)` is called on every change (metrics);
    `name` (the worker URL) only labels log lines.

    Probe accounting: `can_execute()` only asks; `begin()` (called at dispatch, see
    WorkerRegistry.dispatch) claims the half-open probe slot and returns a token;
    `record()` frees the slot, and `end(token)` frees it if that probe never recorded
    (error, cancellation) and nobody has claimed a newer one. A probe out for timeout_s
    without an answer (a hung stream) no longer holds the slot, so a breaker is never stuck
    half-open behind one request (SGLang #31206: a half-open breaker that never closed).

    Raises ValueError on thresholds < 1 or a negative timeout.
    """

    def __init__(self, failure_threshold: int, success_threshold: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, disabled: bool = False,
                 on_transition: Callable[[str, str], None] | None = None,
                 name: str = "") -> None:
        if failure_threshold < 1 or success_threshold < 1:
            raise ValueError("circuit breaker thresholds must be >= 1")
        if not timeout_s >= 0:
            raise ValueError("circuit breaker timeout_s must be >= 0")
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout_s = timeout_s
        self.disabled = disabled
        self.on_transition = on_transition
        self.name = name  # for logs (the worker URL)
        self._clock = clock
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._successes = 0  # consecutive, while half-open
        self._opened_at = 0.0
        self._probe: int | None = None  # token of the half-open probe in flight
        self._probe_at = 0.0  # clock seconds when it was sent
        self._next_token = 0
        self.num_transitions = 0

    @property
    def state(self) -> str:
        """"closed", "open" or "half_open" (open turns half_open once timeout_s has passed)."""
        if self._state == OPEN and self._clock() - self._opened_at >= self.timeout_s:
            self._move(HALF_OPEN)
        return self._state

    @property
    def consecutive_failures(self) -> int:
        """Consecutive failures counted while closed."""
        return self._failures

    def can_execute(self) -> bool:
        """True if a request may be sent now: closed, or half_open with no probe in flight
        (or only one older than timeout_s). Claims nothing (see begin())."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._probe_pending())

    def begin(self) -> int | None:
        """Called at dispatch. In half_open, claims the probe slot and returns its token
        (pass it to end()); otherwise returns None."""
        if self.state != HALF_OPEN:
            return None
        self._next_token += 1
        self._probe, self._probe_at = self._next_token, self._clock()
        return self._probe

    def end(self, token: int | None) -> None:
        """Called when a dispatch finishes: frees the probe slot if `token` still holds it."""
        if token is not None and self._probe == token:
            self._probe = None

    def record(self, outcome: str) -> None:
        """Record one request's outcome: "success", "failure" or "neutral".
        Raises ValueError on any other value."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if self.disabled:
            return
        state = self.state
        if state == HALF_OPEN:
            self._probe = None
            if outcome == "failure":
                self._open()
            elif outcome == "success":
                self._successes += 1
                if self._successes >= self.success_threshold:
                    self._move(CLOSED)
        elif state == CLOSED:
            if outcome == "failure":
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open()
            elif outcome == "success":
                self._failures = 0

    def _probe_pending(self) -> bool:
        return self._probe is not None and self._clock() - self._probe_at < self.timeout_s

    def force_open(self) -> None:
        """Open now (manual isolation); the usual timeout then leads to half_open."""
        if not self.disabled:
            self._open()

    def reset(self) -> None:
        """Close now and clear all counts."""
        self._move(CLOSED)

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._move(OPEN)

    def _move(self, to: str) -> None:
        self._failures = 0
        self._successes = 0
        self._probe = None
        if to == self._state:
            return
        old, self._state = self._state, to
        self.num_transitions += 1
        logger.info("circuit breaker %s: %s -> %s", self.name, old, to)
        if self.on_transition is not None:
            self.on_transition(old, to)
