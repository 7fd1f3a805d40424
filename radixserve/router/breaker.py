"""Per-worker circuit breaker: closed -> open -> half_open -> closed (SGLang router)."""
from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
OUTCOMES = ("success", "failure", "neutral")


class CircuitBreaker:
    """Consecutive-failure breaker (SGLang `core/circuit_breaker.rs`); times in clock seconds.

        closed --failure_threshold failures--> open --timeout_s--> half_open
        half_open --success_threshold successes--> closed;  --a failure--> open

    "neutral" changes no count; outcomes recorded while open are ignored. Half_open admits one probe: begin() claims it,
    record() or end(token) frees it, and it lapses after timeout_s; probe_passed() (a health check) counts as a success
    without claiming it. Raises ValueError on thresholds < 1 or a negative timeout."""

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
        self.name = name
        self._clock = clock
        self._state = CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probe: int | None = None
        self._probe_at = 0.0
        self._next_token = 0
        self.num_transitions = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.timeout_s:
            self._move(HALF_OPEN)
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def can_execute(self) -> bool:
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._probe_pending())

    def begin(self) -> int | None:
        if self.state != HALF_OPEN:
            return None
        self._next_token += 1
        self._probe, self._probe_at = self._next_token, self._clock()
        return self._probe

    def end(self, token: int | None) -> None:
        if token is not None and self._probe == token:
            self._probe = None

    def record(self, outcome: str) -> None:
        """Raises ValueError unless `outcome` is "success", "failure" or "neutral"."""
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
                self._succeed()
        elif state == CLOSED:
            if outcome == "failure":
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open()
            elif outcome == "success":
                self._failures = 0

    def probe_passed(self) -> None:
        """An out-of-band probe (a passing health check) is one half-open success, so a worker
        that no request is routed to still closes (C40); in other states it changes nothing."""
        if not self.disabled and self.state == HALF_OPEN:
            self._succeed()

    def _succeed(self) -> None:
        self._successes += 1
        if self._successes >= self.success_threshold:
            self._move(CLOSED)

    def _probe_pending(self) -> bool:
        return self._probe is not None and self._clock() - self._probe_at < self.timeout_s

    def force_open(self) -> None:
        if not self.disabled:
            self._open()

    def reset(self) -> None:
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
