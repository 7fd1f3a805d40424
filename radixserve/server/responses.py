"""OpenAI completion and chat responses from one GenerationRun: collected, or as SSE chunks, and their delivery.

SSE per choice: (chat) a role delta, content chunks, one empty-delta chunk with finish_reason; then the
usage chunk if asked, then `data: [DONE]` once. Joined deltas equal the full response byte for byte.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from radixserve.outputs import TokenLogprob
from radixserve.errors import RadixServeError, error_body
from radixserve.http_common import ClosingStreamingResponse, race_disconnect
from radixserve.server.chat_tools import ChatOutputs
from radixserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                                        CompletionChunk, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, TopLogprob, now_s)
from radixserve.server.serving import GenerationRun, ServingContext

logger = logging.getLogger(__name__)
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)

DONE = "data: [DONE]\n\n"


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


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


def chat_logprobs(ctx: ServingContext, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in entries:
        text = ctx.token_text(lp.token_id)
        top = [TopLogprob(token=ctx.token_text(t), logprob=v,
                          bytes=list(ctx.token_text(t).encode())) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


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
        yield _error_event(exc)
    finally:
        run.close()
    yield DONE


async def chat_response(run: GenerationRun, req: ChatCompletionRequest, created: int,
                        outputs: ChatOutputs) -> ChatCompletionResponse:
    ctx = run.ctx
    (result,) = await run.results()
    choices = []
    for c in result.outputs:
        logprobs = chat_logprobs(ctx, c.logprobs or []) if req.logprobs else None
        message, finish_reason = outputs.message(c.text, c.finish_reason)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                  finish_reason=finish_reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=run.base_id, created=created, model=ctx.model_name, choices=choices,
                                  usage=run.usage(run.reasoning_tokens(outputs)))


async def chat_chunks(run: GenerationRun, req: ChatCompletionRequest, created: int,
                      outputs: ChatOutputs) -> AsyncIterator[str]:
    """SSE events; closes the run when done. A resumed run's text primes the parser unsent."""
    ctx, rid = run.ctx, run.base_id

    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                       choices=[choice]))

    try:
        if run.resumed_text:
            outputs.delta(0, run.resumed_text, False)
        for index in range(run.n):
            yield chunk(ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""}))
        async for index, u in run.updates():
            delta = outputs.delta(index, u.text, u.finish_reason is not None)
            if delta or (req.logprobs and u.logprobs) or (req.return_token_ids and u.token_ids):
                lp = chat_logprobs(ctx, u.logprobs or []) if req.logprobs else None
                ids = {"token_ids": u.token_ids} if req.return_token_ids else {}
                yield chunk(ChatStreamChoice(index=index, delta=delta or {"content": ""},
                                             logprobs=lp, **ids))
            if u.finish_reason is not None:
                reason = outputs.finish_reason(index, u.finish_reason)
                yield chunk(ChatStreamChoice(index=index, delta={}, finish_reason=reason))
        if req.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                          choices=[], usage=run.usage(run.reasoning_tokens(outputs))))
    except Exception as exc:
        yield _error_event(exc)
    finally:
        run.close()
    yield DONE


async def respond(request: Request, run: GenerationRun, req: R,
                  full: Callable[[GenerationRun, R, int], Awaitable[BaseModel]],
                  chunks: Callable[[GenerationRun, R, int], AsyncIterator[str]]) -> Response:
    """Submit, then stream or collect; rejections raise before a byte is sent; a disconnect aborts."""
    created = now_s()
    async with contextlib.AsyncExitStack() as owned:
        await owned.enter_async_context(run)
        if run.ctx.faults is not None:
            await run.ctx.faults.on_accepted()
        if req.stream:
            owned.pop_all()   # the event stream now closes the run
            return ClosingStreamingResponse(chunks(run, req, created), run.close,
                                            media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        result = await race_disconnect(request.receive, full(run, req, created))
    return Response(result.model_dump_json(), media_type="application/json")


def _error_event(exc: Exception) -> str:
    """An error after the 200 went out, as an SSE event."""
    if isinstance(exc, RadixServeError):
        body = exc.to_dict()
    else:
        logger.exception("streaming failed")
        body = error_body("internal server error", "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"
