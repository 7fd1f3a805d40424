"""The FastAPI application (routes, auth, OpenAI error bodies) and `serve()`, which runs one worker."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.config import EngineConfig, ServerConfig
from radixserve.errors import BodyTooLarge, EngineDead, InvalidRequest, RadixServeError, Unauthorized
from radixserve.sampling_params import SamplingParams
from radixserve.server import responses
from radixserve.server.engine_client import EngineClient
from radixserve.server.engine_proc import AddReq, EngineBuilder
from radixserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                        ModelList, new_id, now_s, render_details, validation_error)
from radixserve.server.serving import (ClientDisconnected, GenerationRun, ServingContext,
                                       chat_prompt, check_context, completion_prompts,
                                       race_disconnect)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
MAX_ADMIN_BODY_BYTES = 64 << 10
HEALTH_GENERATE_TIMEOUT_S = 20.0
METRICS_STATS_TIMEOUT_S = 5.0  # a wedged engine must not hang or 500 the scrape
ENGINE_DEATH_GRACE_S = 1.0   # after engine death, answer 503s this long before exiting
Req = TypeVar("Req", bound=BaseModel)


class AbortRequest(BaseModel, extra="forbid"):
    """Body of POST /abort_request: `rid` is the `id` of a completion or chat completion
    (the response body's `id`, or any streamed chunk's); `abort_all` ends every open request."""

    rid: str = ""
    abort_all: bool = False


async def parse_body(request: Request, model: type[Req], max_bytes: int = MAX_BODY_BYTES) -> Req:
    """Validate a JSON body against `model`; every failure is an InvalidRequest (400), a body
    over `max_bytes` is 413."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise InvalidRequest("Content-Type must be application/json", param="content-type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"request body is larger than {max_bytes} bytes")
    body = await request.body()
    if len(body) > max_bytes:
        raise BodyTooLarge(f"request body is larger than {max_bytes} bytes")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _error_response(exc: RadixServeError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body; a 500 only for real bugs (logged)."""

    @app.exception_handler(RadixServeError)
    async def on_radixserve_error(request: Request, exc: RadixServeError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(InvalidRequest(*render_details(list(exc.errors()))))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None,
                          "code": exc.status_code}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        body = {"error": {"message": f"internal server error: {type(exc).__name__}",
                          "type": "internal_error", "param": None, "code": 500}}
        return JSONResponse(body, status_code=500)


def api_key_check(api_key: str | None) -> Callable[[Request], Any]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise Unauthorized("Incorrect or missing API key (send 'Authorization: Bearer KEY').")
    return check


class _EventStream(StreamingResponse):
    """SSE response that closes its run however the response ends, even when the client is
    gone before the first event (then the event generator never starts, so its own cleanup
    would never run)."""

    def __init__(self, events: Any, run: GenerationRun):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


async def _respond(request: Request, run: GenerationRun, stream: bool, full: Any, chunks: Any,
                   req: Any, rid: str) -> Response:
    """Submit the run, then stream it or collect it. Any rejection raises before a byte is sent
    (field case C10); a client that goes away aborts the run (C06)."""
    created = now_s()
    await run.__aenter__()
    if stream:
        return _EventStream(chunks(run.ctx, run, req, rid, created), run)
    try:
        result = await race_disconnect(request.receive, full(run.ctx, run, req, rid, created))
    finally:
        run.close()
    return Response(result.model_dump_json(), media_type="application/json")


def build_app(ctx: ServingContext, server_config: ServerConfig) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if ctx.metrics is None:
        ctx.metrics = ServerMetrics(ctx.model_name)
    auth = [Depends(api_key_check(server_config.api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    created = now_s()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        ctx.check_model(req.model)
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        prompt_logprobs = req.logprobs if req.echo else None
        params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs)
        prompts = await completion_prompts(ctx, req)
        for prompt in prompts:
            check_context(ctx, len(prompt.ids), req.max_tokens)
        ctx.check_capacity()
        rid = new_id("cmpl")
        run = GenerationRun(ctx, rid, prompts, params)
        return await _respond(request, run, req.stream, responses.completion_response,
                              responses.completion_chunks, req, rid)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                     None)
        prompt = await chat_prompt(ctx, req)
        check_context(ctx, len(prompt.ids), max_tokens)
        ctx.check_capacity()
        rid = new_id("chatcmpl")
        run = GenerationRun(ctx, rid, [prompt], params)
        return await _respond(request, run, req.stream, responses.chat_response,
                              responses.chat_chunks, req, rid)

    @v1.get("/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=created, root=ctx.model_path,
                         max_model_len=ctx.max_context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not ctx.client.is_alive:
            raise EngineDead(f"engine is dead: {ctx.client.dead_reason}")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine has generated one token for a tiny request."""
        ids = ctx.tokenizer.encode("Hi") or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        stream = ctx.client.submit([AddReq(new_id("health"), ids[:1], params)])
        try:
            await asyncio.wait_for(stream.accepted(), HEALTH_GENERATE_TIMEOUT_S)
            await asyncio.wait_for(stream.get(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineDead("engine did not generate a token in time") from None
        finally:
            stream.close()
        return JSONResponse({"status": "ok"})

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
                             "num_open_requests": ctx.client.num_open_requests,
                             "max_open_requests": ctx.max_open_requests,
                             "engine_pid": ctx.client.proc.pid,
                             "engine_alive": ctx.client.is_alive,
                             "server_config": dataclasses.asdict(server_config) | {"api_key": None},
                             "engine": await ctx.client.call("stats")})

    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"], dependencies=auth)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format; engine gauges and counters are read from the engine now."""
        assert ctx.metrics is not None, "build_app sets ctx.metrics"
        stats = None
        if ctx.client.is_alive:
            try:
                stats = await ctx.client.call("stats", timeout_s=METRICS_STATS_TIMEOUT_S)
            except (asyncio.TimeoutError, EngineDead):
                logger.warning("engine stats unavailable; /metrics shows the last snapshot")
        return Response(ctx.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    if server_config.enable_debug_endpoints:
        @app.get("/debug/pages", dependencies=auth)
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
                "invariant_holds": invariant, "invariant_error": error})

    return app


