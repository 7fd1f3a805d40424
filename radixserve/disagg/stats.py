"""PD counters and latency histograms (rendered by server/pd_metrics.py; meanings in docs/disaggregation.md)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)

COUNTERS = ("transfer_bytes",
            "transfers_succeeded",
            "transfers_failed",
            "transfers_aborted",
            "late_writes_refused",
            "late_writes_landed",
            "bootstrap_failures")


@dataclass(slots=True)
class Histogram:
    """Prometheus semantics: counts[i] = observations <= buckets[i] (seconds); +Inf is `count`."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value_s: float) -> None:
        for i in range(bisect.bisect_left(self.buckets, value_s), len(self.buckets)):
            self.counts[i] += 1
        self.sum += value_s
        self.count += 1

    def to_json(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


@dataclass(slots=True)
class PDStats:
    """One side's numbers; to_json() is stats()["pd"], every key present from start-up."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    transfer_latency: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))

    def to_json(self, mode: str, gauges: dict[str, int]) -> dict:
        return {"mode": mode, **self.counters, **gauges,
                "transfer_latency_s": self.transfer_latency.to_json(),
                "queue_time_s": self.queue_time.to_json()}


def empty_stats(mode: str) -> dict:
    """The stats block of an engine that is not disaggregated (metrics present at 0)."""
    return PDStats().to_json(mode, {"num_bootstrapping": 0, "num_waiting_for_kv": 0,
                                    "num_quarantined_pages": 0})
