"""ConfidenceDetector: a sustained collapse of the model's own confidence as an output-anomaly signal.

Why: KV corrupted with noise (a late write, a read before the load finished) turns the rest of
an answer into fluent-looking word salad: no replacement characters, no mixed scripts, no loop,
so the text detectors see nothing, and with n-gram drafts speculative acceptance sees little
(docs/anomaly_guard.md). The model itself can no longer predict its next token: the largest
raw logprob at each position (`TokenLogprob.top_logprob`, the model's confidence, whatever
token was then sampled) stays low for many tokens in a row, well below where it was at the
start of the same answer. Ordinary answers have low-confidence stretches too (names, numbers,
list items), but short ones, and some answers are unsure throughout (a small model
translating into Japanese): so the rule is judged over a window of tokens and against the
answer's own start.

    baseline = mean confidence of the first `baseline_tokens` generated tokens
    once the baseline is complete, over every window of the last `window` tokens:
      mean < `min_mean_logprob` and mean < baseline - `min_drop`  -> "low_confidence"

Corruption present from the first token (a wrong prompt KV) lowers the baseline too and is
seen only where the answer's start was still confident.

Only greedy and low-temperature choices (temperature <= `max_temperature`) are judged: at a
high temperature the sampled text itself drifts where the model is unsure, which is what the
client asked for. Grammar-constrained choices are not judged either (the grammar may force
tokens the model did not expect). Thresholds were set on the default model's ordinary answers;
docs/anomaly_guard.md has the measured detection and false-positive rates. No algorithm is
borrowed; the signal is the per-token confidence that every serving engine computes for
logprobs anyway (vLLM, SGLang), used here as a sliding-window rule.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from radixserve.server.anomaly import Detection
from radixserve.server.tracker import ChoiceUpdate


@dataclass(frozen=True)
class ConfidenceConfig:
    """Thresholds (flags --confidence-*). Logprobs are natural logs."""

    window: int = 32                 # tokens per judged window
    min_mean_logprob: float = -1.4   # window mean of the top logprob below this ...
    min_drop: float = 0.6            # ... and this far below the baseline: anomaly
    baseline_tokens: int = 16        # the answer's first tokens, whose mean is the baseline
    max_temperature: float = 0.8     # choices sampled hotter than this are not judged


def judged(config: ConfidenceConfig, temperature: float, constrained: bool) -> bool:
    """Whether a choice at `temperature` (0 = greedy) is watched (module doc)."""
    return temperature <= config.max_temperature and not constrained


class ConfidenceDetector:
    """One choice's confidence judge (the `Detector` protocol of anomaly.py). O(1) per token:
    a running sum over a ring of the last `window` confidences; NaN (no confidence for that
    token, e.g. a PD first token sampled on the prefill worker) is skipped."""

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
