"""Operator routes of one worker: /flush_cache, /abort_request, /get_server_info, /admin/drain, /admin/undrain, /debug/pages and /admin/fault."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from radixserve.config import ServerConfig
from radixserve.drain import Drain
from radixserve.errors import InvalidRequest
from radixserve.server.faults import KIND_PARAMS, FaultInjector, FaultSpec, HangMiddleware
from radixserve.server.inputs import parse_body
from radixserve.server.serving import ServingContext

MAX_ADMIN_BODY_BYTES = 64 << 10


class AbortRequest(BaseModel, extra="forbid"):
    """Body of POST /abort_request: `rid` is the `id` of a completion or chat completion
    (the response body's `id`, or any streamed chunk's); `abort_all` ends every open request."""

    rid: str = ""
    abort_all: bool = False


def install_admin_routes(app: FastAPI, ctx: ServingContext, server_config: ServerConfig,
                         auth: list[Any], drain: Drain) -> None:
    """Add the operator routes (all behind the API key when one is set); /debug/pages only
    with --enable-debug-endpoints, /admin/fault only with --enable-fault-injection."""
    install_drain_routes(app, drain, auth)

    @app.post("/flush_cache", dependencies=auth)
    async def flush_cache() -> Response:
        if not await ctx.client.call("flush_cache"):
            raise InvalidRequest("the cache cannot be flushed while requests are running")
        return JSONResponse({"flushed": True})

    @app.post("/abort_request", dependencies=auth)
    async def abort_request(request: Request) -> Response:
        """End open requests with finish_reason "abort"; an unknown rid is not an error (it
        may have just finished). Returns the ids aborted."""
        body = await parse_body(request, AbortRequest, MAX_ADMIN_BODY_BYTES)
        if not body.abort_all and not body.rid:
            raise InvalidRequest("give a rid or abort_all: true", param="rid")
        runs = list(ctx.runs.values()) if body.abort_all else [ctx.runs.get(body.rid)]
        aborted = []
        for run in runs:
            if run is not None:
                run.abort()
                aborted.append(run.base_id)
        return JSONResponse({"aborted": aborted})

    async def server_info() -> Response:
        """Config, pool usage and hit rate (SGLang's /get_server_info; /server_info too)."""
        return JSONResponse({"model": ctx.model_name, "model_path": ctx.model_path,
                             "max_context_len": ctx.max_context_len,
                             "page_size": ctx.client.info.page_size if ctx.client.info else None,
                             "disaggregation_mode": ctx.client.info.disaggregation_mode,
                             "bootstrap_address": ctx.client.info.bootstrap_address,
                             "num_open_requests": ctx.client.num_open_requests,
                             "max_open_requests": ctx.max_open_requests,
                             "engine_pid": ctx.client.proc.pid,
                             "engine_alive": ctx.client.is_alive,
                             "server_config": dataclasses.asdict(server_config) | {"api_key": None},
                             "engine": await ctx.client.call("stats")})

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"], dependencies=auth)

    if server_config.enable_debug_endpoints:
        app.add_api_route("/debug/pages", _debug_pages(ctx), methods=["GET"], dependencies=auth)
    if server_config.enable_fault_injection:
        ctx.faults = FaultInjector(ctx.client)
        app.add_middleware(HangMiddleware, faults=ctx.faults)
        install_fault_routes(app, ctx.faults, auth)


def install_drain_routes(app: FastAPI, drain: Drain, auth: list[Any]) -> None:
    """POST /admin/drain: admit no new generation (503 `draining`, /health 503 `draining`)
    while those in flight finish; the process keeps running. POST /admin/undrain: admit
    again (400 once SIGTERM has started a shutdown). GET /admin/drain: the state. Each
    answers Drain.to_json()."""

    @app.post("/admin/drain", dependencies=auth)
    async def start_drain() -> Response:
        drain.start("POST /admin/drain")
        return JSONResponse(drain.to_json())

    @app.post("/admin/undrain", dependencies=auth)
    async def undrain() -> Response:
        if not drain.stop():
            raise InvalidRequest("the server is shutting down and cannot admit requests again")
        return JSONResponse(drain.to_json())

    @app.get("/admin/drain", dependencies=auth)
    async def drain_state() -> Response:
        return JSONResponse(drain.to_json())


def _debug_pages(ctx: ServingContext) -> Any:
    async def debug_pages() -> Response:
        """Page pool: free / cached (evictable) / in use, and whether the ownership
        invariant (free + cached + private == total) holds right now."""
        try:
            await ctx.client.call("check_invariants")
            invariant, error = True, None
        except RuntimeError as exc:
            invariant, error = False, str(exc)
        stats = await ctx.client.call("stats")
        in_use = stats["num_pages"] - stats["num_free_pages"] - stats["num_evictable_pages"]
        return JSONResponse({
            "num_pages": stats["num_pages"], "page_size": stats["page_size"],
            "num_free_pages": stats["num_free_pages"],
            "num_cached_pages": stats["num_cached_pages"],
            "num_evictable_pages": stats["num_evictable_pages"],
            "num_in_use_pages": in_use,
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
            **({"host_num_pages": stats["hicache_host_pages"],
                "host_num_used_pages": stats["hicache_host_used_pages"],
                "host_num_loads_in_flight": stats["hicache_loads_in_flight"]}
               if "hicache_host_pages" in stats else {}),
            "invariant_holds": invariant, "invariant_error": error})
    return debug_pages


def install_fault_routes(app: FastAPI, faults: FaultInjector, auth: list[Any]) -> None:
    """POST /admin/fault starts a fault (body: FaultSpec) and returns it; GET lists the
    active ones; DELETE clears all, or one with ?kind=. Replies {"faults": [...]} /
    {"cleared": [kinds]}; each fault is {"kind", its params, "duration_s", "elapsed_s",
    "remaining_s"}. These routes keep answering during a hang."""

    @app.post("/admin/fault", dependencies=auth)
    async def inject_fault(request: Request) -> Response:
        spec = await parse_body(request, FaultSpec, MAX_ADMIN_BODY_BYTES)
        fault = await faults.inject(spec)
        return JSONResponse({"fault": fault.to_json(time.monotonic())})

    @app.get("/admin/fault", dependencies=auth)
    async def list_faults() -> Response:
        now = time.monotonic()
        return JSONResponse({"faults": [f.to_json(now) for f in faults.active()]})

    @app.delete("/admin/fault", dependencies=auth)
    async def clear_faults(kind: str | None = None) -> Response:
        if kind is not None and kind not in KIND_PARAMS:
            raise InvalidRequest(f"unknown fault kind {kind!r}", param="kind")
        return JSONResponse({"cleared": await faults.clear(kind)})
