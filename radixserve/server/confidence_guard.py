"""ConfidenceDetector: a sustained drop of the model's top logprob as an output-anomaly signal.

    baseline = mean top logprob of the first `baseline_tokens` tokens; then over each last `window`:
      mean < `min_mean_logprob` and mean < baseline - `min_drop`  -> "low_confidence"
Judged only at temperature <= `max_temperature` and without a grammar. Rationale, rates: docs/anomaly_guard.md."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from radixserve.server.filters import Detection
from radixserve.server.tracker import ChoiceUpdate


@dataclass(frozen=True)
class ConfidenceConfig:
    """Thresholds (flags --confidence-*). Logprobs are natural logs."""

    window: int = 32
    min_mean_logprob: float = -1.4
    min_drop: float = 0.6
    baseline_tokens: int = 16
    max_temperature: float = 0.8


def judged(config: ConfidenceConfig, temperature: float, constrained: bool) -> bool:
    """Whether a choice at `temperature` (0 = greedy) is watched."""
    return temperature <= config.max_temperature and not constrained


class ConfidenceDetector:
    """One choice's judge (anomaly.Detector), O(1) per token; NaN confidences (e.g. a PD first token) are skipped."""

    kind = "low_confidence"

    def __init__(self, config: ConfidenceConfig):
        self.config = config
        self.num_tokens = 0
        self._window: deque[float] = deque()
        self._sum = 0.0
        self._baseline_sum = 0.0

    def feed(self, update: ChoiceUpdate) -> Detection | None:
        cfg = self.config
        for value in update.confidences:
            if math.isnan(value):
                continue
            self.num_tokens += 1
            if self.num_tokens <= cfg.baseline_tokens:
                self._baseline_sum += value
            self._window.append(value)
            self._sum += value
            if len(self._window) > cfg.window:
                self._sum -= self._window.popleft()
            if self.num_tokens >= cfg.baseline_tokens and len(self._window) == cfg.window:
                mean, baseline = self._sum / cfg.window, self._baseline_sum / cfg.baseline_tokens
                if mean < cfg.min_mean_logprob and mean < baseline - cfg.min_drop:
                    return Detection(self.kind, f"mean top logprob {mean:.2f} over the last {cfg.window} "
                                                f"tokens (token {self.num_tokens}) < {cfg.min_mean_logprob}, "
                                                f"and {baseline - mean:.2f} below the answer's first "
                                                f"{cfg.baseline_tokens} tokens")
        return None
