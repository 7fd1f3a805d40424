"""Speculative acceptance as an anomaly signal: SpecCounts arithmetic, the GLM rule (accept
length < 1.4 or accept rate > 0.96 after 128 tokens), and the guard wiring."""
from __future__ import annotations

from radixserve.outputs import SpecCounts
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.anomaly import AnomalyGuard, GuardConfig
from radixserve.server.tracker import ChoiceUpdate


def test_spec_counts_arithmetic_and_usage_fields():
    a, b = SpecCounts(4, 12, 6), SpecCounts(1, 4, 4)
    assert a.accept_length == 2.5 and a.accept_rate == 0.5
    assert SpecCounts().accept_length == 0.0 and SpecCounts().accept_rate == 0.0
    assert a + b == SpecCounts(5, 16, 10) and (a + b) - b == a
    assert a.usage_fields() == {"spec_verify_steps": 4, "spec_draft_tokens": 12,
                                "spec_accepted_tokens": 6, "spec_accept_length": 2.5,
                                "spec_accept_rate": 0.5}


def feed_steps(detector, steps, tokens_per_delta=None):
    """Feed one delta per verify step (draft, accepted); returns the first detection and the
    tokens generated when it fired."""
    total, num = SpecCounts(), 0
    for draft, accepted in steps:
        total = total + SpecCounts(1, draft, accepted)
        n = tokens_per_delta or accepted + 1
        num += n
        found = detector.feed(ChoiceUpdate(0, "x" * n, [7] * n, spec=total))
        if found is not None:
            return found, num
    return None, num




def test_glm_rule_low_accept_length_fires_only_after_min_tokens():
    detector = AcceptanceDetector(AcceptanceConfig())
    found, num = feed_steps(detector, [(4, 0)] * 200)          # 1.0 token per verify step
    assert found is not None and found.kind == "spec_acceptance" and "accept length" in found.detail
    assert num == 128
    healthy = AcceptanceDetector(AcceptanceConfig())
    assert feed_steps(healthy, [(4, 1), (4, 0)] * 100)[0] is None   # 1.5 per step


def test_glm_rule_high_accept_rate_fires_and_either_half_can_be_turned_off():
    loop = [(4, 4)] * 100
    found, _ = feed_steps(AcceptanceDetector(AcceptanceConfig()), loop)
    assert found is not None and "accept rate" in found.detail
    off = AcceptanceConfig(max_accept_rate=1.0)
    assert feed_steps(AcceptanceDetector(off), loop)[0] is None
    greedy = AcceptanceDetector(AcceptanceConfig(), loops_expected=True)
    assert feed_steps(greedy, loop)[0] is None      # a greedy loop is the model's own answer
    off = AcceptanceConfig(min_accept_length=0.0)
    assert feed_steps(AcceptanceDetector(off), [(4, 0)] * 200)[0] is None


def test_few_verify_steps_or_no_speculation_are_not_judged():
    detector = AcceptanceDetector(AcceptanceConfig())
    # 300 tokens, 15 verify steps (< min_verify_steps): too little evidence.
    assert feed_steps(detector, [(4, 0)] * 15, tokens_per_delta=20)[0] is None
    quiet = AcceptanceDetector(AcceptanceConfig())
    assert all(quiet.feed(ChoiceUpdate(0, "word ", [1])) is None for _ in range(500))


def test_the_guard_ends_the_choice_with_the_acceptance_kind():
    guard = AnomalyGuard(GuardConfig(), [AcceptanceDetector(AcceptanceConfig(),
                                                            loops_expected=True)], loops_expected=True)
    found, _ = feed_steps(guard, [(4, 0)] * 200)
    assert found is not None and found.kind == "spec_acceptance"
    assert guard.feed(ChoiceUpdate(0, "more", [1])) == found    # the first detection sticks
