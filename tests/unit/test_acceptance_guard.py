"""Speculative acceptance as an anomaly signal: SpecCounts arithmetic, the GLM rule (accept
length < 1.4 or accept rate > 0.96 after 128 tokens), and the guard wiring."""
from __future__ import annotations

import pytest

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


def judge(counts: SpecCounts, num_tokens: int = 128, loops_expected: bool = False,
          config: AcceptanceConfig = AcceptanceConfig()):
    """One update carrying `num_tokens` tokens and the choice's cumulative `counts`."""
    detector = AcceptanceDetector(config, loops_expected)
    return detector.feed(ChoiceUpdate(0, "x", [7] * num_tokens, spec=counts))


def test_sglang_definitions_with_a_trained_draft_of_three_tokens():
    """Every decode step verifies 3 drafts (K = 3, SGLang's num_draft_tokens 4): 40 steps that
    accepted 80 drafts emitted 120 tokens: accept length 3.0 (the bonus token counted), rate 2/3.
    SGLang's completion_tokens / verify_ct also counts the prefill's token: 121 / 40."""
    counts = SpecCounts(verify_steps=40, draft_tokens=120, accepted_tokens=80)
    assert counts.accept_length == 3.0 and counts.accept_rate == 80 / 120
    assert counts.accept_length * 40 + 1 == 121


@pytest.mark.parametrize("accepted, fires", [(31, True), (32, False), (33, False)])
def test_accept_length_at_and_around_1_4(accepted, fires):
    """80 verify steps of 4 drafts: 111, 112 and 113 tokens emitted (1.3875, exactly 1.4, 1.4125)."""
    counts = SpecCounts(80, 320, accepted)
    assert (counts.accept_length < 1.4) == fires and (accepted != 32 or counts.accept_length == 1.4)
    found = judge(counts)
    assert (found is not None) == fires
    if fires:
        assert found.kind == "spec_acceptance" and "accept length 1.39" in found.detail


@pytest.mark.parametrize("accepted, fires", [(239, False), (240, False), (241, True)])
def test_accept_rate_at_and_around_0_96(accepted, fires):
    """250 proposed drafts over 50 verify steps: rates 0.956, exactly 0.96, 0.964."""
    counts = SpecCounts(50, 250, accepted)
    assert (accepted != 240 or counts.accept_rate == 0.96)
    found = judge(counts)
    assert (found is not None) == fires
    if fires:
        assert "accept rate 0.964" in found.detail
    assert judge(counts, loops_expected=True) is None   # greedy / grammar: not judged


@pytest.mark.parametrize("num_tokens, fires", [(127, False), (128, True), (129, True)])
def test_judged_from_the_128th_generated_token(num_tokens, fires):
    assert (judge(SpecCounts(100, 400, 0), num_tokens) is not None) == fires


@pytest.mark.parametrize("steps, fires", [(15, False), (16, True)])
def test_and_from_the_16th_verify_step(steps, fires):
    assert (judge(SpecCounts(steps, 4 * steps, 0), 200) is not None) == fires


def test_tokens_are_counted_across_updates():
    detector = AcceptanceDetector(AcceptanceConfig())
    counts = SpecCounts(100, 400, 0)
    for _ in range(127):
        assert detector.feed(ChoiceUpdate(0, "x", [7], spec=counts)) is None
    assert detector.feed(ChoiceUpdate(0, "x", [7], spec=counts)) is not None
