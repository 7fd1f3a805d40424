"""AcceptanceDetector: speculative-decoding acceptance as an output-anomaly signal (GLM serving team's rule).

Over cumulative counts: accept length < `min_accept_length` (corrupted KV) or, sampled choices only,
accept rate > `max_accept_rate` (a loop). Rates: docs/anomaly_guard.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.server.filters import Detection
from radixserve.server.tracker import ChoiceUpdate


@dataclass(frozen=True)
class AcceptanceConfig:
    """Flags --spec-anomaly-*; 0 (min length) or 1 (max rate) turns that half off."""

    min_tokens: int = 128
    min_verify_steps: int = 16
    min_accept_length: float = 1.4   # tokens per verify step
    max_accept_rate: float = 0.96    # accepted / draft tokens


class AcceptanceDetector:
    """One choice's judge (anomaly.Detector); `loops_expected` (greedy or grammar) skips the rate half."""

    kind = "spec_acceptance"

    def __init__(self, config: AcceptanceConfig, loops_expected: bool = False):
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
