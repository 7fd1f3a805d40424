"""The worker's public routes: the OpenAI API under /v1 with the request -> GenerationRun steps it takes, and the probes."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from radixserve.engine.messages import AddReq
from radixserve.errors import EngineDead, InvalidRequest
from radixserve.http_common import read_body
from radixserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from radixserve.server.chat_tools import ChatOutputs, plan_tools, prompt_tail
from radixserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.server.native_tools import native_calls_tag
from radixserve.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                        ModelList, new_id, now_s)
from radixserve.server.responses import (chat_chunks, chat_response, completion_chunks,
                                         completion_response, respond)
from radixserve.server.resume import resumed_params
from radixserve.server.serving import LONG_TEXT_CHARS, MAX_BODY_BYTES, GenerationRun, ServingContext
from radixserve.server.validation import validation_error

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
METRICS_STATS_TIMEOUT_S = 5.0
MAX_CHOICES = 256           # prompts x n in one request
Req = TypeVar("Req", bound=BaseModel)


def install_openai_routes(app: FastAPI, ctx: ServingContext, auth: list[Any]) -> None:
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    created = now_s()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        run = await completion_run(ctx, req)
        return await respond(request, run, req, completion_response, completion_chunks)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
        run, outputs = await chat_run(ctx, req)
        return await respond(request, run, req, functools.partial(chat_response, outputs=outputs),
                             functools.partial(chat_chunks, outputs=outputs))

    @v1.get("/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=created, root=ctx.model_path,
                         max_model_len=ctx.max_context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    app.include_router(v1)


async def completion_run(ctx: ServingContext, req: CompletionRequest) -> GenerationRun:
    """The unsubmitted run; raises InvalidRequest, ModelNotFound, ContextLengthExceeded or Overloaded."""
    ctx.check_model(req.model)
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise InvalidRequest(f"best_of {req.best_of} is not supported (only 1)", param="best_of")
    prompt_logprobs = req.logprobs if req.echo else None
    params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs)
    prompt_ids = await completion_prompts(ctx, req)
    if req.resume_token_ids is not None:
        params = resumed_params(req, params, len(prompt_ids))
    ctx.check_capacity()
    pd = ctx.pd_target(req)
    return GenerationRun(ctx, new_id("cmpl"), prompt_ids, params, req.resume_token_ids, pd)


async def chat_run(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[GenerationRun, ChatOutputs]:
    """The unsubmitted run and its output parsers; raises as completion_run."""
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {req.top_logprobs}", param="top_logprobs")
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                  else req.max_tokens)
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, None)
    plan = plan_tools(req, ctx.tool_call_parser, ctx.tool_call_constraint)
    if plan.json_schema is not None:
        params = dataclasses.replace(params, json_schema=plan.json_schema, json_schema_param="tools")
    prompt_ids = await chat_prompt(ctx, req, plan.template_tools)
    reasoning = ctx.reasoning_parser is not None
    outputs = ChatOutputs(plan, ctx.tool_call_parser, reasoning,
                          prompt_tail(ctx.tokenizer, prompt_ids) if reasoning else "")
    if plan.native is not None:
        tag = native_calls_tag(plan.native, outputs.reasoning, outputs.starts_in_reasoning)
        params = dataclasses.replace(params, structural_tag=tag, json_schema_param="tools")
    if outputs.is_parsing and "skip_special_tokens" not in req.model_fields_set:
        # markers such as <think> and <tool_call> are special tokens in some vocabularies
        params = dataclasses.replace(params, skip_special_tokens=False)
    if req.resume_token_ids is not None:
        params = resumed_params(req, params, 1)
    ctx.check_capacity()
    pd = ctx.pd_target(req)
    run = GenerationRun(ctx, new_id("chatcmpl"), [prompt_ids], params, req.resume_token_ids, pd)
    return run, outputs


async def completion_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids; the engine checks ids and lengths on submit."""
    items = req.prompt_items()
    if not items:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if len(items) * req.n > MAX_CHOICES:
        raise InvalidRequest(f"at most {MAX_CHOICES} choices (prompts x n) per request, "
                             f"got {len(items) * req.n}", param="prompt")
    for item in items:
        if isinstance(item, str):
            ctx.check_text_fits([item], "prompt")
    return [await ctx.encode(item) if isinstance(item, str) else list(item) for item in items]


async def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest,
                      tools: list[dict] | None = None) -> list[int]:
    """The chat template over `messages` and `tools` as token ids (raises InvalidRequest)."""
    messages = [m.template_dict() for m in req.messages]
    # Only user messages are bounded: templates may drop others (Qwen3: earlier reasoning).
    ctx.check_text_fits([m["content"] for m in messages if m["role"] == "user"], "messages")
    render = functools.partial(ctx.tokenizer.apply_chat_template, messages,
                               req.add_generation_prompt, tools, req.chat_template_kwargs)
    if sum(len(m["content"]) for m in messages) < LONG_TEXT_CHARS:
        ids = render()
    else:
        ids = await asyncio.to_thread(render)
    return list(ids)


async def parse_body(request: Request, model: type[Req], max_bytes: int = MAX_BODY_BYTES) -> Req:
    """`model` from a JSON body; InvalidRequest (400), or BodyTooLarge (413) over `max_bytes`."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise InvalidRequest("Content-Type must be application/json", param="content-type")
    body = await read_body(request, max_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def install_probe_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The probes, without the API key."""

    @app.get("/health")
    async def health() -> Response:
        """200 `ok` with this process's `instance_id`; 503 `degraded` (all slots held: route
        away, not sick), `engine_dead`, or `draining`."""
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
