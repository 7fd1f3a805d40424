"""Snapshots of a fleet: each worker's /health, /metrics, /get_server_info and the router's view, kept as short histories."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.http_common import fresh_client, poller_limits, send_resending_once
from radixserve.router.client import AsyncRouterAdminClient

logger = logging.getLogger("radixserve.agent")

PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. Count: one two three"

#: What one read of one worker may raise (httpx.InvalidURL is not an httpx.HTTPError).
READ_ERRORS = (httpx.HTTPError, httpx.InvalidURL)


def describe(exc: BaseException) -> str:
    """An exception as "Type: message", never empty (a ReadTimeout's message often is)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else repr(exc)


@dataclass(frozen=True, slots=True)
class Probe:
    """One greedy request sent to the worker and a routable peer at once; latencies in s (None: failed)."""

    latency_s: float | None
    peer_url: str | None
    peer_latency_s: float | None


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One sweep's view of a worker; `t` monotonic s; `metrics` as parse_metrics (empty: scrape failed)."""

    url: str
    t: float
    health_ok: bool
    health_error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict | None = None
    router: dict | None = None
    probe: Probe | None = None


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """One sweep: every worker the router lists, its policy, GPU readings (None without NVML)."""

    t: float
    workers: dict[str, WorkerSnapshot]
    router_error: str | None = None
    policy: dict | None = None
    gpus: list[dict] | None = None


TTFT_BUCKET = "radixserve:time_to_first_token_seconds_bucket"


def bucket_key(name: str, le: str) -> str:
    return f'{name}{{le="{le}"}}'


def parse_metrics(text: str, kept_buckets: tuple[str, ...] = (TTFT_BUCKET,)) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}, buckets only of `kept_buckets`
    (as `bucket_key(name, le)`). Raises ValueError on text the parser rejects."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_bucket") and name in kept_buckets and "le" in sample.labels:
                name = bucket_key(name, sample.labels["le"])
            elif name.endswith("_bucket") or name.endswith("_created"):
                continue
            out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def router_entries(listing: Any) -> list[dict]:
    """The router's /admin/workers list; ValueError when not a list; entries without a "url" skipped."""
    if not isinstance(listing, list):
        raise ValueError(f"/admin/workers is not a list: {type(listing).__name__}")
    entries = [e for e in listing if isinstance(e, dict) and isinstance(e.get("url"), str)]
    if len(entries) < len(listing):
        logger.warning("skipped %d malformed /admin/workers entries", len(listing) - len(entries))
    return entries


class History:
    """The last `maxlen` snapshots of each worker, oldest first."""

    def __init__(self, maxlen: int):
        self.maxlen = maxlen
        self._by_url: dict[str, deque[WorkerSnapshot]] = {}

    def add(self, fleet: FleetSnapshot) -> None:
        for url in list(self._by_url):
            if url not in fleet.workers:
                del self._by_url[url]
        for url, snap in fleet.workers.items():
            self._by_url.setdefault(url, deque(maxlen=self.maxlen)).append(snap)

    def reset(self, url: str) -> None:
        """Forget a worker's past (after a restart or a return)."""
        self._by_url.pop(url, None)

    def of(self, url: str) -> list[WorkerSnapshot]:
        return list(self._by_url.get(url, ()))

    def all(self) -> dict[str, list[WorkerSnapshot]]:
        return {url: list(snaps) for url, snaps in self._by_url.items()}


