"""AcceptanceDetector: speculative-decoding acceptance as an output-anomaly signal (GLM serving team's rule).

Over the choice's cumulative SpecCounts, with SGLang's definitions (outputs.SpecCounts):
    accept length = tokens emitted per verify step, the bonus token counted
    accept rate   = accepted drafts / proposed drafts

After `min_tokens` tokens and `min_verify_steps` verify steps: accept length < `min_accept_length` (corrupted KV) or,
sampled choices only, accept rate > `max_accept_rate` (a loop). Acting: anomaly.py; rates: docs/anomaly_guard.md."""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.server.filters import Detection
from radixserve.server.tracker import ChoiceUpdate


@dataclass(frozen=True)
class AcceptanceConfig:
    """Flags --speculative-anomaly-*; GLM's numbers. 0 (min length) or 1 (max rate) turns that half off."""

    min_tokens: int = 128
    min_verify_steps: int = 16
    min_accept_length: float = 1.4   # tokens per verify step
    max_accept_rate: float = 0.96    # accepted / proposed drafts


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
            return Detection(self.kind, f"accept length {spec.accept_length:.2f} tokens per verify "
                                        f"step < {cfg.min_accept_length} over {spec.verify_steps} "
                                        f"verify steps and {self.num_tokens} tokens")
        if not self.loops_expected and spec.accept_rate > cfg.max_accept_rate:
            return Detection(self.kind, f"accept rate {spec.accept_rate:.3f} > "
                                        f"{cfg.max_accept_rate} ({spec.accepted_tokens} of "
                                        f"{spec.draft_tokens} proposed drafts accepted)")
        return None
