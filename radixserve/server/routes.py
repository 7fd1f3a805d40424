"""The worker's public routes: the OpenAI API under /v1 (server/completions.py, server/chat.py) and the probes."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from radixserve.engine.messages import AddReq
from radixserve.errors import EngineDead
from radixserve.sampling_params import SamplingParams
from radixserve.server.chat import add_chat_route
from radixserve.server.completions import add_completion_route
from radixserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.server.protocol import ModelCard, ModelList, new_id, now_s
from radixserve.server.serving import ServingContext

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
METRICS_STATS_TIMEOUT_S = 5.0


def install_openai_routes(app: FastAPI, ctx: ServingContext, auth: list[Any]) -> None:
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    created = now_s()
    add_completion_route(v1, ctx)
    add_chat_route(v1, ctx)

    @v1.get("/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=created, root=ctx.model_path,
                         max_model_len=ctx.max_context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    app.include_router(v1)

def install_probe_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The probes, without the API key."""

    @app.get("/health")
    async def health() -> Response:
        """200 `ok` + `instance_id`, 503 `degraded` (slots full: route away, not sick), `engine_dead`, `draining`."""
        if not ctx.client.is_alive:
            raise EngineDead(f"engine is dead: {ctx.client.dead_reason}")
        num_open = ctx.client.num_open_requests
        if num_open >= ctx.max_open_requests:
            return JSONResponse({"status": "degraded", "reason": f"all {ctx.max_open_requests} request "
                                 f"slots are held", "num_open_requests": num_open}, status_code=503)
        return JSONResponse({"status": "ok", "instance_id": ctx.instance_id})

    @app.get("/live")
    async def live() -> Response:
        """200 while the engine lives, however busy or drained; 503 `engine_dead`."""
        if not ctx.client.is_alive:
            raise EngineDead(f"engine is dead: {ctx.client.dead_reason}")
        return JSONResponse({"status": "alive"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once the engine generated one token (a PD worker answers as /health)."""
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
        assert ctx.metrics is not None, "build_app sets ctx.metrics"
        stats = None
        if ctx.client.is_alive:
            try:
                stats = await ctx.client.call("stats", timeout_s=METRICS_STATS_TIMEOUT_S)
            except (asyncio.TimeoutError, EngineDead):
                logger.warning("engine stats unavailable; /metrics shows the last snapshot")
        return Response(ctx.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)