async def serve(engine_config: EngineConfig, server_config: ServerConfig, builder: EngineBuilder,
                model_path: str) -> int:
    """Start the engine process (`builder` loads the model there), load the tokenizer of
    `model_path` here meanwhile, then serve HTTP until stopped. Returns the exit code: 0 when
    stopped by a signal, 1 when the engine died (after ENGINE_DEATH_GRACE_S of 503s, so that
    in-flight requests get their error), unless `stay_up_on_engine_death`."""
    from radixserve.tokenizer.tokenizer import Tokenizer

    t0 = time.monotonic()
    launch = asyncio.create_task(EngineClient.launch(engine_config, builder, server_config.log_level,
                                                     server_config.watchdog_timeout))
    try:
        tokenizer = await asyncio.to_thread(Tokenizer.load, model_path)
    except BaseException:
        launch.cancel()
        raise
    client = await launch
    try:
        name = server_config.served_model_name or os.path.basename(model_path.rstrip("/"))
        max_open = engine_config.max_running_requests + server_config.max_queued_requests
        ctx = ServingContext(client, tokenizer, name, model_path, max_open)
        app = build_app(ctx, server_config)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                log_level=server_config.log_level,
                                access_log=server_config.log_level == "debug",
                                timeout_graceful_shutdown=5, lifespan="off")
        server = uvicorn.Server(config)
        announce = asyncio.create_task(_announce(server, ctx, server_config, time.monotonic() - t0))
        stopper = asyncio.create_task(_exit_on_engine_death(server, client, server_config))
        with _quiet_signals():
            try:
                await server.serve()
            finally:
                announce.cancel()
                stopper.cancel()
                await client.close()
        return 1 if client.dead_reason is not None and not server_config.stay_up_on_engine_death else 0
    finally:
        await client.close()


async def _exit_on_engine_death(server: uvicorn.Server, client: EngineClient,
                                config: ServerConfig) -> None:
    await client.dead.wait()
    if config.stay_up_on_engine_death:
        logger.error("engine is dead; staying up (--stay-up-on-engine-death), /health says 503")
        return
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    logger.error("engine is dead; exiting with code 1")
    server.should_exit = True


@contextlib.contextmanager
def _quiet_signals() -> Iterator[None]:
    """uvicorn stops on SIGINT/SIGTERM and then re-raises the signal to the handler it found
    installed; make that handler a no-op, so that the engine process is still shut down in
    order and the exit code is 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def note(sig: int, frame: object) -> None:
        logger.info("stopping on signal %d", sig)
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _announce(server: uvicorn.Server, ctx: ServingContext, config: ServerConfig,
                    load_s: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"radixserve: serving {ctx.model_name} (context {ctx.max_context_len} tokens, "
          f"loaded in {load_s:.1f} s) on http://{config.host}:{config.port}", flush=True)
