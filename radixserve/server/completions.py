"""POST /v1/completions: the request checked and tokenized, its GenerationRun, and the answer (collected, or SSE:
per choice content chunks, then one chunk with finish_reason; the usage chunk if asked; `data: [DONE]` once)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.errors import InvalidRequest
from radixserve.outputs import TokenLogprob
from radixserve.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, new_id)
from radixserve.server.resume import resumed_params
from radixserve.server.serving import (DONE, GenerationRun, ServingContext, error_event, parse_body, respond,
                                       sse)

MAX_CHOICES = 256           # prompts x n in one request


def add_completion_route(v1: APIRouter, ctx: ServingContext) -> None:
    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, ctx.max_body_bytes)
        run = await completion_run(ctx, req)
        return await respond(request, run, req, completion_response, completion_chunks)

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

def completion_logprobs(ctx: ServingContext, ids: list[int], entries: list[TokenLogprob | None],
                        text_offset: int) -> CompletionLogprobs:
    """OpenAI legacy format; `entries[i]` is the logprob of `ids[i]`."""
    out = CompletionLogprobs()
    for tid, lp in zip(ids, entries):
        text = ctx.token_text(tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob if lp is not None else None)
        out.top_logprobs.append({ctx.token_text(t): v for t, v in lp.top} if lp is not None else None)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out

def _echo_text(run: GenerationRun, req: CompletionRequest, prompt_index: int) -> str:
    item = req.prompt_items()[prompt_index]
    if isinstance(item, str):
        return item
    return run.ctx.tokenizer.decode(run.prompt_ids[prompt_index], skip_special_tokens=False)


def _echo_logprobs(ctx: ServingContext, run: GenerationRun, prompt_index: int) -> CompletionLogprobs:
    ids = run.prompt_ids[prompt_index]
    entries = run.prompt_logprobs(prompt_index)
    entries += [None] * (len(ids) - len(entries))
    return completion_logprobs(ctx, ids, entries, 0)


def _merge(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)

async def completion_response(run: GenerationRun, req: CompletionRequest,
                              created: int) -> CompletionResponse:
    ctx = run.ctx
    choices = []
    for prompt_index, result in enumerate(await run.results()):
        for c in result.outputs:
            text, logprobs = c.text, None
            offset = 0
            if req.echo:
                prompt_text = _echo_text(run, req, prompt_index)
                text, offset = prompt_text + text, len(prompt_text)
                if req.logprobs is not None:
                    logprobs = _echo_logprobs(ctx, run, prompt_index)
            if req.logprobs is not None:
                logprobs = _merge(logprobs, completion_logprobs(ctx, c.token_ids, c.logprobs or [],
                                                                offset))
            choices.append(CompletionChoice(index=prompt_index * run.n + c.index, text=text,
                                            logprobs=logprobs, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    return CompletionResponse(id=run.base_id, created=created, model=ctx.model_name, choices=choices,
                              usage=run.usage())

async def completion_chunks(run: GenerationRun, req: CompletionRequest,
                            created: int) -> AsyncIterator[str]:
    """SSE events; closes the run when done or cancelled."""
    ctx, rid = run.ctx, run.base_id

    def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None,
              finish_reason: str | None = None, stop_reason: str | int | None = None,
              ids: dict[str, list[int]] | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finish_reason, stop_reason=stop_reason,
                                  **(ids or {}))
        return sse(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[choice]))

    want_logprobs = req.logprobs is not None
    offsets: dict[int, int] = {}
    try:
        async for index, u in run.updates():
            if index not in offsets:
                offsets[index] = 0
                if req.echo:
                    prompt_text = _echo_text(run, req, index // run.n)
                    lp = _echo_logprobs(ctx, run, index // run.n) if want_logprobs else None
                    yield chunk(index, prompt_text, lp)
                    offsets[index] = len(prompt_text)
            if u.text or ((want_logprobs or req.return_token_ids) and u.token_ids):
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(ctx, u.token_ids, u.logprobs or [], offsets[index])
                    offsets[index] += sum(len(t) for t in lp.tokens)
                ids = {"token_ids": u.token_ids} if req.return_token_ids else {}
                yield chunk(index, u.text, lp, ids=ids)
            if u.finish_reason is not None:
                yield chunk(index, "", None, u.finish_reason, u.stop_reason)
        if req.include_usage:
            yield sse(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[],
                                      usage=run.usage()))
    except Exception as exc:
        yield error_event(exc)
    finally:
        run.close()
    yield DONE