class Observer:
    """Reads a fleet once per sweep, each read within `timeout_s`; a worker not answering is recorded,
    never raised; a read failing on a dead pooled connection is sent once more."""

    def __init__(self, admin: AsyncRouterAdminClient, timeout_s: float,
                 worker_api_key: str | None = None):
        self.admin = admin
        headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=poller_limits())
        self.fresh_http = fresh_client()
        self.gpu_note = ""
        self._nvml_absent = False

    async def collect(self, probe_urls: set[str] | None = None,
                      probe_timeout_s: float = 30.0, probe_max_tokens: int = 16) -> FleetSnapshot:
        try:
            entries = router_entries(await self.admin.list_workers())
            policy = await self.admin.get_policy()
        except Exception as exc:  # router down: recorded, not raised
            reason = describe(exc)
            logger.warning("router view unavailable: %s", reason)
            return FleetSnapshot(time.monotonic(), {}, router_error=reason)
        probe_urls = probe_urls or set()
        routable = [e["url"] for e in entries
                    if e.get("healthy") and not e.get("draining") and e["url"] not in probe_urls]
        probes = {url: self.probe(url, routable[0] if routable else None, probe_timeout_s,
                                  probe_max_tokens) for url in probe_urls}
        snaps = await asyncio.gather(*(self._isolated(e, probes.pop(e["url"], None))
                                       for e in entries))
        for leftover in probes.values():
            leftover.close()
        return FleetSnapshot(time.monotonic(), {s.url: s for s in snaps},
                             policy=policy if isinstance(policy, dict) else None,
                             gpus=self.read_gpus())

    async def _isolated(self, entry: dict, probe: Any) -> WorkerSnapshot:
        """`worker`, an error recorded as the worker not answering instead of aborting the sweep."""
        try:
            return await self.worker(entry, probe)
        except Exception as exc:
            logger.warning("%s: unreadable this sweep", entry["url"], exc_info=True)
            return WorkerSnapshot(entry["url"], time.monotonic(), False,
                                  f"unreadable: {describe(exc)}", router=entry)

    async def worker(self, entry: dict, probe: Any = None) -> WorkerSnapshot:
        url = entry["url"].rstrip("/")
        health, metrics, info, probed = await asyncio.gather(
            self._get(url + "/health"), self._get(url + "/metrics"),
            self._get(url + "/get_server_info"), probe if probe is not None else _none())
        ok = isinstance(health, httpx.Response) and (health.status_code == 200 or _is_alive_503(health))
        error = None if ok else (f"status {health.status_code}"
                                 if isinstance(health, httpx.Response) else health)
        parsed: dict[str, float] = {}
        if isinstance(metrics, httpx.Response) and metrics.status_code == 200:
            try:
                parsed = parse_metrics(metrics.text)
            except ValueError as exc:
                logger.warning("%s: unparsable /metrics: %s", url, exc)
        info_json = None
        if isinstance(info, httpx.Response) and info.status_code == 200:
            try:
                info_json = info.json()
            except ValueError as exc:
                logger.warning("%s: /get_server_info is not JSON: %s", url, exc)
            if info_json is not None and not isinstance(info_json, dict):
                logger.warning("%s: /get_server_info is not a JSON object", url)
                info_json = None
        return WorkerSnapshot(entry["url"], time.monotonic(), ok, error, parsed, info_json,
                              entry, probed)

    async def _get(self, url: str) -> httpx.Response | str:
        try:
            return await send_resending_once(self.http, self.fresh_http, "GET", url)
        except httpx.TimeoutException:
            return "timeout"
        except READ_ERRORS as exc:
            return describe(exc)

    async def probe(self, url: str, peer: str | None, timeout_s: float,
                    max_tokens: int) -> Probe:
        """Send the same greedy completion to `url` and `peer` at once (s, None on failure)."""
        mine, theirs = await asyncio.gather(
            self._timed(url, timeout_s, max_tokens),
            self._timed(peer, timeout_s, max_tokens) if peer else _none())
        return Probe(mine, peer, theirs)

    async def _timed(self, url: str, timeout_s: float, max_tokens: int) -> float | None:
        body = {"prompt": PROBE_PROMPT, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        t0 = time.monotonic()
        try:
            r = await send_resending_once(self.http, self.fresh_http, "POST",
                                          url.rstrip("/") + "/v1/completions", json=body,
                                          timeout=timeout_s)
        except READ_ERRORS as exc:
            logger.info("probe of %s failed: %s", url, describe(exc))
            return None
        return time.monotonic() - t0 if r.status_code == 200 else None

    def read_gpus(self) -> list[dict] | None:
        from radixserve.agent.gpu import read_nvml
        if self._nvml_absent:
            return None
        readings, self.gpu_note = read_nvml()
        self._nvml_absent = "not installed" in self.gpu_note
        return readings

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.fresh_http.aclose()


async def _none() -> None:
    return None


def _is_alive_503(health: httpx.Response) -> bool:
    """A 503 /health that is `degraded` (all slots busy) or `draining`: alive, not sick."""
    if health.status_code != 503:
        return False
    try:
        body = health.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") in ("degraded", "draining")
