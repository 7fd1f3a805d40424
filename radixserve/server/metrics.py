"""Prometheus metrics of one worker (`GET /metrics`), named after SGLang's with a `radixserve:` prefix.

Engine counters come from `Engine.stats()` per engine request (n choices count n times); latencies are observed here."""
from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.errors import OUTPUT_ANOMALY_KINDS
from radixserve.outputs import EngineOutput, SpecCounts
from radixserve.server.pd_metrics import PDCollector

PREFIX = "radixserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds in seconds (SGLang's ranges, fewer buckets).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 400)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2, 4, 8)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300, 600, 1200, 2400)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0, 9.0, 17.0)
ACCEPT_RATE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.96, 0.99, 1.0)
DETECTION_ACTIONS = ("abort", "report")
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3000)

ENGINE_GAUGES = (
    ("num_running_reqs", "num_running", "Requests in the running batch."),
    ("num_queue_reqs", "num_waiting", "Requests waiting for admission."),
    ("token_usage", "token_usage", "Fraction of KV pages held by requests (not free, not evictable)."),
    ("cache_hit_rate", "cache_hit_rate", "Cached prompt tokens / prompt tokens, cumulative."),
)
ENGINE_COUNTERS = (
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens of finished and aborted requests."),
    ("generation_tokens", "num_generated_tokens", "Tokens generated."),
    ("cached_tokens", "num_cached_tokens", "Prompt tokens served from the prefix cache."),
    ("num_aborted_requests", "num_aborted_requests", "Requests aborted before they finished."),
    ("num_preempted_reqs", "num_preemptions", "Preemptions (KV released, request recomputed later)."),
    ("spec_verify_steps", "spec_num_verify_steps", "Speculative decoding: verify steps (one per request and step)."),
    ("spec_draft_tokens", "spec_num_draft_tokens", "Speculative decoding: draft tokens proposed."),
    ("spec_accepted_tokens", "spec_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
)

# Host KV tier (engine/hicache.py); 0 when the tier is off.
HICACHE_COUNTERS = (
    ("cached_tokens_host", "num_cached_tokens_host", "Prompt tokens served from the prefix cache "
     "whose KV was loaded back from the host tier (part of cached_tokens)."),
    ("cached_tokens_device", "num_cached_tokens_device", "Prompt tokens served from the prefix "
     "cache already on the device (part of cached_tokens)."),
    ("hicache_loads", "hicache_loads", "Host KV tier: host->device loads started."),
    ("hicache_load_pages", "hicache_load_pages", "Host KV tier: pages loaded host->device."),
    ("hicache_load_bytes", "hicache_load_bytes", "Host KV tier: bytes loaded host->device."),
    ("hicache_load_seconds", "hicache_load_seconds", "Host KV tier: wall seconds of finished loads, summed."),
    ("hicache_failed_loads", "hicache_failed_loads", "Host KV tier: loads that failed (recomputed)."),
    ("hicache_partial_loads", "hicache_partial_loads", "Host KV tier: loads of only the head of a "
     "host match, the rest left for a later match (device pages short)."),
    ("hicache_backup_pages", "hicache_backup_pages", "Host KV tier: pages copied device->host."),
    ("hicache_backup_bytes", "hicache_backup_bytes", "Host KV tier: bytes copied device->host."),
    ("hicache_host_evicted_pages", "hicache_host_evicted_pages", "Host KV tier: host pages evicted."),
    ("hicache_host_alloc_failures", "hicache_host_alloc_failures",
     "Host KV tier: host page allocations refused (copy skipped)."),
)
HICACHE_GAUGES = (
    ("hicache_host_usage", "hicache_host_usage", "Host KV tier: fraction of host pages in use."),
    ("hicache_host_pages", "hicache_host_pages", "Host KV tier: host pages in all (0: tier off)."),
)

# Acceptance by draft position (1 = the first draft token of a verify step).
SPEC_BY_POSITION = (
    ("spec_draft_tokens_by_position", "spec_num_draft_by_position",
     "Speculative decoding: draft tokens proposed, by position in the draft."),
    ("spec_accepted_tokens_by_position", "spec_num_accepted_by_position",
     "Speculative decoding: draft tokens accepted, by position in the draft."),
)


class EngineCollector(Collector):
    """Renders the last engine stats snapshot; `update(stats)` before each scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict[str, Any] = {}
        self._last: tuple[float, int] | None = None   # (time, generated tokens)
        self.gen_throughput = 0.0

    def update(self, stats: dict[str, Any]) -> None:
        now, generated = time.monotonic(), int(stats.get("num_generated_tokens", 0))
        if self._last is not None and now > self._last[0]:
            self.gen_throughput = max(generated - self._last[1], 0) / (now - self._last[0])
        self._last = (now, generated)
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        if not self.stats:
            return
        labels = ["model_name"]
        for name, key, doc in ENGINE_GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self.model_name], float(self.stats[key]))
            yield g
        g = GaugeMetricFamily(PREFIX + "gen_throughput", "Generated tokens per second since the "
                              "previous scrape.", labels=labels)
        g.add_metric([self.model_name], self.gen_throughput)
        yield g
        for name, key, doc in ENGINE_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([self.model_name], float(self.stats[key]))
            yield c
        for family, rows in ((CounterMetricFamily, HICACHE_COUNTERS), (GaugeMetricFamily, HICACHE_GAUGES)):
            for name, key, doc in rows:
                m = family(PREFIX + name, doc, labels=labels)
                m.add_metric([self.model_name], float(self.stats.get(key, 0)))
                yield m
        for name, key, doc in SPEC_BY_POSITION:
            c = CounterMetricFamily(PREFIX + name, doc, labels=[*labels, "position"])
            for i, value in enumerate(self.stats.get(key, ())):
                c.add_metric([self.model_name, str(i + 1)], float(value))
            yield c
        compiled = self.stats.get("runner", {}).get("compile", {})
        g = GaugeMetricFamily(PREFIX + "compile_graphs", "--compile: decode graphs compiled or loaded "
                              "(0: decoding eagerly).", labels=labels)
        g.add_metric([self.model_name], float(compiled.get("graphs", 0)))
        yield g
        c = CounterMetricFamily(PREFIX + "compile_recompiles", "--compile: decode graphs compiled after "
                                "start-up's warm-up (0 in steady state).", labels=labels)
        c.add_metric([self.model_name], float(compiled.get("recompiles", 0)))
        yield c
        c = CounterMetricFamily(PREFIX + "num_requests", "Requests finished or aborted.",
                                labels=labels)
        c.add_metric([self.model_name], float(self.stats["num_finished_requests"]
                                              + self.stats["num_aborted_requests"]))
        yield c


class ServerMetrics:
    """All metrics of one worker, in a registry of its own (no process-wide globals)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        self.registry.register(PDCollector(model_name, self.engine))

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            h = Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                          buckets=buckets)
            return h.labels(model_name=model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Interval between deltas divided by the tokens they carry.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Arrival to last output, aborted and failed requests included.", E2E_BUCKETS)
        self.queue_time = hist("queue_time_seconds", "Arrival in the engine to first admission.",
                               QUEUE_BUCKETS)
        self.spec_accept_length = hist("spec_accept_length", "Speculative decoding, per request: "
                                       "tokens per verify step.", ACCEPT_LENGTH_BUCKETS)
        self.spec_accept_rate = hist("spec_accept_rate", "Speculative decoding, per request: "
                                     "accepted / draft tokens.", ACCEPT_RATE_BUCKETS)
        self.model_name = model_name
        self.anomalies = Counter(PREFIX + "num_anomalies", "Requests stopped by the output-anomaly "
                                 "guard, by detector.", ["model_name", "kind"], registry=self.registry)
        self.detections = Counter(PREFIX + "anomaly_detections", "Output-anomaly detections by "
                                  "detector and action: abort (the request was stopped) or report "
                                  "(counted and logged only).", ["model_name", "kind", "action"],
                                  registry=self.registry)
        for kind in OUTPUT_ANOMALY_KINDS:
            self.anomalies.labels(model_name=model_name, kind=kind)
            for action in DETECTION_ACTIONS:
                self.detections.labels(model_name=model_name, kind=kind, action=action)
        ProcessCollector(registry=self.registry)

    def count_detection(self, kind: str, action: str) -> None:
        """`action`: "abort" (also counted in num_anomalies) or "report"."""
        self.detections.labels(model_name=self.model_name, kind=kind, action=action).inc()
        if action == "abort":
            self.anomalies.labels(model_name=self.model_name, kind=kind).inc()

    def render(self, stats: dict[str, Any] | None) -> bytes:
        """Prometheus text format; `stats` is Engine.stats() (None when the engine is gone)."""
        if stats is not None:
            self.engine.update(stats)
        return generate_latest(self.registry)


class RequestTimer:

    __slots__ = ("metrics", "start_s", "last_s", "queue_seen")

    def __init__(self, metrics: ServerMetrics, start_s: float):
        self.metrics = metrics
        self.start_s = start_s
        self.last_s: float | None = None
        self.queue_seen = False

    def on_output(self, num_new_tokens: int, queue_time_s: float | None) -> None:
        if queue_time_s is not None and not self.queue_seen:
            self.queue_seen = True
            self.metrics.queue_time.observe(queue_time_s)
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_s is None:
            self.metrics.ttft.observe(now - self.start_s)
        else:
            self.metrics.itl.observe((now - self.last_s) / num_new_tokens)
        self.last_s = now

    def on_end(self, spec: SpecCounts | None = None) -> None:
        """`spec`: None when the request never verified."""
        self.metrics.e2e.observe(time.monotonic() - self.start_s)
        if spec is not None and spec.verify_steps:
            self.metrics.spec_accept_length.observe(spec.accept_length)
            if spec.draft_tokens:
                self.metrics.spec_accept_rate.observe(spec.accept_rate)


class RunTimers:
    """The RequestTimers of one run's engine requests, started at submit; `metrics` None: none."""

    def __init__(self, metrics: ServerMetrics | None, request_ids: list[str]):
        start_s = time.monotonic()
        self._timers = ({} if metrics is None else
                        {rid: RequestTimer(metrics, start_s) for rid in request_ids})

    def on_output(self, out: EngineOutput) -> None:
        timer = self._timers.get(out.request_id)
        if timer is not None:
            timer.on_output(len(out.new_token_ids), out.queue_time_s)
            if out.finished:
                timer.on_end(out.spec)
                del self._timers[out.request_id]

    def close(self) -> None:
        """End the unfinished ones: each is still one e2e sample."""
        for timer in self._timers.values():
            timer.on_end()
        self._timers.clear()

    def discard(self) -> None:
        """The engine rejected the run: no latency sample."""
        self._timers.clear()
