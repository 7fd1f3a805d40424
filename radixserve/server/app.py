"""The FastAPI application (routes, auth, OpenAI error bodies) and `serve()`, which runs one worker."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from radixserve.drain import FLUSH_S, Drain, DrainMiddleware, GracefulServer
from radixserve.engine.loop import PartsFactory
from radixserve.engine_config import EngineConfig
from radixserve.errors import InvalidRequest
from radixserve.http_common import (SERVER_KEEP_ALIVE_S, BodyTimeoutMiddleware, ReadTimeoutProtocol,
                                    bearer_key_check, install_error_handlers, quiet_signals)
from radixserve.server.admin_routes import install_admin_routes
from radixserve.server.anomaly import GuardSettings
from radixserve.server.engine_client import EngineClient
from radixserve.server.metrics import ServerMetrics
from radixserve.server.routes import install_openai_routes, install_probe_routes
from radixserve.server.serving import ServingContext
from radixserve.server.validation import render_details
from radixserve.server_config import ServerConfig

logger = logging.getLogger(__name__)

ENGINE_DEATH_GRACE_S = 1.0   # after engine death, answer 503s this long before exiting


async def on_validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own validation errors as this server's 400 (server/validation.py)."""
    assert isinstance(exc, RequestValidationError), exc
    error = InvalidRequest(*render_details(list(exc.errors())))
    return JSONResponse(error.to_dict(), status_code=error.status)


def build_app(ctx: ServingContext, server_config: ServerConfig,
              speculative_algorithm: str | None = None) -> FastAPI:
    """The worker's app over `ctx` (engine running `speculative_algorithm`); `app.state.drain`: its Drain (drain.py)."""
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, "server")
    app.add_exception_handler(RequestValidationError, on_validation_error)
    if ctx.metrics is None:
        ctx.metrics = ServerMetrics(ctx.model_name)
    ctx.guard = GuardSettings.from_config(server_config, speculative_algorithm)
    key = server_config.api_key
    auth = [Depends(bearer_key_check(key, "API key"))] if key is not None else []   # 401 without it
    install_openai_routes(app, ctx, auth)
    install_probe_routes(app, ctx)
    drain = Drain(server_config.graceful_shutdown_timeout)
    install_admin_routes(app, ctx, server_config, auth, drain)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=server_config.request_body_timeout)
    app.add_middleware(DrainMiddleware, drain=drain)   # outermost: a hung request is in flight too
    app.state.drain = drain
    return app


async def serve(engine_config: EngineConfig, server_config: ServerConfig,
                engine_factory: PartsFactory, model_path: str, sock: socket.socket) -> int:
    """Serve HTTP on `sock` until stopped (SIGTERM/SIGINT drain first); returns 0 when stopped by
    a signal, 1 when the engine died (unless `stay_up_on_engine_death`)."""
    from radixserve.tokenizer.tokenizer import Tokenizer

    t0 = time.monotonic()
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
        app = build_app(ctx, server_config, engine_config.speculative_algorithm)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                log_level=server_config.log_level,
                                access_log=server_config.log_level == "debug",
                                timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                                http=ReadTimeoutProtocol.bounded(server_config.request_read_timeout),
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
