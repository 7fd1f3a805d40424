"""CircuitBreaker state machine and outcome classification (4xx never counts)."""
from __future__ import annotations

import pytest

from radixserve.router.breaker import CircuitBreaker
from radixserve.router.outcome import Outcome, classify, error_kind


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(failures=3, successes=2, timeout_s=10.0, **kw):
    clock = FakeClock()
    moves = []
    breaker = CircuitBreaker(failures, successes, timeout_s, clock=clock,
                             on_transition=lambda a, b: moves.append((a, b)), **kw)
    return breaker, clock, moves


def open_breaker(breaker):
    for _ in range(breaker.failure_threshold):
        breaker.record("failure")
    assert breaker.state == "open"


def test_opens_after_consecutive_failures_only():
    breaker, _, moves = make()
    for outcome in ["failure", "failure", "success", "failure", "failure", "neutral"]:
        breaker.record(outcome)
        assert breaker.state == "closed" and breaker.can_execute()
    assert breaker.consecutive_failures == 2  # neutral neither counted nor reset
    breaker.record("failure")
    assert breaker.state == "open" and not breaker.can_execute()
    assert moves == [("closed", "open")]


def test_half_open_lets_one_probe_at_a_time_then_closes():
    breaker, clock, moves = make()
    open_breaker(breaker)
    clock.now = 9.9
    assert not breaker.can_execute() and breaker.begin() is None
    clock.now = 10.0
    assert breaker.state == "half_open" and breaker.can_execute()
    token = breaker.begin()
    assert token is not None
    assert not breaker.can_execute()  # the probe is in flight
    breaker.record("success")
    assert breaker.state == "half_open" and breaker.can_execute()
    breaker.end(token)
    token = breaker.begin()
    assert not breaker.can_execute()
    breaker.record("success")
    breaker.end(token)
    assert breaker.state == "closed" and breaker.can_execute()
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert breaker.num_transitions == 3


def test_half_open_failure_reopens_and_restarts_the_timer():
    breaker, clock, moves = make()
    open_breaker(breaker)
    clock.now = 10
    breaker.begin()
    breaker.record("success")
    breaker.begin()
    clock.now = 12
    breaker.record("failure")
    assert breaker.state == "open"
    clock.now = 21.9
    assert breaker.state == "open"
    clock.now = 22
    assert breaker.state == "half_open"
    # the half-open success count started over
    breaker.record("success")
    assert breaker.state == "half_open"
    breaker.record("success")
    assert breaker.state == "closed"
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "open"),
                     ("open", "half_open"), ("half_open", "closed")]


def test_neutral_frees_the_probe_without_counting():
    breaker, clock, _ = make(successes=1)
    open_breaker(breaker)
    clock.now = 10
    breaker.begin()
    breaker.record("neutral")
    assert breaker.state == "half_open" and breaker.can_execute()
    breaker.begin()
    breaker.record("success")
    assert breaker.state == "closed"


def test_unrecorded_probe_is_freed_by_its_own_token_only():
    breaker, clock, _ = make()
    open_breaker(breaker)
    clock.now = 10
    first = breaker.begin()
    breaker.end(first)  # cancelled before any outcome: slot freed
    assert breaker.can_execute()
    second = breaker.begin()
    breaker.record("success")
    third = breaker.begin()
    breaker.end(second)  # a finished probe's late end does not free the newer one
    assert not breaker.can_execute()
    breaker.end(third)
    assert breaker.can_execute()


def test_late_outcomes_while_open_are_ignored():
    breaker, clock, _ = make()
    open_breaker(breaker)
    breaker.record("success")
    breaker.record("success")
    assert breaker.state == "open"
    clock.now = 10
    assert breaker.state == "half_open"


def test_disabled_breaker_never_opens():
    breaker, _, moves = make(disabled=True)
    for _ in range(100):
        breaker.record("failure")
    breaker.force_open()
    assert breaker.state == "closed" and breaker.can_execute() and moves == []


def test_force_open_and_reset():
    breaker, clock, moves = make()
    breaker.force_open()
    assert breaker.state == "open"
    breaker.reset()
    assert breaker.state == "closed" and breaker.can_execute()
    assert moves == [("closed", "open"), ("open", "closed")]


def test_bad_arguments():
    breaker, _, _ = make()
    with pytest.raises(ValueError):
        breaker.record("ok")
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1, 1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(1, 1, -1.0)


