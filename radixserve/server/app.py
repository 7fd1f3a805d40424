"""The FastAPI application (routes, auth, OpenAI error bodies) and `serve()`, which runs one worker."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import socket
import time
from typing import Any, Callable

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from radixserve.config import EngineConfig, ServerConfig
from radixserve.drain import FLUSH_S, Drain, DrainMiddleware, GracefulServer
from radixserve.engine.loop import EngineFactory
from radixserve.engine.messages import AddReq
from radixserve.errors import EngineDead, InvalidRequest, RadixServeError, error_body
from radixserve.http_common import SERVER_KEEP_ALIVE_S, bearer_key_check, quiet_signals
from radixserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from radixserve.server import responses
from radixserve.server.admin_routes import install_admin_routes
from radixserve.server.acceptance_guard import AcceptanceConfig
from radixserve.server.confidence_guard import ConfidenceConfig
from radixserve.server.anomaly import GuardConfig
from radixserve.server.chat_tools import ChatOutputs, plan_tools, prompt_tail
from radixserve.server.engine_client import EngineClient
from radixserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_tools import native_calls_tag
from radixserve.server.pd import pd_target
from radixserve.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                        ModelList, new_id, now_s)
from radixserve.server.responses import ClientDisconnected
from radixserve.server.resume import resumed_params
from radixserve.server.serving import (GenerationRun, ServingContext, chat_prompt,
                                       completion_prompts, parse_body)
from radixserve.server.validation import render_details

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
METRICS_STATS_TIMEOUT_S = 5.0  # a wedged engine must not hang or 500 the scrape
ENGINE_DEATH_GRACE_S = 1.0   # after engine death, answer 503s this long before exiting


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
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)   # left while its body was read (parse_body)
    async def on_disconnect(request: Request, exc: Exception) -> Response:
        logger.debug("client left %s %s before its response", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}",
                                       "internal_error", 500), status_code=500)


def api_key_check(api_key: str | None) -> Callable[[Request], Any]:
    """The worker's `--api-key` check (FastAPI dependency; 401 without the key)."""
    return bearer_key_check(api_key, "API key")


