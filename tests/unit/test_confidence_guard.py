"""The confidence detector (server/confidence_guard.py) and what feeds it: the sampler's
`top_logprob`, asked for by `guard_confidence` without the client's logprobs leaking out."""
from __future__ import annotations

import math

import pytest
import torch

from radixserve.layers.sampler import Sampler
from radixserve.outputs import EngineOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams
from radixserve.server.anomaly import AnomalyGuard, GuardConfig
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged
from radixserve.server.tracker import ChoiceUpdate, RequestTracker
from tests.unit.test_sampler import V, Row

CFG = ConfidenceConfig(window=8, min_mean_logprob=-1.5, min_drop=0.6, baseline_tokens=4)


def feed(detector: ConfidenceDetector, values: list[float], chunk: int = 3):
    """Feed `values` in deltas of `chunk` tokens; the first detection and its delta index."""
    for i in range(0, len(values), chunk):
        found = detector.feed(ChoiceUpdate(0, "x", [0] * len(values[i:i + chunk]),
                                             confidences=values[i:i + chunk]))
        if found is not None:
            return found, i // chunk
    return None


def test_a_sustained_collapse_is_caught_and_a_short_dip_is_not():
    confident, lost = [-0.3] * 20, [-2.5] * 12
    assert feed(ConfidenceDetector(CFG), confident + [-4.0] * 2 + confident) is None   # dip: window mean -1.23
    found, at = feed(ConfidenceDetector(CFG), confident + lost)
    assert found.kind == "low_confidence" and "over the last 8 tokens" in found.detail
    # caught once the window holds enough of the collapse: mean < -1.5 needs >= 6 of 8 lost tokens
    assert 20 + 6 <= (at + 1) * 3 <= 20 + 6 + 3


def test_nothing_is_judged_before_a_full_window_and_nan_is_skipped():
    start = [-0.2] * 4   # the baseline
    assert feed(ConfidenceDetector(CFG), start + [-9.0] * 3) is None
    assert feed(ConfidenceDetector(CFG), [math.nan] * 30 + start + [-9.0] * 3) is None
    assert feed(ConfidenceDetector(CFG), [math.nan] * 30 + start + [-9.0] * 8) is not None
    assert ConfidenceDetector(CFG).feed(ChoiceUpdate(0, "text only")) is None


def test_an_answer_unsure_from_its_start_is_not_a_collapse():
    """A small model translating into Japanese is unsure throughout: the window is low, but not
    below the answer's own start; the same low window after a confident start is caught."""
    assert feed(ConfidenceDetector(CFG), [-2.5] * 40) is None
    found = feed(ConfidenceDetector(CFG), [-0.5] * 4 + [-2.5] * 36)
    assert found is not None and "below the answer's first 4 tokens" in found[0].detail


def test_only_greedy_and_cool_unconstrained_choices_are_judged():
    assert judged(ConfidenceConfig(), 0.0, False) and judged(ConfidenceConfig(), 0.8, False)
    assert not judged(ConfidenceConfig(), 1.0, False)
    assert not judged(ConfidenceConfig(), 0.0, True)


def test_the_guard_reports_it_as_any_detector():
    guard = AnomalyGuard(GuardConfig(), [ConfidenceDetector(CFG)], loops_expected=True)
    assert guard.feed(ChoiceUpdate(0, "fine text", [1] * 8, confidences=[-0.1] * 8)) is None
    found = guard.feed(ChoiceUpdate(0, " more", [1] * 16, confidences=[-4.0] * 16))
    assert found is not None and found.kind == "low_confidence"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sampler_reports_top_logprob_for_guard_confidence_only(temperature):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    best = torch.log_softmax(logits, -1).max(-1).values
    watched = Row(SamplingParams(temperature=temperature, seed=1, guard_confidence=True))
    plain = Row(SamplingParams(temperature=temperature, seed=1))
    asked = Row(SamplingParams(temperature=temperature, seed=1, logprobs=0))
    s = Sampler(V, frozenset())
    out = s.logprobs(logits, s.sample(logits, [watched, plain, asked]), [watched, plain, asked])
    assert out[0].top_logprob == pytest.approx(float(best[0]), abs=1e-6) and out[0].top == []
    assert not math.isnan(out[0].logprob)
    assert out[2].top_logprob == pytest.approx(float(best[2]), abs=1e-6)
    assert s.logprobs(logits[1:2], s.sample(logits[1:2], [plain]), [plain]) is None   # nobody asked: skipped


def test_verify_reports_top_logprob_for_every_emitted_token():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    draft = [int(logits[0].argmax()), int(logits[1].argmax())]
    row = Row(SamplingParams(temperature=0, guard_confidence=True))
    _, lps = Sampler(V, frozenset()).verify(logits, row, draft)
    best = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert [t.top_logprob for t in lps] == pytest.approx(best, abs=1e-6)


def test_tracker_hands_confidences_to_the_guard_not_logprobs_to_the_client(default_tokenizer):
    params = SamplingParams(max_tokens=4, temperature=0, guard_confidence=True)
    tracker = RequestTracker("r", [1, 2], params, default_tokenizer)
    (child, _), = tracker.child_requests()
    ids = default_tokenizer.hf.encode(" hello there", add_special_tokens=False)[:2]
    lps = [TokenLogprob(t, -0.5, [], -0.25 * (i + 1)) for i, t in enumerate(ids)]
    update = tracker.process(EngineOutput(request_id=child, new_token_ids=ids, new_logprobs=lps))
    assert update.confidences == [-0.25, -0.5] and update.logprobs is None
    assert tracker.result().outputs[0].logprobs is None
