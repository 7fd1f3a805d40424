"""A fake router and fake workers for the agent's tests (httpx.MockTransport): the router's admin API, each worker's /health, /metrics and /get_server_info, and optional traffic counted by the worker's own metrics code."""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx

from radixserve.agent.agent import Agent
from radixserve.agent.config import AgentConfig
from radixserve.server.anomaly import KINDS as ANOMALY_KINDS
from radixserve.server.metrics import ServerMetrics

ROUTER = "http://router"
URLS = ["http://w0", "http://w1", "http://w2"]
METRICS = ("# TYPE radixserve:num_requests counter\n"
           "radixserve:num_requests_total{model_name=\"m\"} 5.0\n")


class Traffic:
    """One fake worker's load. Each /metrics read serves one sweep more of it: `requests`
    requests of `prompt_len` tokens, hit rate swinging around `hit_rate`, TTFTs of `ttft_s`
    with one request in ten four times slower, an output anomaly every `anomaly_every`
    reads (0: never). Counted and rendered by the worker's own ServerMetrics, so the text,
    histogram buckets included, is what a worker sends."""

    def __init__(self, ttft_s: float = 0.08, requests: int = 20, prompt_len: int = 200,
                 hit_rate: float = 0.6, anomaly_every: int = 0):
        self.ttft_s, self.requests, self.prompt_len = ttft_s, requests, prompt_len
        self.hit_rate, self.anomaly_every = hit_rate, anomaly_every
        self.metrics = ServerMetrics("m")
        self.reads = 0
        self.stats = {"num_running": 0, "num_waiting": 1, "token_usage": 0.25,
                      "cache_hit_rate": 0.0, "num_prompt_tokens": 0, "num_generated_tokens": 0,
                      "num_cached_tokens": 0, "num_aborted_requests": 0, "num_preemptions": 0,
                      "num_finished_requests": 0, "spec_num_verify_steps": 0,
                      "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0}

    def read(self) -> str:
        self.reads += 1
        s = self.stats
        for i in range(self.requests):
            self.metrics.ttft.observe(self.ttft_s * (4 if i % 10 == 0 else 1))
        prompt = self.requests * self.prompt_len
        hit = self.hit_rate * (1.0 + 0.2 * math.sin(self.reads / 8))
        s["num_prompt_tokens"] += prompt
        s["num_cached_tokens"] += int(prompt * min(hit, 1.0))
        s["num_generated_tokens"] += 16 * self.requests
        s["num_finished_requests"] += self.requests
        s["cache_hit_rate"] = s["num_cached_tokens"] / s["num_prompt_tokens"]
        if self.anomaly_every and self.reads % self.anomaly_every == 0:
            self.metrics.count_detection(ANOMALY_KINDS[0], "abort")
        return self.metrics.render(s).decode()


class FakeFleet:
    """Answers the router's admin API and each worker's reads; `hung` workers time out,
    `busy` ones only on /health; a worker with `traffic` serves its growing counters, the
    others a fixed /metrics."""

    def __init__(self, hung: set[str], urls: list[str] | None = None,
                 traffic: dict[str, Traffic] | None = None, busy: set[str] = frozenset()):
        self.hung, self.busy = hung, busy
        self.traffic = traffic or {}
        self.urls = urls or URLS
        self.router_down = False
        self.draining: set[str] = set()     # drained by the operator unless in by_agent
        self.by_agent: set[str] = set()
        self.posts: list[tuple[str, dict]] = []

    def entry(self, url: str) -> dict:
        drained = url in self.draining
        return {"url": url, "healthy": url not in self.hung, "draining": drained,
                "drained_by": ("agent" if url in self.by_agent else "operator") if drained else None,
                "in_flight": 0, "breaker": "closed", "num_requests": 10, "num_failures": 0}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base, path = f"{request.url.scheme}://{request.url.host}", request.url.path
        if not request.url.host:   # what httpx's real transport says to "http:"
            raise httpx.UnsupportedProtocol("Request URL is missing a host", request=request)
        if base == ROUTER:
            if self.router_down:
                raise httpx.ReadTimeout("", request=request)   # httpx gives no message
            if request.method == "POST":
                body = json.loads(request.content)
                self.posts.append((path, body))
                if path == "/admin/drain":
                    if body.get("by") != "agent":         # the router's rule: the operator's
                        self.by_agent.discard(body["url"])   # drain wins, the agent's never does
                    elif body["url"] not in self.draining:
                        self.by_agent.add(body["url"])
                    self.draining.add(body["url"])
                if path == "/admin/undrain":
                    if body.get("by") == "agent" and body["url"] in self.draining - self.by_agent:
                        return httpx.Response(409, json={"error": {"type": "conflict_error"}})
                    self.draining.discard(body["url"])
                    self.by_agent.discard(body["url"])
                return httpx.Response(200, json=self.entry(body["url"]))
            if path == "/admin/policy":
                return httpx.Response(200, json={"policy": "cache_aware", "cache_threshold": 0.3})
            return httpx.Response(200, json={"workers": [self.entry(u) for u in self.urls]})
        if base in self.hung or (base in self.busy and path == "/health"):
            raise httpx.ReadTimeout("hung", request=request)
        if path == "/metrics":
            load = self.traffic.get(base)
            return httpx.Response(200, text=load.read() if load else METRICS)
        if path == "/get_server_info":
            return httpx.Response(200, json={"engine_pid": 1234, "engine": {}})
        return httpx.Response(200, json={"status": "ok"})


def make_agent(tmp_path, fake: FakeFleet, wall_clock=None, ladder_cfg=None, **cfg) -> Agent:
    """An agent over `fake`, its decisions logged to tmp_path/d.jsonl."""
    agent = Agent(ROUTER, AgentConfig(decision_log=str(tmp_path / "d.jsonl"), **cfg),
                  ladder_cfg=ladder_cfg, **({"wall_clock": wall_clock} if wall_clock else {}))
    transport = httpx.MockTransport(fake)
    agent.admin.http = httpx.AsyncClient(transport=transport, base_url=ROUTER)
    agent.observer.http = httpx.AsyncClient(transport=transport)
    return agent


def sweeps(agent: Agent, n: int, between=None) -> list[dict]:
    """`n` sweeps (calling `between(k)` after sweep k = 0, 1, ...), then the agent's clients
    closed; the decision records."""
    async def go():
        out = []
        for k in range(n):
            out += await agent.sweep()
            if between:
                between(k)
        await agent.aclose()
        return out
    return asyncio.run(go())


HUNG = "http://w1"


def drained_fleet(tmp_path, sweeps_before: int = 40, sweeps_after: int = 30):
    """An agent after a run over three workers with traffic (w2 slower, with an output
    anomaly every 7th sweep) on a wall clock 20 s per sweep, ending now: after
    `sweeps_before` sweeps `HUNG` stops answering and the agent isolates it (drains it at the
    router). Returns the agent (clients closed) and the fake fleet."""
    clock = [time.time() - 20.0 * (sweeps_before + sweeps_after)]
    fake = FakeFleet(hung=set(), traffic={"http://w0": Traffic(), HUNG: Traffic(),
                                          "http://w2": Traffic(ttft_s=0.2, anomaly_every=7)})

    def tick(k: int) -> None:
        clock[0] += 20.0
        if k == sweeps_before - 1:
            fake.hung.add(HUNG)
    agent = make_agent(tmp_path, fake, wall_clock=lambda: clock[0], sweep_interval_s=20.0)
    sweeps(agent, sweeps_before + sweeps_after, tick)
    return agent, fake


def assert_shows_the_isolation(view) -> dict[str, list[str]]:
    """What a person sees of `drained_fleet()` on the page (`view`: page_view.PageView, from
    the server's HTML or a browser's DOM): the tiles, every worker's row, the hung worker out
    of rotation with its fault. Returns the rows by worker URL."""
    assert view.tiles == {"Workers": "3", "Healthy": "2/3", "In rotation": "2/3",
                          "Draining": "0", "Out of rotation": "1", "Panic": "no"}
    assert f"{HUNG}: isolated (hung)" in view.text
    rows = {r[0]: r for r in view.rows if r and r[0] in URLS}
    assert set(rows) == set(URLS)
    assert rows[HUNG][1:4] == ["isolated · hung · ejected 1×", "timeout", "out"]
    return rows
