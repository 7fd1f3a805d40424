"""AcceptanceDetector: speculative-decoding acceptance as an output-anomaly signal.

Why (GLM's serving team): when a request's KV is corrupted the
target model stops agreeing with its draft, so the accept length collapses; a repetition loop
makes the draft right every time, so the accept rate approaches 1. Their rule and thresholds
(the flags' defaults; the detector itself is opt-in, --enable-spec-anomaly-detector):

    after `min_tokens` generated tokens (128), with at least `min_verify_steps` verify steps:
      accept length (tokens per verify step) < `min_accept_length` (1.4)  -> "spec_acceptance"
      accept rate (accepted / draft tokens)   > `max_accept_rate`   (0.96) -> "spec_acceptance"
                                                 (sampled choices only, as for repetition)

Both are judged over the request's whole output so far (cumulative counts from the engine,
`ChoiceUpdate.spec`). With n-gram drafts a request drafts only where its last tokens occurred
before, so prose verifies rarely; the verify-step minimum keeps such requests from being judged
on a handful of steps. docs/anomaly_guard.md has the measured detection and false-positive rates
of this rule next to the text detectors (with n-gram drafts on the default model it catches
almost nothing: corrupted output does not repeat, so it is rarely drafted at all).
"""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.server.anomaly import Detection
from radixserve.server.tracker import ChoiceUpdate


@dataclass(frozen=True)
class AcceptanceConfig:
    """Thresholds (flags --spec-anomaly-*). A threshold of 0 (min length) or 1 (max rate)
    turns that half of the rule off."""

    min_tokens: int = 128            # generated tokens before the GLM rule judges
    min_verify_steps: int = 16       # ... and verify steps
    min_accept_length: float = 1.4   # tokens per verify step below this: corrupted KV
    max_accept_rate: float = 0.96    # accepted / draft tokens above this: a loop


class AcceptanceDetector:
    """One choice's acceptance judge (the `Detector` protocol of anomaly.py): the rule of the
    module doc over the choice's cumulative counts."""

    kind = "spec_acceptance"

    def __init__(self, config: AcceptanceConfig, loops_expected: bool = False):
        """`loops_expected`: the choice decodes greedily or under a grammar, so the high-rate
        half (a loop) is not judged, for the repetition detector's reasons
        (anomaly.AnomalyGuard)."""
        self.config = config
        self.loops_expected = loops_expected
        self.num_tokens = 0

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        self.num_tokens += len(update.token_ids)
        spec, cfg = update.spec, self.config
        if (spec is None or self.num_tokens < cfg.min_tokens
                or spec.verify_steps < cfg.min_verify_steps):
            return None
        if spec.accept_length < cfg.min_accept_length:
            return Detection(self.kind, f"accept length {spec.accept_length:.2f} < "
                                        f"{cfg.min_accept_length} over {spec.verify_steps} verify "
                                        f"steps and {self.num_tokens} tokens")
        if not self.loops_expected and spec.accept_rate > cfg.max_accept_rate:
            return Detection(self.kind, f"accept rate {spec.accept_rate:.3f} > "
                                        f"{cfg.max_accept_rate} ({spec.accepted_tokens} of "
                                        f"{spec.draft_tokens} draft tokens)")
        return None
