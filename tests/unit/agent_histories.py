"""Synthetic worker histories for the agent's rule and ladder tests: counters built sweep by sweep, with noise."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from radixserve.agent.observe import WorkerSnapshot

P = "radixserve:"
MIB = 1024 * 1024


@dataclass
class Load:
    """What one worker does in one sweep (5 s); rates are per sweep, latencies in s."""

    requests: float = 20.0
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_request: float = 16.0
    prompt_len: float = 200.0
    hit_rate: float = 0.6
    failures: float = 0.0
    anomalies: float = 0.0
    preemptions: float = 0.0
    queue: float = 1.0
    token_usage: float = 0.3
    rss_mb: float = 300.0
    health_ok: bool = True
    health_error: str = "timeout"        # when not health_ok
    metrics_answer: bool = False         # /metrics still answers while /health does not
    breaker: str = "closed"
    extra: dict = field(default_factory=dict)


class WorkerSim:
    """Cumulative counters of one worker; `sweep(load)` returns its next snapshot. `jitter`
    multiplies every rate and latency by U[1-j, 1+j] (ordinary noise)."""

    def __init__(self, url: str, seed: int = 0, jitter: float = 0.3, sweep_s: float = 5.0):
        self.url, self.rng, self.jitter, self.sweep_s = url, random.Random(seed), jitter, sweep_s
        self.t = 0.0
        self.m: dict[str, float] = {}
        self.router = {"num_requests": 0.0, "num_failures": 0.0}

    def _j(self, x: float) -> float:
        return x * (1 + self.rng.uniform(-self.jitter, self.jitter))

    def _add(self, key: str, x: float) -> None:
        self.m[key] = self.m.get(key, 0.0) + x

    def sweep(self, load: Load) -> WorkerSnapshot:
        self.t += self.sweep_s
        reqs = round(self._j(load.requests))
        tokens = reqs * load.tokens_per_request
        self._add(P + "num_requests_total", reqs)
        self._add(P + "time_to_first_token_seconds_count", reqs)
        self._add(P + "time_to_first_token_seconds_sum", reqs * self._j(load.ttft_s))
        self._add(P + "inter_token_latency_seconds_count", tokens)
        self._add(P + "inter_token_latency_seconds_sum", tokens * self._j(load.itl_s))
        self._add(P + "generation_tokens_total", tokens)
        prompt = reqs * self._j(load.prompt_len)
        self._add(P + "prompt_tokens_total", prompt)
        self._add(P + "cached_tokens_total", prompt * min(self._j(load.hit_rate), 1.0))
        self._add(P + "num_preempted_reqs_total", load.preemptions)
        self._add(P + "num_anomalies_total", load.anomalies)
        self.m[P + "num_queue_reqs"] = load.queue
        self.m[P + "token_usage"] = load.token_usage
        self.m["process_resident_memory_bytes"] = load.rss_mb * MIB + \
            self.rng.uniform(-1, 1) * MIB
        self.router["num_requests"] += reqs
        self.router["num_failures"] += load.failures
        self.m.update(load.extra)
        router = dict(self.router, url=self.url, breaker=load.breaker)
        if not load.health_ok:
            metrics = dict(self.m) if load.metrics_answer else {}
            return WorkerSnapshot(self.url, self.t, False, load.health_error, metrics, None, router)
        return WorkerSnapshot(self.url, self.t, True, None, dict(self.m), {}, router)


def history(url: str, loads: list[Load], seed: int = 0, jitter: float = 0.3) -> list[WorkerSnapshot]:
    sim = WorkerSim(url, seed, jitter)
    return [sim.sweep(load) for load in loads]


def fleet(n_workers: int, n_sweeps: int, seed: int = 0, jitter: float = 0.3,
          special: dict[int, callable] | None = None) -> dict[str, list[WorkerSnapshot]]:
    """`n_workers` noisy workers; `special[i](sweep) -> Load` overrides worker i."""
    out = {}
    for i in range(n_workers):
        url = f"http://w{i}"
        make = (special or {}).get(i, lambda k: Load())
        out[url] = history(url, [make(k) for k in range(n_sweeps)], seed=seed * 100 + i,
                           jitter=jitter)
    return out
