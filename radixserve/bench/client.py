"""Streaming OpenAI-compatible client (httpx, async) and the run loop: warm-up, flush, arrivals, concurrency limit, timing."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from radixserve.bench import check
from radixserve.bench.metrics import RequestResult
from radixserve.bench.workload import BenchRequest, Workload, schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where and how to send: backend "completions" or "chat"; ignore_eos is sent only when set."""

    base_url: str
    model: str | None = None
    backend: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 6 * 3600.0
    extra_body: str | None = None  # JSON object merged into each request body
    token_logprobs: bool = False   # top-2 logprobs per token (bench/check.py)


@dataclass(frozen=True, slots=True)
class RunConfig:
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    warmup_requests: int = 1
    flush_cache: bool = False
    seed: int = 1
    progress: bool = True


def headers(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def request_body(cfg: ClientConfig, req: BenchRequest, model: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if cfg.backend == "chat":
        body["messages"] = [dict(m) for m in req.messages]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.extra_body:
        body.update(json.loads(cfg.extra_body))
    if cfg.token_logprobs:
        body.update(check.logprob_fields(cfg.backend))
    return body


def chunk_text(chunk: dict, backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if backend == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(http: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, model: str,
                       max_tokens: int | None = None) -> RequestResult:
    """Send one streaming request and time it: a RequestResult, errors as success=False with `error` (never raised)."""
    path = "/v1/chat/completions" if cfg.backend == "chat" else "/v1/completions"
    max_tokens = req.output_len if max_tokens is None else max_tokens
    result = RequestResult(prompt_len=req.prompt_len)
    texts: list[str] = []
    start = last = time.perf_counter()
    result.start_s = start
    try:
        async with http.stream("POST", path, json=request_body(cfg, req, model, max_tokens)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()  # before parsing: client JSON work is not server time
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if cfg.token_logprobs:
                    for token, gap in check.chunk_tokens(chunk, cfg.backend):
                        result.tokens.append(token)
                        result.top2_gaps.append(gap)
                if text := chunk_text(chunk, cfg.backend):
                    if not texts:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    texts.append(text)
                if usage := chunk.get("usage"):
                    result.output_len = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                    if "spec_verify_steps" in usage:
                        result.spec_verify_steps = int(usage["spec_verify_steps"])
                        result.spec_draft_tokens = int(usage["spec_draft_tokens"])
                        result.spec_accepted_tokens = int(usage["spec_accepted_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    result.generated_text = "".join(texts)
    if result.prompt_tokens is None:  # no usage: SGLang falls back to the requested length
        result.output_len = max_tokens
    result.success = bool(texts) or result.output_len == 0
    if not result.success:
        result.error = "empty stream"
    return result


async def resolve_model(http: httpx.AsyncClient, model: str | None) -> str:
    if model:
        return model
    resp = await http.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def flush_cache(http: httpx.AsyncClient) -> bool:
    """POST /flush_cache; False (logged) when the server has no such route or refuses."""
    resp = await http.post("/flush_cache")
    if resp.status_code != 200:
        logger.warning("flush_cache: HTTP %s (%s)", resp.status_code, resp.text[:200])
    return resp.status_code == 200


def parse_cache_counters(text: str) -> tuple[float, float] | None:
    """(prompt tokens, cached tokens) from radixserve's Prometheus counters; None without them."""
    totals = {"prompt_tokens": 0.0, "cached_tokens": 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("radixserve:"):
            continue
        name, _, rest = line.partition(" ")
        base = name.split("{", 1)[0].removeprefix("radixserve:").removesuffix("_total")
        if base in totals and rest:
            totals[base] += float(rest.split()[0])
            seen = True
    return (totals["prompt_tokens"], totals["cached_tokens"]) if seen else None


async def scrape_cache_counters(http: httpx.AsyncClient) -> tuple[float, float] | None:
    try:
        resp = await http.get("/metrics")
    except httpx.HTTPError as exc:
        logger.info("no /metrics: %s", exc)
        return None
    return parse_cache_counters(resp.text) if resp.status_code == 200 else None


def counter_hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


async def run_workload(workload: Workload, cfg: ClientConfig, run: RunConfig,
                       on_done: Callable[[], None] | None = None
                       ) -> tuple[list[RequestResult], float, float, float | None]:
    """Warm up, optionally flush the prefix cache, then send each session from its offset, its requests
    in order. Returns (results, t0, duration_s, server hit rate over the run or None)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers(cfg), limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as http:
        model = await resolve_model(http, cfg.model)
        requests = workload.requests
        if run.warmup_requests and requests:
            first = requests[0]
            warm = await asyncio.gather(*(send_request(http, cfg, first, model, min(first.output_len, 32))
                                          for _ in range(run.warmup_requests)))
            if not any(r.success for r in warm):
                raise RuntimeError(f"warm-up failed: {warm[0].error}")
        if run.flush_cache:
            await flush_cache(http)
        if run.warmup_requests or run.flush_cache:
            await asyncio.sleep(1.0)
        semaphore = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None
        results: list[RequestResult] = []

        index = {id(req): i for i, req in enumerate(requests)}

        async def one(req: BenchRequest) -> None:
            if semaphore is None:
                result = await send_request(http, cfg, req, model)
            else:
                async with semaphore:  # the timer starts inside: client queueing excluded
                    result = await send_request(http, cfg, req, model)
            result.index = index[id(req)]
            results.append(result)
            if on_done:
                on_done()

        async def session(offset: float, reqs) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            for req in reqs:
                await one(req)

        offsets = schedule(workload, run.request_rate, run.seed)
        before = await scrape_cache_counters(http)
        t0 = time.perf_counter()
        await asyncio.gather(*(session(off, s.requests) for off, s in zip(offsets, workload.sessions)))
        duration = time.perf_counter() - t0
        return results, t0, duration, counter_hit_rate(before, await scrape_cache_counters(http))
