"""Output filters: what every choice update of a request passes before it is sent (the corrupt fault, the anomaly guard)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from radixserve.config import ServerConfig
from radixserve.sampling_params import SamplingParams
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.anomaly import AnomalyGuard, Detection, Detector, GuardConfig
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged
from radixserve.server.tracker import ChoiceUpdate


class OutputFilter(Protocol):
    """Fed each non-empty update of choice `index` before it is sent; may replace its text; a Detection ends it."""

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None: ...


class GuardFilter:
    """One AnomalyGuard per choice, made on first use."""

    def __init__(self, make_guard: Callable[[], AnomalyGuard]):
        self._make_guard = make_guard
        self._guards: dict[int, AnomalyGuard] = {}

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None:
        guard = self._guards.get(index)
        if guard is None:
            guard = self._guards[index] = self._make_guard()
        return guard.feed(update)


@dataclass(frozen=True)
class GuardSettings:
    """A worker's anomaly guard: text thresholds, acceptance and confidence judges (None: off)."""

    text: GuardConfig = GuardConfig()
    acceptance: AcceptanceConfig | None = None
    confidence: ConfidenceConfig | None = None

    @classmethod
    def from_config(cls, c: ServerConfig) -> GuardSettings | None:
        """The guard the flags ask for; None with --disable-anomaly-guard."""
        if c.disable_anomaly_guard:
            return None
        acceptance = AcceptanceConfig(
            min_tokens=c.spec_anomaly_min_tokens, min_verify_steps=c.spec_anomaly_min_verify_steps,
            min_accept_length=c.spec_anomaly_min_accept_length,
            max_accept_rate=c.spec_anomaly_max_accept_rate) if c.enable_spec_anomaly_detector else None
        confidence = ConfidenceConfig(
            window=c.confidence_window, min_mean_logprob=c.confidence_min_mean_logprob,
            min_drop=c.confidence_min_drop,
            max_temperature=c.confidence_max_temperature) if c.enable_confidence_detector else None
        return cls(GuardConfig(), acceptance, confidence)

    def filter_for(self, params: SamplingParams) -> tuple[GuardFilter, SamplingParams]:
        """One request's guard, and `params` with guard_confidence set when confidence is judged."""
        loops_expected = params.is_greedy or params.grammar is not None
        temperature = 0.0 if params.is_greedy else params.temperature
        confidence = self.confidence
        if confidence is not None and not judged(confidence, temperature, params.grammar is not None):
            confidence = None
        if confidence is not None:
            params = dataclasses.replace(params, guard_confidence=True)

        def make_guard() -> AnomalyGuard:
            extra: list[Detector] = []
            if self.acceptance is not None:
                extra.append(AcceptanceDetector(self.acceptance, loops_expected))
            if confidence is not None:
                extra.append(ConfidenceDetector(confidence))
            return AnomalyGuard(self.text, extra, loops_expected=loops_expected)
        return GuardFilter(make_guard), params
