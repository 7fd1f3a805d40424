"""Operator routes of one worker: /flush_cache, /abort_request, /get_server_info, /start_profile, /stop_profile, /admin/drain, /admin/undrain, /debug/pages and /admin/fault."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from radixserve.chaos.http_faults import KIND_PARAMS, FaultInjector, FaultSpec, HangMiddleware
from radixserve.drain import Drain
from radixserve.errors import InvalidRequest
from radixserve.server.serving import ServingContext, parse_body
from radixserve.server_config import ServerConfig

MAX_ADMIN_BODY_BYTES = 64 << 10


class AbortRequest(BaseModel, extra="forbid"):
    """Body of POST /abort_request: `rid` is a response's or chunk's `id`."""

    rid: str = ""
    abort_all: bool = False


class StartProfile(BaseModel, extra="forbid"):
    """Body of POST /start_profile (optional): stop by itself after `num_steps` engine steps."""

    num_steps: int | None = None


def install_admin_routes(app: FastAPI, ctx: ServingContext, server_config: ServerConfig,
                         auth: list[Any], drain: Drain) -> None:
    """The operator routes, behind the API key; debug and fault routes only when their flags are set."""
    install_drain_routes(app, drain, auth)

    @app.post("/flush_cache", dependencies=auth)
    async def flush_cache() -> Response:
        if not await ctx.client.call("flush_cache"):
            raise InvalidRequest("the cache cannot be flushed while requests are running")
        return JSONResponse({"flushed": True})

    @app.post("/abort_request", dependencies=auth)
    async def abort_request(request: Request) -> Response:
        """Abort open requests (an unknown rid is no error); returns the ids aborted."""
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

    @app.post("/start_profile", dependencies=auth)
    async def start_profile(request: Request) -> Response:
        """Start a torch profiler trace of the engine (400 without --torch-profiler-dir)."""
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        body = await parse_body(request, StartProfile, MAX_ADMIN_BODY_BYTES) if has_body else StartProfile()
        return JSONResponse(await ctx.client.call("profile", args={"action": "start",
                                                                   "num_steps": body.num_steps}))

    @app.post("/stop_profile", dependencies=auth)
    async def stop_profile() -> Response:
        """Stop the trace and write it; returns {"trace": path, "num_steps": steps recorded}."""
        return JSONResponse(await ctx.client.call("profile", args={"action": "stop"}))

    async def server_info() -> Response:
        """Config, pool usage and hit rate (as SGLang's /get_server_info)."""
        return JSONResponse({"model": ctx.model_name, "model_path": ctx.model_path,
                             "max_context_len": ctx.max_context_len,
                             "page_size": ctx.client.info.page_size if ctx.client.info else None,
                             "disaggregation_mode": ctx.client.info.disaggregation_mode,
                             "bootstrap_address": ctx.client.info.bootstrap_address,
                             "num_open_requests": ctx.client.num_open_requests,
                             "max_open_requests": ctx.max_open_requests,
                             "engine_pid": ctx.client.proc.pid,
                             "instance_id": ctx.instance_id,
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
    """POST /admin/drain (new work 503 `draining`), POST /admin/undrain (400 after SIGTERM), GET: Drain.to_json()."""

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
        """Page pool counts and whether free + cached + private == total holds."""
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
    """/admin/fault: POST a FaultSpec, GET the active faults, DELETE all or ?kind=; they answer during a hang."""

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