def build_app(ctx: ServingContext, server_config: ServerConfig) -> FastAPI:
    """The worker's app over `ctx`; `app.state.drain` is its Drain (drain.py): SIGTERM through
    GracefulServer, or POST /admin/drain, stops admission while requests in flight finish."""
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if ctx.metrics is None:
        ctx.metrics = ServerMetrics(ctx.model_name)
    c = server_config
    if not c.disable_anomaly_guard:
        ctx.guard = GuardConfig()
    if not c.disable_anomaly_guard and c.enable_spec_anomaly_detector:
        ctx.acceptance = AcceptanceConfig(min_tokens=c.spec_anomaly_min_tokens,
                                          min_verify_steps=c.spec_anomaly_min_verify_steps,
                                          min_accept_length=c.spec_anomaly_min_accept_length,
                                          max_accept_rate=c.spec_anomaly_max_accept_rate)
    if not c.disable_anomaly_guard and c.enable_confidence_detector:
        ctx.confidence = ConfidenceConfig(window=c.confidence_window,
                                          min_mean_logprob=c.confidence_min_mean_logprob,
                                          min_drop=c.confidence_min_drop,
                                          max_temperature=c.confidence_max_temperature)
    auth = [Depends(api_key_check(server_config.api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    created = now_s()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        prompt_logprobs = req.logprobs if req.echo else None
        params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs)
        prompts = await completion_prompts(ctx, req)
        if req.resume_token_ids is not None:
            params = resumed_params(req, params, len(prompts))
        ctx.check_capacity()
        pd = pd_target(ctx.client.info.disaggregation_mode, req)
        rid = new_id("cmpl")
        run = GenerationRun(ctx, rid, prompts, params, req.resume_token_ids, pd)
        return await responses.respond(request, run, req.stream, responses.completion_response,
                                       responses.completion_chunks, req, rid)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {req.top_logprobs}", param="top_logprobs")
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                     None)
        plan = plan_tools(req, ctx.tool_call_parser, ctx.tool_call_constraint)
        if plan.json_schema is not None:   # tool_choice "required" or a named function
            params = dataclasses.replace(params, json_schema=plan.json_schema,
                                         json_schema_param="tools")
        prompt = await chat_prompt(ctx, req, plan.template_tools)
        reasoning = ctx.reasoning_parser is not None
        outputs = ChatOutputs(plan, ctx.tool_call_parser, reasoning,
                              prompt_tail(ctx.tokenizer, prompt.ids) if reasoning else "")
        if plan.native is not None:   # calls in the model's own format (native_tools.py)
            tag = native_calls_tag(plan.native, outputs.reasoning, outputs.starts_in_reasoning)
            params = dataclasses.replace(params, structural_tag=tag, json_schema_param="tools")
        if outputs.is_parsing and "skip_special_tokens" not in req.model_fields_set:
            # markers such as <think> and <tool_call> are special tokens in some vocabularies
            params = dataclasses.replace(params, skip_special_tokens=False)
        if req.resume_token_ids is not None:
            params = resumed_params(req, params, 1)
        ctx.check_capacity()
        pd = pd_target(ctx.client.info.disaggregation_mode, req)
        rid = new_id("chatcmpl")
        run = GenerationRun(ctx, rid, [prompt], params, req.resume_token_ids, pd)
        return await responses.respond(
            request, run, req.stream, functools.partial(responses.chat_response, outputs=outputs),
            functools.partial(responses.chat_chunks, outputs=outputs), req, rid)

    @v1.get("/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=created, root=ctx.model_path,
                         max_model_len=ctx.max_context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        """200 `ok`; 503 `degraded` while every request slot is held (alive, but admits nothing
        new: the router routes away, the ops agent must not treat it as sick); 503 `engine_dead`.
        While draining, DrainMiddleware answers instead: 503 `draining`."""
        if not ctx.client.is_alive:
            raise EngineDead(f"engine is dead: {ctx.client.dead_reason}")
        num_open = ctx.client.num_open_requests
        if num_open >= ctx.max_open_requests:
            return JSONResponse({"status": "degraded", "reason": f"all {ctx.max_open_requests} request "
                                 f"slots are held", "num_open_requests": num_open}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/live")
    async def live() -> Response:
        """Liveness: 200 while the engine process lives, however busy or drained the worker is
        (saturated and draining workers stay up: /health says 503 for routing, not for a
        restart); 503 `engine_dead` once it is gone."""
        if not ctx.client.is_alive:
            raise EngineDead(f"engine is dead: {ctx.client.dead_reason}")
        return JSONResponse({"status": "alive"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine has generated one token for a tiny request (a PD worker only
        generates as half of a pair: there it answers as /health does)."""
        if ctx.client.info.disaggregation_mode != "null":
            return await health()
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

    drain = Drain(server_config.graceful_shutdown_timeout)
    install_admin_routes(app, ctx, server_config, auth, drain)
    app.add_middleware(DrainMiddleware, drain=drain)   # outermost: a hung request is in flight too
    app.state.drain = drain
    return app


async def serve(engine_config: EngineConfig, server_config: ServerConfig,
                engine_factory: EngineFactory, model_path: str, sock: socket.socket) -> int:
    """Load the tokenizer of `model_path`, start the engine process (`engine_factory` loads the
    model there; the tokenizer's eos ids go with it), then serve HTTP on `sock` (bound to
    server_config's host and port before loading, see http_common.bind_socket) until stopped.
    SIGTERM/SIGINT drain first (drain.py: in-flight requests get up to
    --graceful-shutdown-timeout s). Returns the exit code: 0 when stopped by a signal, 1 when the engine died (after
    ENGINE_DEATH_GRACE_S of 503s, so that in-flight requests get their error), unless
    `stay_up_on_engine_death`."""
    from radixserve.tokenizer.tokenizer import Tokenizer

    t0 = time.monotonic()
    # The tokenizer (transformers' import: seconds) loads while the engine process starts and
    # loads the model; its eos ids reach the engine before any request can.
    logger.info("loading the tokenizer of %s", model_path)
    loading = asyncio.create_task(asyncio.to_thread(Tokenizer.load, model_path))
    logger.info("starting the engine process (it loads the model)")
    try:
        client = await EngineClient.launch(engine_config, engine_factory, frozenset(),
                                           server_config.log_level, server_config.watchdog_timeout)
    except BaseException:
        await asyncio.gather(loading, return_exceptions=True)
        raise
    try:
        tokenizer = await loading
        await client.call("add_eos_token_ids", args={"token_ids": sorted(tokenizer.eos_token_ids)})
        if server_config.warmup_prompts is not None:
            from radixserve.server.warmup import read_prompts, warm_up
            prompts = read_prompts(server_config.warmup_prompts)
            logger.info("warming up: prefilling %d prompts from %s before serving", len(prompts),
                        server_config.warmup_prompts)
            await warm_up(client, tokenizer, prompts)
        name = server_config.served_model_name or os.path.basename(model_path.rstrip("/"))
        max_open = engine_config.max_running_requests + server_config.max_queued_requests
        ctx = ServingContext(client, tokenizer, name, model_path, max_open,
                             max_body_bytes=server_config.max_request_body_bytes,
                             tool_call_parser=server_config.tool_call_parser,
                             tool_call_constraint=server_config.tool_call_constraint,
                             reasoning_parser=server_config.reasoning_parser)
        app = build_app(ctx, server_config)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                log_level=server_config.log_level,
                                access_log=server_config.log_level == "debug",
                                timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                                timeout_graceful_shutdown=FLUSH_S, lifespan="off")
        server = GracefulServer(config, app.state.drain)
        announce = asyncio.create_task(_announce(server, ctx, server_config, time.monotonic() - t0))
        stopper = asyncio.create_task(_exit_on_engine_death(server, client, server_config))
        with quiet_signals():
            try:
                await server.serve(sockets=[sock])
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


async def _announce(server: uvicorn.Server, ctx: ServingContext, config: ServerConfig,
                    load_s: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    print(f"radixserve: serving {ctx.model_name} (context {ctx.max_context_len} tokens, "
          f"loaded in {load_s:.1f} s) on http://{config.host}:{config.port}", flush=True)
