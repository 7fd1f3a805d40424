"""RouterState: everything one router holds, and how it is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from radixserve.drain import Drain
from radixserve.http_common import poller_limits
from radixserve.router.config import RouterConfig
from radixserve.router.health import HealthMonitor
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import Policy, make_policy
from radixserve.router.prefix_tree import ApproxPrefixTree
from radixserve.router.proxy import Forwarder
from radixserve.router.upstream import upstream_transport
from radixserve.router.validate import worker_url
from radixserve.router.worker import WorkerRegistry, WorkerState

MAX_KEEPALIVE_CONNECTIONS = 256


@dataclass
class RouterState:
    """`tokenizer` (or None) keys the prefix tree by token ids."""

    config: RouterConfig
    registry: WorkerRegistry
    tree: ApproxPrefixTree
    policy: Policy
    metrics: RouterMetrics
    http: httpx.AsyncClient
    monitor: HealthMonitor
    forwarder: Forwarder
    drain: Drain
    tokenizer: Any = None
    pd: Any = None          # PD mode (router/pd.py): the fields above are the prefill side

    def add_worker(self, url: str, weight: float = 1.0, healthy: bool = False) -> WorkerState:
        """ValueError for a duplicate or a bad weight."""
        worker = self.registry.add(url, weight, healthy=healthy)
        worker.breaker.on_transition = lambda old, new: self.metrics.on_transition(url, old, new)
        self.metrics.set_breaker_state(url, worker.breaker.state)
        self.monitor.expect_new(url)
        return worker

    def remove_worker(self, url: str) -> WorkerState:
        """Its tree entries go too; KeyError if unknown."""
        worker = self.registry.remove(url)
        self.metrics.forget(url)
        return worker

    def policy_params(self) -> dict:
        return {"policy": self.policy.name, **self.policy.params()}

    def set_policy_params(self, params: dict[str, float]) -> dict:
        self.policy.set_params(**params)
        return self.policy_params()

    def refresh_gauges(self) -> None:
        for w in self.registry.list():
            self.metrics.in_flight.labels(w.url).set(w.in_flight)
            self.metrics.healthy.labels(w.url).set(1 if w.healthy else 0)
            self.metrics.set_breaker_state(w.url, w.breaker.state)


def build_pd_state(config: RouterConfig, prefill_urls: list[str], decode_urls: list[str],
                   tokenizer: Any = None) -> RouterState:
    """A state over the prefill workers whose `pd` pairs it with one over the decode workers."""
    from radixserve.router.pd import PDRouter

    state = build_state(config, prefill_urls, tokenizer)
    state.pd = PDRouter(state, build_state(config, decode_urls, tokenizer))
    return state


def build_state(config: RouterConfig, worker_urls: list[str], tokenizer: Any = None) -> RouterState:
    """ValueError on a malformed URL or a duplicate after canonicalisation."""
    registry = WorkerRegistry(config)
    tree = ApproxPrefixTree(config.max_tree_size, config.tree_ttl_s)
    policy = make_policy(config, registry, tree)
    metrics = RouterMetrics()
    c = config
    transport = upstream_transport()
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=c.connect_timeout_s, read=c.silence_timeout_s,
                              write=c.silence_timeout_s, pool=c.connect_timeout_s),
        limits=poller_limits(max_connections=None,
                             max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS),
        trust_env=False, transport=transport)
    post = transport.poster(c.connect_timeout_s, c.silence_timeout_s) if transport else None
    monitor = HealthMonitor(config, registry, metrics, http)
    state = RouterState(config, registry, tree, policy, metrics, http, monitor,
                        Forwarder(config, registry, policy, metrics, http, post),
                        Drain(config.graceful_shutdown_timeout), tokenizer)
    for url in worker_urls:
        state.add_worker(worker_url(url))
    return state