@pytest.mark.parametrize("status,transport,expected", [
    (200, False, Outcome("success", False)),
    (204, False, Outcome("success", False)),
    (400, False, Outcome("success", False)),
    (401, False, Outcome("success", False)),
    (403, False, Outcome("success", False)),
    (404, False, Outcome("success", False)),
    (413, False, Outcome("success", False)),
    (422, False, Outcome("success", False)),
    (408, False, Outcome("failure", True)),
    (429, False, Outcome("neutral", True)),
    (503, False, Outcome("neutral", True)),
    (500, False, Outcome("failure", True)),
    (502, False, Outcome("failure", True)),
    (504, False, Outcome("failure", True)),
    (None, True, Outcome("failure", True)),
    (200, True, Outcome("failure", True)),  # a stream that broke after its 200
    (None, False, Outcome("neutral", False)),  # the client went away
])
def test_classify(status, transport, expected):
    assert classify(status, transport) == expected


def test_client_errors_and_backpressure_never_open_the_breaker():
    breaker, _, moves = make(failures=2)
    for status in [400, 413, 422, 429, 503, 404, 401] * 10:
        breaker.record(classify(status, False).breaker)
    assert breaker.state == "closed" and moves == []
    breaker.record(classify(500, False).breaker)
    breaker.record(classify(400, False).breaker)  # a success: resets the count
    breaker.record(classify(502, False).breaker)
    assert breaker.state == "closed"
    breaker.record(classify(None, True).breaker)
    assert breaker.state == "open"


def test_a_hung_probe_frees_the_half_open_slot_after_timeout_s():
    """C40: a probe that never answers (a hung stream) must not keep the breaker half-open
    for good; after timeout_s another request may probe, and its success closes it."""
    breaker, clock, moves = make(successes=1)
    open_breaker(breaker)
    clock.now = 10
    hung = breaker.begin()
    clock.now = 19.9
    assert breaker.state == "half_open" and not breaker.can_execute()
    clock.now = 20
    assert breaker.can_execute()
    probe = breaker.begin()
    breaker.end(hung)          # the hung probe's late end frees nothing
    assert not breaker.can_execute()
    breaker.record("success")
    breaker.end(probe)
    assert breaker.state == "closed" and moves[-1] == ("half_open", "closed")


@pytest.mark.parametrize("kind, expected", [
    (None, Outcome("neutral", True)),
    ("server_overloaded", Outcome("neutral", True)),     # queue full
    ("service_unavailable", Outcome("neutral", True)),   # draining
    ("engine_dead", Outcome("failure", True)),           # a broken worker, not a busy one
])
def test_a_503_is_backpressure_unless_its_body_says_the_engine_is_dead(kind, expected):
    assert classify(503, False, kind) == expected


@pytest.mark.parametrize("content, kind", [
    (b'{"error": {"type": "engine_dead", "code": 503}}', "engine_dead"),
    (b'{"error": {"type": 5}}', None),
    (b'{"error": "x"}', None),
    (b'[1]', None),
    (b"not json", None),
    (b"[" * 100_000, None),
])
def test_error_kind_reads_only_an_openai_error_type(content, kind):
    assert error_kind(content) == kind


def test_backpressure_bursts_never_open_and_half_open_success_closes():
    """C40 in miniature: 503/429 answers between real faults change nothing; after a real
    outage the breaker opens, and one probe success per success_threshold closes it."""
    breaker, clock, moves = make(failures=3, successes=2, timeout_s=5.0)
    for _ in range(100):
        breaker.record(classify(503, False, "server_overloaded").breaker)
        breaker.record(classify(429, False).breaker)
    assert breaker.state == "closed" and moves == []
    for _ in range(3):
        breaker.record(classify(None, True).breaker)   # killed: connection refused
    assert breaker.state == "open"
    clock.now = 5
    for _ in range(2):
        token = breaker.begin()
        breaker.record(classify(200, False).breaker)
        breaker.end(token)
    assert breaker.state == "closed"
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_passing_health_checks_close_a_half_open_breaker_and_change_nothing_else():
    """C40: a worker no request is routed to still closes: each passing health check counts as
    one half-open success, without taking the probe slot; closed and open states ignore them."""
    breaker, clock, moves = make(failures=3, successes=2, timeout_s=10.0)
    breaker.record("failure")
    breaker.record("failure")
    breaker.probe_passed()
    assert breaker.consecutive_failures == 2   # a pass is no request success
    breaker.record("failure")
    breaker.probe_passed()
    assert breaker.state == "open"
    clock.now = 10.0
    token = breaker.begin()
    breaker.probe_passed()
    assert breaker.state == "half_open" and not breaker.can_execute()  # the probe still holds
    breaker.probe_passed()
    assert breaker.state == "closed" and moves[-1] == ("half_open", "closed")
    breaker.end(token)
    disabled, _, _ = make(disabled=True)
    disabled.probe_passed()
    assert disabled.state == "closed"
