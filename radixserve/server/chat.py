"""POST /v1/chat/completions: template, tools, reasoning planned; a GenerationRun; the answer (collected, or SSE: per
choice a role delta, content deltas, an empty finish_reason delta; joined: the collected message byte for byte)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.errors import InvalidRequest
from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import MAX_TOP_LOGPROBS
from radixserve.server.chat_tools import ChatOutputs, plan_tools, prompt_tail
from radixserve.server.native_tools import native_calls_tag
from radixserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob,
                                        TopLogprob, new_id)
from radixserve.server.resume import resumed_params
from radixserve.server.serving import (DONE, LONG_TEXT_CHARS, GenerationRun, ServingContext, error_event,
                                       parse_body, respond, sse)


def add_chat_route(v1: APIRouter, ctx: ServingContext) -> None:
    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, ctx.max_body_bytes)
        run, outputs = await chat_run(ctx, req)
        return await respond(request, run, req, functools.partial(chat_response, outputs=outputs),
                             functools.partial(chat_chunks, outputs=outputs))

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
    # A JSON grammar (response_format, enforced calls) holds from the first token, so nothing is thinking: a prompt
    # that opens <think> (GLM-4.7/5) would otherwise turn the whole JSON reply into reasoning_content.
    reasoning = ctx.reasoning_parser is not None and params.json_schema is None
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

def chat_logprobs(ctx: ServingContext, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in entries:
        text = ctx.token_text(lp.token_id)
        top = [TopLogprob(token=ctx.token_text(t), logprob=v,
                          bytes=list(ctx.token_text(t).encode())) for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)

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
                yield chunk(ChatStreamChoice(index=index, delta={}, finish_reason=reason,
                                             stop_reason=u.stop_reason))
        if req.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                          choices=[], usage=run.usage(run.reasoning_tokens(outputs))))
    except Exception as exc:
        yield error_event(exc)
    finally:
        run.close()
    yield DONE
