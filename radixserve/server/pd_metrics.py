"""Prometheus metrics of prefill/decode disaggregation, rendered from Engine.stats()["pd"] (present at 0 on every worker from start-up)."""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from radixserve.disagg.stats import empty_stats

PREFIX = "radixserve:"

COUNTERS = (
    ("pd_transfer_bytes", "transfer_bytes", "KV bytes sent (prefill) or landed (decode)."),
    ("pd_late_writes_refused", "late_writes_refused", "KV writes for a room already acked or "
     "unknown that were refused: never started (prefill) or never landed (decode)."),
    ("pd_late_writes_landed", "late_writes_landed", "KV writes landed in pages of no room "
     "(only with the test-only --disaggregation-unsafe-skip-abort-handshake)."),
    ("pd_bootstrap_failures", "bootstrap_failures", "Requests refused by the bootstrap handler "
     "(KV layout mismatch, handler failure)."),
)
GAUGES = (
    ("pd_num_bootstrapping", "num_bootstrapping", "Requests waiting for their other leg "
     "(prefill) or for pages to preallocate (decode)."),
    ("pd_num_waiting_for_kv", "num_waiting_for_kv", "Decode requests in WAITING_FOR_KV."),
    ("pd_num_quarantined_pages", "num_quarantined_pages", "Decode pages of ended transfers "
     "held until the prefill side answers safe-to-free."),
)
HISTOGRAMS = (
    ("pd_transfer_latency_seconds", "transfer_latency_s", "Decode: preallocation (Expect sent) "
     "to the last write and the first token landed."),
    ("pd_queue_time_seconds", "queue_time_s", "Prefill: both legs here to admission; decode: "
     "arrival to pages preallocated."),
)


class PDCollector(Collector):
    """Renders the `pd` block of the engine stats the EngineCollector last took."""

    def __init__(self, model_name: str, engine_collector: Any):
        self.model_name = model_name
        self.engine = engine_collector

    def collect(self) -> Iterator[Any]:
        pd = self.engine.stats.get("pd") or empty_stats("null")
        labels, values = ["model_name", "mode"], [self.model_name, pd["mode"]]
        for name, key, doc in COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(values, float(pd[key]))
            yield c
        c = CounterMetricFamily(PREFIX + "pd_transfers", "Transfers ended, by outcome.",
                                labels=[*labels, "outcome"])
        for outcome in ("succeeded", "failed", "aborted"):
            c.add_metric([*values, outcome], float(pd[f"transfers_{outcome}"]))
        yield c
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(values, float(pd.get(key, 0)))
            yield g
        for name, key, doc in HISTOGRAMS:
            h = pd[key]
            buckets = [(str(b), float(n)) for b, n in zip(h["buckets"], h["counts"])]
            buckets.append(("+Inf", float(h["count"])))
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            fam.add_metric(values, buckets, h["sum"])
            yield fam
