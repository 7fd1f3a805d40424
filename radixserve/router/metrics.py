"""Router Prometheus metrics (`radixserve_router:` prefix) in a registry of their own."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE

from radixserve.errors import OUTPUT_ANOMALY_KINDS

logger = logging.getLogger(__name__)

PREFIX = "radixserve_router:"
BREAKER_STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}
# exported at 0 from the start: a series first seen at 1 shows no increase() in Prometheus
MIGRATION_OUTCOMES = ("success", "exhausted", "refused", "unsupported")
ANOMALY_ACTIONS = ("retried", "ended", "exhausted")   # output_anomalies_total{action}
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                         0.1, 0.25, 0.5, 1.0, 2.5)

__all__ = ["CONTENT_TYPE", "RouterMetrics", "BREAKER_STATE_VALUES"]


class RouterMetrics:
    """The SMG gateway's metric set, in a CollectorRegistry per router app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests_total", "Attempts sent to workers, by outcome "
                                "(success, client_error, backpressure, failure, transport_error)",
                                ["worker", "outcome"], registry=r)
        self.retries = Counter(PREFIX + "retries_total", "Attempts after the first", registry=r)
        self.retries_exhausted = Counter(PREFIX + "retries_exhausted_total",
                                         "Requests that failed on every attempt they were allowed",
                                         registry=r)
        self.breaker_state = Gauge(PREFIX + "breaker_state",
                                   "Circuit breaker state: 0 closed, 1 half_open, 2 open",
                                   ["worker"], registry=r)
        self.breaker_transitions = Counter(PREFIX + "breaker_transitions_total",
                                           "Circuit breaker state changes",
                                           ["worker", "from_state", "to_state"], registry=r)
        self.health_checks = Counter(PREFIX + "health_checks_total",
                                     "Active health checks by result (pass, fail, draining)",
                                     ["worker", "result"], registry=r)
        self.in_flight = Gauge(PREFIX + "in_flight", "Requests dispatched and not yet finished",
                               ["worker"], registry=r)
        self.healthy = Gauge(PREFIX + "worker_healthy", "1 if the worker passes health checks",
                             ["worker"], registry=r)
        self.routing_decisions = Counter(PREFIX + "routing_decisions_total",
                                         "Policy decisions by reason (prefix_hit, load_fallback, "
                                         "imbalance, ...)", ["reason"], registry=r)
        self.added_latency = Histogram(PREFIX + "added_latency_seconds",
                                       "Router time from a request's arrival to its first "
                                       "upstream send: parsing, routing key, policy (s)",
                                       buckets=ADDED_LATENCY_BUCKETS, registry=r)
        self.migrations = Counter(PREFIX + "stream_migrations_total",
                                  "Streams cut after their first content, by what followed: "
                                  "success (continued on another worker), exhausted (no worker "
                                  "or attempt left), refused (the continuation was answered "
                                  "with an error), unsupported (the stream cannot be continued)",
                                  ["outcome"], registry=r)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        self.anomalies = Counter(PREFIX + "output_anomalies_total",
                                 "Worker answers that were output anomalies (error type "
                                 "output_anomaly), by detector and what followed: retried (sent "
                                 "again from the prompt to another worker), ended (a stream past "
                                 "its first content: ended with the error event, never continued "
                                 "from the suspect tokens), exhausted (no worker or attempt left)",
                                 ["kind", "action"], registry=r)
        for kind in OUTPUT_ANOMALY_KINDS:
            for action in ANOMALY_ACTIONS:
                self.anomalies.labels(kind, action)
        self.no_worker = Counter(PREFIX + "no_worker_available_total",
                                 "Requests answered 503 because no worker was routable",
                                 registry=r)

    def set_breaker_state(self, worker: str, state: str) -> None:
        self.breaker_state.labels(worker).set(BREAKER_STATE_VALUES.get(state, 0))

    def on_transition(self, worker: str, from_state: str, to_state: str) -> None:
        self.breaker_transitions.labels(worker, from_state, to_state).inc()
        self.set_breaker_state(worker, to_state)

    def forget(self, worker: str) -> None:
        """Drop a removed worker's gauges; counters keep their history."""
        for gauge in (self.breaker_state, self.in_flight, self.healthy):
            try:
                gauge.remove(worker)
            except KeyError:
                logger.debug("no %s sample for %s", gauge._name, worker)

    def render(self) -> bytes:
        return generate_latest(self.registry)
