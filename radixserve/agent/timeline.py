"""The fleet's last hour for the ops page: hit rate, TTFT p99, output anomalies and agent actions per step, kept bounded."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from radixserve.agent import rules
from radixserve.agent.observe import TTFT_BUCKET, WorkerSnapshot


def buckets(snap: WorkerSnapshot, name: str = TTFT_BUCKET) -> dict[float, float]:
    """{upper bound s: cumulative count} of bucket family `name` in one snapshot; empty if not scraped."""
    prefix = name + '{le="'
    return {float(k[len(prefix):-2]): v for k, v in snap.metrics.items() if k.startswith(prefix)}


def bucket_increase(a: WorkerSnapshot, b: WorkerSnapshot) -> dict[float, float] | None:
    """Each TTFT bucket's growth from `a` to `b`; None when missing, mismatched or reset."""
    before, after = buckets(a), buckets(b)
    if not after or before.keys() != after.keys():
        return None
    grown = {le: after[le] - before[le] for le in after}
    return None if any(v < 0 for v in grown.values()) else grown


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts (Prometheus' histogram_quantile); None: no +Inf bucket or counts."""
    bounds = sorted(cumulative)
    if not bounds or not math.isinf(bounds[-1]) or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def window_ttft_quantile(hist: Sequence[WorkerSnapshot], sweeps: int, q: float) -> float | None:
    """TTFT q-quantile (s) of what one worker served over its last `sweeps` sweeps."""
    w = hist[-(sweeps + 1):]
    grown = bucket_increase(w[0], w[-1]) if len(w) >= 2 else None
    return quantile(q, grown) if grown else None


@dataclass(slots=True)
class Point:
    """The fleet's counts in one step starting at `t` (wall-clock s); TTFT bucket growth summed over workers."""

    t: float
    cached: float = 0.0
    prompt: float = 0.0
    anomalies: float = 0.0
    actions: int = 0
    ttft: dict[float, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        return self.cached / self.prompt if self.prompt else None

    @property
    def ttft_p99_s(self) -> float | None:
        return quantile(0.99, self.ttft) if self.ttft else None

    def to_json(self) -> dict:
        p99 = self.ttft_p99_s
        return {"t": self.t, "hit_rate": self.hit_rate,
                "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 1),
                "anomalies": self.anomalies, "actions": self.actions}


class Timeline:
    """One Point per `step_s` over the last `span_s` (sweeps in a step add up): at most span_s / step_s + 1."""

    def __init__(self, span_s: float = 3600.0, step_s: float = 10.0):
        assert span_s > 0 and step_s > 0, "span and step must be positive"
        self.span_s, self.step_s = span_s, step_s
        self._points: deque[Point] = deque(maxlen=int(span_s // step_s) + 1)

    def record(self, now: float, hists: dict[str, list[WorkerSnapshot]], num_actions: int) -> None:
        """Add one sweep at wall-clock `now` (s): worker growth since the previous snapshot, actions."""
        t = now - now % self.step_s
        if not self._points or t > self._points[-1].t:
            self._points.append(Point(t))
        p = self._points[-1]
        p.actions += num_actions
        for hist in hists.values():
            if len(hist) < 2:
                continue
            cached = rules.window_increase(hist, rules.CACHED, 1)
            prompt = rules.window_increase(hist, rules.PROMPT, 1)
            if cached is not None and prompt is not None:
                p.cached, p.prompt = p.cached + cached, p.prompt + prompt
            p.anomalies += rules.window_increase(hist, rules.ANOMALIES, 1) or 0.0
            grown = bucket_increase(hist[-2], hist[-1])
            if grown and (not p.ttft or p.ttft.keys() == grown.keys()):
                p.ttft = {le: p.ttft.get(le, 0.0) + v for le, v in grown.items()}
        self._drop_old(now)

    def points(self, now: float) -> list[Point]:
        self._drop_old(now)
        return list(self._points)

    def to_json(self, now: float) -> list[dict]:
        return [p.to_json() for p in self.points(now)]

    def _drop_old(self, now: float) -> None:
        while self._points and self._points[0].t + self.step_s <= now - self.span_s:
            self._points.popleft()
