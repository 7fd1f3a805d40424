"""AcceptanceDetector: speculative-decoding acceptance as an output-anomaly signal.

Why (GLM's serving team, ../shared/research/sglang.md §5): when a request's KV is corrupted the
target model stops agreeing with its draft, so the accept length collapses; a repetition loop
makes the draft right every time, so the accept rate approaches 1. Their rule, ours by default:

    after `min_tokens` generated tokens (128), with at least `min_verify_steps` verify steps:
      accept length (tokens per verify step) < `min_accept_length` (1.4)  -> "spec_acceptance"
      accept rate (accepted / draft tokens)   > `max_accept_rate`   (0.96) -> "spec_acceptance"
                                                 (sampled choices only, as for repetition)

Both are judged over the request's whole output so far (cumulative counts from the engine,
`GuardInput.spec`). With n-gram drafts (the only algorithm today) a request drafts only
where its last tokens occurred before, so prose verifies rarely; the verify-step minimum keeps
such requests from being judged on a handful of steps. docs/anomaly_guard.md has the measured
detection and false-positive rates of this rule next to the text detectors.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixserve.outputs import SpecCounts
from radixserve.server.anomaly import Detection, GuardInput


@dataclass(frozen=True)
class AcceptanceConfig:
    """Thresholds (flags --spec-anomaly-*). A threshold of 0 (min length) or 1 (max rate)
    turns that half of the GLM rule off; collapse_window 0 turns the collapse rule off."""

    min_tokens: int = 128            # generated tokens before the GLM rule judges
    min_verify_steps: int = 16       # ... and verify steps
    min_accept_length: float = 1.4   # tokens per verify step below this: corrupted KV
    max_accept_rate: float = 0.96    # accepted / draft tokens above this: a loop
    collapse_window: int = 4         # collapse rule: the last this many verify steps ...
    collapse_to: float = 0.0         # ... accepted at most this share of their drafts ...
    collapse_from: float = 0.6       # ... after at least as many earlier ones accepted this share


class AcceptanceDetector:
    """One choice's acceptance judge (the `Detector` protocol of anomaly.py).

    Two rules. The GLM rule over the whole output (module doc). The collapse rule over the
    request's own history: its drafts were being accepted (earlier verify steps: accept rate >=
    collapse_from) and then stopped (the last collapse_window steps: <= collapse_to). An n-gram
    request whose drafts fail drafts less and less (engine/speculative.py), so the GLM rule's
    cumulative accept length of a request corrupted mid-way stays high; the collapse rule sees
    the change.
    """

    kind = "spec_acceptance"

    def __init__(self, config: AcceptanceConfig, greedy: bool = False):
        """`greedy`: the choice decodes greedily, so the high-rate half (a loop) is not judged,
        for the repetition detector's reason (anomaly.AnomalyGuard): a greedy loop is the
        model's own answer, the same on any worker a retry would go to."""
        self.config = config
        self.greedy = greedy
        self.num_tokens = 0
        self._last = SpecCounts()
        self._steps: list[tuple[int, int]] = []     # (draft, accepted) per verify step or run of them

    def feed(self, delta: GuardInput) -> Detection | None:
        self.num_tokens += len(delta.token_ids)
        spec, cfg = delta.spec, self.config
        if spec is None:
            return None
        step = spec - self._last
        if step.verify_steps > 0:
            self._steps.append((step.draft_tokens, step.accepted_tokens))
            self._last = spec
        return self._glm_rule(spec) or self._collapse_rule()

    def _glm_rule(self, spec: SpecCounts) -> Detection | None:
        cfg = self.config
        if self.num_tokens < cfg.min_tokens or spec.verify_steps < cfg.min_verify_steps:
            return None
        if spec.accept_length < cfg.min_accept_length:
            return Detection(self.kind, f"accept length {spec.accept_length:.2f} < "
                                        f"{cfg.min_accept_length} over {spec.verify_steps} verify "
                                        f"steps and {self.num_tokens} tokens")
        if not self.greedy and spec.accept_rate > cfg.max_accept_rate:
            return Detection(self.kind, f"accept rate {spec.accept_rate:.3f} > "
                                        f"{cfg.max_accept_rate} ({spec.accepted_tokens} of "
                                        f"{spec.draft_tokens} draft tokens)")
        return None

    def _collapse_rule(self) -> Detection | None:
        w, steps = self.config.collapse_window, self._steps
        if w <= 0 or len(steps) < 2 * w:
            return None
        before, recent = _rate(steps[:-w]), _rate(steps[-w:])
        if before >= self.config.collapse_from and recent <= self.config.collapse_to:
            return Detection(self.kind, f"draft acceptance collapsed from {before:.2f} over "
                                        f"{len(steps) - w} verify steps to {recent:.2f} over the "
                                        f"last {w}")
        return None


def _rate(steps: list[tuple[int, int]]) -> float:
    drafted = sum(d for d, _ in steps)
    return sum(a for _, a in steps) / drafted if drafted else 0.0
