"""The agent's HTTP side: /metrics (`radixserve_agent:`), /status (fleet, recent decisions, last hour as JSON), /status.html (the ops page)."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse

from radixserve.agent import rules
from radixserve.agent.agent import Agent
from radixserve.agent.page import status_html
from radixserve.agent.timeline import window_ttft_quantile
from radixserve.http_common import install_error_handlers

logger = logging.getLogger("radixserve.agent")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _mean_ms(hist: list, pair: tuple[str, str], sweeps: int) -> float | None:
    m = rules.window_mean(hist, pair, sweeps)
    return round(m[0] * 1e3, 1) if m else None


def fleet_table(agent: Agent) -> list[dict]:
    """One row per worker: ladder state, `alive` (rules.answering), window hit rate, latencies (ms)."""
    rows = []
    window = agent.rule_cfg.window_sweeps
    snap = agent.last
    hists = agent.history.all()
    for url, track in agent.ladder.tracks.items():
        s = snap.workers.get(url) if snap else None
        router = (s.router if s else None) or {}
        metrics = s.metrics if s else {}
        hist = hists.get(url, [])
        hit = rules.window_hit_rate(hist, window)
        p99 = window_ttft_quantile(hist, window, 0.99)
        rows.append({
            "url": url, "state": track.state, "fault": track.fault,
            "ejections": track.ejections, "health_ok": s.health_ok if s else None,
            "health_error": s.health_error if s else None,
            "alive": rules.answering(hist) if hist else None,
            "router_healthy": router.get("healthy"), "draining": router.get("draining"),
            "drained_by": router.get("drained_by"),
            "breaker": router.get("breaker"), "in_flight": router.get("in_flight"),
            "queue": metrics.get(rules.QUEUE), "token_usage": metrics.get(rules.KV_USAGE),
            "cache_hit_rate": metrics.get("radixserve:cache_hit_rate"),
            "hit_rate": hit[0] if hit else None,
            "ttft_ms": _mean_ms(hist, rules.TTFT, window),
            "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 1),
            "itl_ms": _mean_ms(hist, rules.ITL, window),
            "findings": [f.kind for f in agent.findings if f.url == url]})
    return rows


def status_json(agent: Agent) -> dict:
    """/status's body (also /status.html's); times are wall-clock s since the epoch."""
    last, now = agent.last, agent.wall_clock()
    return {"router": agent.router_url, "sweeps": agent.num_sweeps, "now": now,
            "last_sweep_at": agent.last_sweep_at,
            "sweep_interval_s": agent.cfg.sweep_interval_s, "dry_run": agent.cfg.dry_run,
            "window_s": agent.rule_cfg.window_sweeps * agent.cfg.sweep_interval_s,
            "supervise": agent.cfg.supervise, "panic": agent.ladder.panic,
            "gpu": agent.observer.gpu_note or "not read yet",
            "router_error": last.router_error if last else None,
            "policy": last.policy if last else None,
            "workers": fleet_table(agent), "findings": [f.to_json() for f in agent.findings],
            "recent_decisions": list(agent.recent)[-50:],
            "timeline_span_s": agent.timeline.span_s, "timeline_step_s": agent.timeline.step_s,
            "timeline": agent.timeline.to_json(now)}


def build_app(agent: Agent, run_loop: bool = True) -> FastAPI:
    """The agent's app; with `run_loop` its lifespan runs the sweep loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(agent.run()) if run_loop else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    logger.debug("sweep loop stopped")
            await agent.aclose()

    app = FastAPI(title="radixserve agent", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_error_handlers(app, "agent")
    read = ["GET", "HEAD"]

    @app.api_route("/metrics", methods=read)
    async def metrics() -> Response:
        return Response(agent.metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/status", methods=read)
    async def status() -> Response:
        return JSONResponse(status_json(agent))

    @app.api_route("/status.html", methods=read)
    async def status_page() -> Response:
        return HTMLResponse(status_html(status_json(agent)))

    @app.api_route("/health", methods=read)
    async def health() -> Response:
        return JSONResponse({"status": "ok", "sweeps": agent.num_sweeps})

    return app
