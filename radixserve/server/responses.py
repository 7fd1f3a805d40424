"""OpenAI completion and chat responses from one GenerationRun: collected, or as SSE chunks.

SSE framing (field case C17), per choice index: chat sends one role delta first; content
chunks carry no finish_reason; then exactly one chunk with an empty delta and the
finish_reason. A usage chunk (choices: []) follows all finish chunks when
stream_options.include_usage is set, and `data: [DONE]` ends the stream exactly once.
Streamed deltas joined per index equal the non-streaming text byte for byte, because both
come from the same RequestTracker updates.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from pydantic import BaseModel

from radixserve.engine.runner_api import TokenLogprob
from radixserve.errors import RadixServeError
from radixserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatMessageOut, ChatStreamChoice,
                                        CompletionChoice, CompletionChunk, CompletionLogprobs,
                                        CompletionRequest, CompletionResponse)
from radixserve.server.serving import (GenerationRun, ServingContext, chat_logprobs,
                                       completion_logprobs)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


@dataclass
class ChoiceResult:
    """One choice, accumulated from its updates."""

    prompt_index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


async def collect(run: GenerationRun) -> list[ChoiceResult]:
    """Run to completion; one ChoiceResult per choice index."""
    results = [ChoiceResult(prompt_index=i // run.n) for i in range(len(run.prompts) * run.n)]
    async for u in run.updates():
        r = results[u.index]
        r.text += u.text
        r.token_ids += u.token_ids
        r.logprobs += u.logprobs or []
        if u.finish_reason is not None:
            r.finish_reason, r.stop_reason = u.finish_reason, u.stop_reason
    return results


# ---- /v1/completions ------------------------------------------------------------------------
def _echo_logprobs(ctx: ServingContext, run: GenerationRun, prompt_index: int) -> CompletionLogprobs:
    ids = run.prompts[prompt_index].ids
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


async def completion_response(ctx: ServingContext, run: GenerationRun, req: CompletionRequest,
                              rid: str, created: int) -> CompletionResponse:
    choices = []
    for index, r in enumerate(await collect(run)):
        text, logprobs = r.text, None
        offset = 0
        if req.echo:
            prompt_text = run.prompt_text(r.prompt_index)
            text, offset = prompt_text + text, len(prompt_text)
            if req.logprobs is not None:
                logprobs = _echo_logprobs(ctx, run, r.prompt_index)
        if req.logprobs is not None:
            logprobs = _merge(logprobs, completion_logprobs(ctx, r.token_ids, r.logprobs, offset))
        choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=r.finish_reason, stop_reason=r.stop_reason))
    return CompletionResponse(id=rid, created=created, model=ctx.model_name, choices=choices,
                              usage=run.usage())


async def completion_chunks(ctx: ServingContext, run: GenerationRun, req: CompletionRequest,
                            rid: str, created: int) -> AsyncIterator[str]:
    """SSE events of a streaming /v1/completions request; closes the run when done or cancelled."""
    def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None,
              finish_reason: str | None = None, stop_reason: str | int | None = None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=finish_reason, stop_reason=stop_reason)
        return sse(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[choice]))

    want_logprobs = req.logprobs is not None
    offsets: dict[int, int] = {}
    try:
        async for u in run.updates():
            if u.index not in offsets:
                offsets[u.index] = 0
                if req.echo:
                    prompt_text = run.prompt_text(u.prompt_index)
                    lp = _echo_logprobs(ctx, run, u.prompt_index) if want_logprobs else None
                    yield chunk(u.index, prompt_text, lp)
                    offsets[u.index] = len(prompt_text)
            if u.text or (want_logprobs and u.token_ids):
                lp = None
                if want_logprobs:
                    lp = completion_logprobs(ctx, u.token_ids, u.logprobs or [], offsets[u.index])
                    offsets[u.index] += sum(len(t) for t in lp.tokens)
                yield chunk(u.index, u.text, lp)
            if u.finish_reason is not None:
                yield chunk(u.index, "", None, u.finish_reason, u.stop_reason)
        if req.include_usage:
            yield sse(CompletionChunk(id=rid, created=created, model=ctx.model_name, choices=[],
                                      usage=run.usage()))
    except Exception as exc:
        yield _error_event(exc)
    finally:
        run.close()
    yield DONE


# ---- /v1/chat/completions -------------------------------------------------------------------
async def chat_response(ctx: ServingContext, run: GenerationRun, req: ChatCompletionRequest,
                        rid: str, created: int) -> ChatCompletionResponse:
    choices = []
    for index, r in enumerate(await collect(run)):
        logprobs = chat_logprobs(ctx, r.logprobs) if req.logprobs else None
        choices.append(ChatChoice(index=index, message=ChatMessageOut(content=r.text),
                                  logprobs=logprobs, finish_reason=r.finish_reason,
                                  stop_reason=r.stop_reason))
    return ChatCompletionResponse(id=rid, created=created, model=ctx.model_name, choices=choices,
                                  usage=run.usage())


async def chat_chunks(ctx: ServingContext, run: GenerationRun, req: ChatCompletionRequest,
                      rid: str, created: int) -> AsyncIterator[str]:
    """SSE events of a streaming /v1/chat/completions request; closes the run when done."""
    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                       choices=[choice]))

    try:
        for index in range(run.n):
            yield chunk(ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""}))
        async for u in run.updates():
            if u.text or (req.logprobs and u.logprobs):
                lp = chat_logprobs(ctx, u.logprobs or []) if req.logprobs else None
                yield chunk(ChatStreamChoice(index=u.index, delta={"content": u.text}, logprobs=lp))
            if u.finish_reason is not None:
                yield chunk(ChatStreamChoice(index=u.index, delta={}, finish_reason=u.finish_reason))
        if req.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                          choices=[], usage=run.usage()))
    except Exception as exc:
        yield _error_event(exc)
    finally:
        run.close()
    yield DONE


def _error_event(exc: Exception) -> str:
    """An error after the 200 went out (engine died mid-stream): the only way left to say so."""
    if isinstance(exc, RadixServeError):
        body = exc.to_dict()
    else:
        logger.exception("streaming failed")
        body = {"error": {"message": "internal server error", "type": "internal_error",
                          "param": None, "code": 500}}
    return f"data: {json.dumps(body)}\n\n"
