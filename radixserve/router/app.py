"""The router's FastAPI app: OpenAI routes relayed to workers, GETs from a healthy worker, /health, /metrics, admin."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, AsyncIterator
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve.drain import DrainMiddleware
from radixserve.errors import InvalidRequest, ModelNotFound, error_body
from radixserve.http_common import (BodyTimeoutMiddleware, check_json_content_type, install_error_handlers,
                                    race_disconnect, read_body)
from radixserve.router.admin import build_admin_router
from radixserve.router.metrics import CONTENT_TYPE
from radixserve.router.policy import RouteKey
from radixserve.router.proxy import UNREACHABLE
from radixserve.router.relay import wire_header
from radixserve.router.state import RouterState
from radixserve.router.validate import json_object

logger = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
GET_FORWARDED_HEADERS = ("authorization", "accept", "x-request-id")


def render_messages(messages: Any) -> str:
    """Chat messages as routing text (role and content); malformed parts contribute nothing."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and isinstance(p.get("text"), str))
        out.append(f"{m.get('role')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(out)


def route_key(path: str, body: dict, tokenizer: Any, session: str | None) -> RouteKey:
    """The (first) prompt or the chat template as token ids when possible, else as text."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(type(i) is int for i in prompt):
            return RouteKey(prompt, session)
        if not isinstance(prompt, str):
            return RouteKey("", session)
        return RouteKey(tokenizer.encode(prompt) if tokenizer else prompt, session)
    messages = body.get("messages")
    if tokenizer is not None:
        try:
            return RouteKey(tokenizer.apply_chat_template(messages), session)
        except InvalidRequest as exc:  # the worker answers the same 400
            logger.debug("chat not tokenizable (%s); routing by text", exc)
    return RouteKey(render_messages(messages), session)


def lifespan_of(state: RouterState) -> Any:
    """One health sweep before serving, then the monitor loops; shutdown stops them and closes clients."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.config.admin_api_key is None:
            logger.warning("no --admin-api-key: the /admin routes are open to anyone")
        monitors = [state.monitor] + ([state.pd.decode.monitor] if state.pd is not None else [])
        for monitor in monitors:
            await monitor.check_all()
            monitor.start()
        try:
            yield
        finally:
            for monitor in monitors:
                await monitor.stop()
            await state.http.aclose()
            if state.pd is not None:
                await state.pd.decode.http.aclose()
    return lifespan


def build_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="radixserve router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan_of(state))
    app.state.router = state
    install_error_handlers(app, "router")
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=state.config.request_body_timeout)
    app.add_middleware(DrainMiddleware, drain=state.drain)

    async def relay_post(request: Request, path: str) -> Response:
        t_start = time.perf_counter()
        check_json_content_type(request)   # as the worker: before the body is read
        raw = await read_body(request, state.config.max_request_body_bytes)
        body = json_object(raw)
        session = request.headers.get(state.config.session_header) or body.get("user")
        session = session if isinstance(session, str) else None
        if state.tokenizer is None:
            key = route_key(path, body, None, session)
        else:
            key = await asyncio.to_thread(route_key, path, body, state.tokenizer, session)
        headers = forwarded_headers(request, FORWARDED_HEADERS)
        if state.pd is not None:
            return await race_disconnect(request.receive, state.pd.forward(
                path, body, headers, key, body.get("stream") is True))
        work = state.forwarder.forward(path, raw, headers, key, body.get("stream") is True, t_start)
        return await race_disconnect(request.receive, work)

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_route(path, functools.partial(relay_post, path=path), methods=["POST"])
    app.include_router(build_admin_router(state))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        n = len(state.registry.routable())
        if n == 0:
            return JSONResponse(error_body("no routable worker", "no_worker_available", 503),
                                status_code=503)
        return JSONResponse({"status": "ok", "num_routable_workers": n,
                             "num_workers": len(state.registry)})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.refresh_gauges()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # Only these GETs are relayed: a catch-all would expose the workers' admin routes.
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        return await get_from_healthy(state, request, "/v1/models")

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model_id: str) -> Response:
        segment = quote(model_id, safe="")  # one segment: no path traversal
        if segment in ("", ".", ".."):
            raise ModelNotFound(f"model {model_id!r} not found", param="model")
        return await get_from_healthy(state, request, "/v1/models/" + segment)

    return app


def forwarded_headers(request: Request, names: tuple[str, ...]) -> dict[str, bytes]:
    """The client's headers among `names`, values as the bytes received (httpx refuses non-ASCII str)."""
    return {name: value for key, value in request.headers.raw
            if (name := key.decode("latin-1").lower()) in names}


async def get_from_healthy(state: RouterState, request: Request, path: str) -> Response:
    """A GET from routable, then healthy, then other workers; a transport error or 5xx tries the next."""
    workers = state.registry.list()
    order = sorted(workers, key=lambda w: (not w.is_routable(), not w.healthy))
    headers = forwarded_headers(request, GET_FORWARDED_HEADERS)
    last: Response | None = None
    for worker in order:
        try:
            r = await state.http.get(worker.url + path, params=request.query_params,
                                     headers=headers, timeout=state.config.health_check_timeout_s)
        except UNREACHABLE as exc:
            logger.info("GET %s from %s failed: %r", path, worker.url, exc)
            continue
        reply = Response(r.content, status_code=r.status_code,
                         media_type=wire_header(r.headers, "content-type"))
        if r.status_code < 500:
            return reply
        last = reply
    return last or JSONResponse(error_body("no worker available", "no_worker_available", 503),
                                status_code=503)
