"""The agent's own Prometheus metrics (`radixserve_agent:` prefix), in a registry of its own."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.agent.ladder import ACTING, ACTIONS
from radixserve.agent.rules import FINDING_KINDS

PREFIX = "radixserve_agent:"
STATES = ("observe", "suspect", "draining", "restarted", "isolated", "reintegrating")


class _StateCollector(Collector):
    """Gauges from `state()` -> {"workers": {url: state}, "panic": bool, "gpu_checks": bool}."""

    def __init__(self, state: Callable[[], dict]):
        self.state = state

    def collect(self) -> Iterator[Any]:
        s = self.state()
        g = GaugeMetricFamily(PREFIX + "worker_state", "1 for the ladder state each worker is "
                              "in.", labels=["worker", "state"])
        for url, current in s["workers"].items():
            for name in STATES:
                g.add_metric([url, name], 1.0 if name == current else 0.0)
        yield g
        out = sum(v in ("draining", "restarted", "isolated") for v in s["workers"].values())
        yield GaugeMetricFamily(PREFIX + "workers_out_of_rotation", "Workers drained, "
                                "restarting or isolated by the agent.", value=out)
        yield GaugeMetricFamily(PREFIX + "panic", "1 while fewer than the panic share of "
                                "workers answer /health.", value=float(s["panic"]))
        yield GaugeMetricFamily(PREFIX + "gpu_checks", "1 when NVML readings are taken.",
                                value=float(s["gpu_checks"]))


class AgentMetrics:
    """Counters the loop updates, each action and finding kind at 0 from the start (so increase() sees the first)."""

    def __init__(self, state: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(state))
        self.sweeps = Counter(PREFIX + "sweeps", "Sweeps done.", registry=self.registry)
        self.sweep_s = Histogram(PREFIX + "sweep_duration_seconds", "Time of one sweep "
                                 "(reads, rules, actions).", registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self.decisions = Counter(PREFIX + "decisions", "Decisions, by action (none included).",
                                 ["action"], registry=self.registry)
        self.failed = Counter(PREFIX + "actions_failed", "Actions that raised, by action.",
                              ["action"], registry=self.registry)
        self.findings = Counter(PREFIX + "findings", "Findings per sweep, by kind.", ["kind"],
                                registry=self.registry)
        for counter, labels in ((self.decisions, ACTIONS), (self.failed, ACTING),
                                (self.findings, FINDING_KINDS)):
            for label in labels:
                counter.labels(label)

    def render(self) -> bytes:
        return generate_latest(self.registry)
