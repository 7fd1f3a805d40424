"""benchmarks/spec_anomaly.py's accounting, scaled down: synthetic traces through its summary, so the study's
counts (false positives, corrupted and detected per corruption mode, tokens from the hit to detection) are what
the acceptance detector's replay says, for every mode including stale and read-before-ready."""
from __future__ import annotations

from benchmarks.spec_anomaly import MODES, summarize
from radixserve.server.acceptance_guard import AcceptanceConfig
from radixserve.server.confidence_guard import ConfidenceConfig


def trace(accepted_per_step: list[int], mode: str | None = None, hit_at: int | None = None, greedy: bool = True):
    """A greedy trace: one delta per verify step (1 + accepted tokens, cumulative counts with 3 drafts a step)."""
    deltas, steps, drafted, accepted, tokens = [], 0, 0, 0, []
    for n in accepted_per_step:
        steps, drafted, accepted = steps + 1, drafted + 3, accepted + n
        ids = [len(tokens) + j for j in range(1 + n)]
        tokens += ids
        deltas.append([" ".join(f"w{i}" for i in ids) + " ", ids, [steps, drafted, accepted], []])
    return {"category": "chat", "greedy": greedy, "temperature": 0.0, "deltas": deltas, "tokens": tokens,
            "hit_at": hit_at, "mode": mode}


def test_every_mode_is_counted_and_only_collapsed_acceptance_is_detected():
    normal = [trace([2] * 60), trace([1] * 80)]                  # accept length 3.0 and 2.0: no detection
    clean, faulted = [], []
    for mode in MODES:
        clean.append(trace([2] * 60))
        collapsed = trace([2] * 6 + [0] * 150, mode, hit_at=0 if mode == "ready" else 16)
        faulted.append(collapsed)
    clean.append(trace([2] * 60))
    faulted.append(dict(trace([2] * 60), mode="noise", hit_at=16))   # hit, output unchanged: not corrupted
    out = summarize(normal, clean, faulted, AcceptanceConfig(), ConfidenceConfig())
    assert out["num_corrupted"] == len(MODES) and set(MODES) >= {"noise", "swap", "stale", "ready"}
    assert out["num_corrupted_by_mode"] == {m: 1 for m in MODES}
    acc = out["acceptance"]
    assert acc["false_positives"] == 0 and acc["detected_by_mode"] == {m: 1 for m in MODES}
    # 18 tokens before the collapse, then one a step: accept length < 1.4 once the 128-token minimum is reached
    assert acc["tokens_to_detection_median"] >= 128 - 16
