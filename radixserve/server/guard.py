"""A worker's anomaly-guard settings (which detectors run, which act and which only report) and the
per-request OutputFilter built from them (docs/anomaly_guard.md)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.config import ServerConfig
from radixserve.sampling_params import SamplingParams
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.anomaly import KINDS, AnomalyGuard, Detector, GuardConfig
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged
from radixserve.server.filters import Detection, Reporter
from radixserve.server.tracker import ChoiceUpdate

ACTIONS = ("report", "abort")
# --speculative-algorithm values whose draft is trained to predict the target (its own KV, a
# proposal every step): only then is collapsed acceptance evidence enough to act on.
TRAINED_DRAFTS = frozenset({"EAGLE", "EAGLE3", "NEXTN"})


def acceptance_action(flag: str, speculative_algorithm: str | None) -> str:
    """--speculative-anomaly-action resolved: "auto" aborts only with a trained draft."""
    if flag != "auto":
        return flag
    trained = (speculative_algorithm or "").upper() in TRAINED_DRAFTS
    return "abort" if trained else "report"


class GuardFilter:
    """One request's anomaly guard as an OutputFilter: an AnomalyGuard per choice, made on first use;
    detections of `reported` kinds go to `report` with the choice index and do not end the request."""

    def __init__(self, settings: GuardSettings, loops_expected: bool,
                 confidence: ConfidenceConfig | None, reported: frozenset[str],
                 report: Reporter | None = None):
        self.settings = settings
        self.loops_expected = loops_expected
        self.confidence = confidence
        self.reported = reported
        self.report = report
        self._guards: dict[int, AnomalyGuard] = {}

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None:
        guard = self._guards.get(index)
        if guard is None:
            guard = self._guards[index] = self._new_guard(index)
        return guard.feed(update)

    def _new_guard(self, index: int) -> AnomalyGuard:
        extra: list[Detector] = []
        if self.settings.acceptance is not None:
            extra.append(AcceptanceDetector(self.settings.acceptance, self.loops_expected))
        if self.confidence is not None:
            extra.append(ConfidenceDetector(self.confidence))
        report = self.report
        return AnomalyGuard(self.settings.text, extra, loops_expected=self.loops_expected,
                            reported=self.reported,
                            report=None if report is None else lambda found: report(index, found))


@dataclass(frozen=True)
class GuardSettings:
    """A worker's anomaly guard: text thresholds and action, acceptance judge and action, confidence
    judge (None: off; it acts). Whatever the actions, a client-constrained request is only reported."""

    text: GuardConfig = GuardConfig()
    text_action: str = "report"
    acceptance: AcceptanceConfig | None = None
    acceptance_action: str = "report"
    confidence: ConfidenceConfig | None = None

    @classmethod
    def from_config(cls, c: ServerConfig, speculative_algorithm: str | None = None) -> GuardSettings | None:
        """The guard the flags ask for; None with --disable-anomaly-guard. The acceptance detector
        runs whenever `speculative_algorithm` (the engine's) is set."""
        if c.disable_anomaly_guard:
            return None
        acceptance = AcceptanceConfig(
            min_tokens=c.speculative_anomaly_min_tokens,
            min_verify_steps=c.speculative_anomaly_min_verify_steps,
            min_accept_length=c.speculative_anomaly_min_accept_length,
            max_accept_rate=c.speculative_anomaly_max_accept_rate) if speculative_algorithm else None
        confidence = ConfidenceConfig(
            window=c.confidence_window, min_mean_logprob=c.confidence_min_mean_logprob,
            min_drop=c.confidence_min_drop,
            max_temperature=c.confidence_max_temperature) if c.enable_confidence_detector else None
        return cls(GuardConfig(), c.anomaly_guard_action, acceptance,
                   acceptance_action(c.speculative_anomaly_action, speculative_algorithm), confidence)

    def reported_kinds(self, params: SamplingParams) -> frozenset[str]:
        """The detector kinds that only report for a request sampled with `params`."""
        every = frozenset((*KINDS, AcceptanceDetector.kind, ConfidenceDetector.kind))
        if params.client_constrained:
            return every
        reported = set(KINDS) if self.text_action == "report" else set()
        if self.acceptance_action == "report":
            reported.add(AcceptanceDetector.kind)
        return frozenset(reported)

    def filter_for(self, params: SamplingParams,
                   report: Reporter | None = None) -> tuple[GuardFilter, SamplingParams]:
        """One request's guard, and `params` with guard_confidence set when confidence is judged."""
        loops_expected = params.is_greedy or params.grammar is not None
        temperature = 0.0 if params.is_greedy else params.temperature
        confidence = self.confidence
        if confidence is not None and not judged(confidence, temperature, params.grammar is not None):
            confidence = None
        if confidence is not None:
            params = dataclasses.replace(params, guard_confidence=True)
        return GuardFilter(self, loops_expected, confidence, self.reported_kinds(params), report), params
