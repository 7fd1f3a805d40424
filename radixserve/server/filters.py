"""Output filters: what every choice update of a request passes before it is sent (the corrupt fault, the anomaly guard)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from radixserve.sampling_params import SamplingParams
from radixserve.server.acceptance_guard import AcceptanceConfig, AcceptanceDetector
from radixserve.server.anomaly import AnomalyGuard, Detection, Detector, GuardConfig
from radixserve.server.confidence_guard import ConfidenceConfig, ConfidenceDetector, judged
from radixserve.tokenizer.output_processor import ChoiceUpdate


class OutputFilter(Protocol):
    """One request's filter over all its choices, built per request. `feed` gets every
    non-empty update of choice `index` (numbered over the request) in order, before it is
    sent or kept; it may replace `update.text`. A Detection ends the request."""

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None: ...


class GuardFilter:
    """The output-anomaly guard as an OutputFilter: one AnomalyGuard per choice, made by
    `make_guard` on the choice's first update."""

    def __init__(self, make_guard: Callable[[], AnomalyGuard]):
        self._make_guard = make_guard
        self._guards: dict[int, AnomalyGuard] = {}

    def feed(self, index: int, update: ChoiceUpdate) -> Detection | None:
        guard = self._guards.get(index)
        if guard is None:
            guard = self._guards[index] = self._make_guard()
        return guard.feed(update)


def guard_filter(config: GuardConfig, acceptance: AcceptanceConfig | None,
                 confidence: ConfidenceConfig | None,
                 params: SamplingParams) -> tuple[GuardFilter, SamplingParams]:
    """The guard of one request with `params`: the text detectors, plus the acceptance and
    confidence judges when configured; and `params` as it needs them (the confidence judge,
    when it watches this request, asks the engine for each token's confidence). Greedy and
    grammar-constrained requests expect loops (AnomalyGuard's `loops_expected`)."""
    loops_expected = params.is_greedy or params.grammar is not None
    temperature = 0.0 if params.is_greedy else params.temperature
    watched = confidence is not None and judged(confidence, temperature, params.grammar is not None)
    if watched:
        params = dataclasses.replace(params, guard_confidence=True)

    def make_guard() -> AnomalyGuard:
        extra: list[Detector] = []
        if acceptance is not None:
            extra.append(AcceptanceDetector(acceptance, loops_expected))
        if watched:
            assert confidence is not None, "watched implies a confidence config"
            extra.append(ConfidenceDetector(confidence))
        return AnomalyGuard(config, extra, loops_expected=loops_expected)
    return GuardFilter(make_guard), params
