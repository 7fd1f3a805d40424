"""What serves one request: the worker's ServingContext, a GenerationRun (engine requests, output filters, usage),
and its delivery (`respond`: collected JSON or an SSE stream that closes the run)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from radixserve.engine.messages import AddReq, PDTarget
from radixserve.errors import (ContextLengthExceeded, InvalidRequest, ModelNotFound, OutputAnomaly,
                               Overloaded, RadixServeError, error_body)
from radixserve.http_common import (ClosingStreamingResponse, check_json_content_type, race_disconnect,
                                    read_body)
from radixserve.outputs import KV_CHECKSUM_ERROR, EngineOutput, RequestOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams
from radixserve.server.engine_client import EngineClient, RequestStream
from radixserve.server.filters import Detection, OutputFilter, Reporter
from radixserve.server.anomaly import GuardSettings
from radixserve.server.metrics import RunTimers, ServerMetrics
from radixserve.server.pd import pd_target, with_rooms
from radixserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                        PromptTokensDetails, Usage, now_s)
from radixserve.server.tracker import ChoiceUpdate, RequestTracker
from radixserve.server.validation import validation_error

if TYPE_CHECKING:
    from radixserve.chaos.http_faults import FaultInjector
    from radixserve.server.chat_tools import ChatOutputs

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
LONG_TEXT_CHARS = 32_768    # longer texts are tokenized in a worker thread
Req = TypeVar("Req", bound=BaseModel)
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


@dataclass
class ServingContext:
    """What every route needs; a None guard, faults or parser turns that feature off."""

    client: EngineClient
    tokenizer: Any
    model_name: str
    model_path: str
    max_open_requests: int
    metrics: ServerMetrics | None = None
    guard: GuardSettings | None = None
    faults: FaultInjector | None = None
    tool_call_parser: str | None = None
    tool_call_constraint: str = "json"
    reasoning_parser: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    runs: dict[str, GenerationRun] = field(default_factory=dict)   # response id -> open run
    # new per process: a router that sees it change knows the worker restarted
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def max_context_len(self) -> int:
        assert self.client.info is not None, "engine client is not started"
        return self.client.info.max_context_len

    def check_model(self, model: str | None) -> None:
        if model and model not in (self.model_name, self.model_path):
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model")

    def check_capacity(self) -> None:
        if self.client.num_open_requests >= self.max_open_requests:
            raise Overloaded("The server is overloaded: too many requests in flight; retry later.")

    def filters_for(self, params: SamplingParams,
                    report: Reporter | None = None) -> tuple[list[OutputFilter], SamplingParams]:
        """Filters in order (corrupt fault, anomaly guard), `params` as they need; `report`: report-only detections."""
        filters: list[OutputFilter] = []
        corrupter = self.faults.corrupter() if self.faults is not None else None
        if corrupter is not None:
            filters.append(corrupter)
        if self.guard is not None:
            guard, params = self.guard.filter_for(params, report)
            filters.append(guard)
        return filters, params

    def pd_target(self, req: CompletionRequest | ChatCompletionRequest) -> PDTarget | None:
        """None on a colocated worker, which refuses bootstrap fields (InvalidRequest)."""
        mode = self.client.info.disaggregation_mode
        if mode != "null":
            return pd_target(mode, req)
        if any(f is not None for f in (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)):
            raise InvalidRequest("bootstrap_host / bootstrap_port / bootstrap_room are for workers "
                                 "started with --disaggregation-mode prefill|decode",
                                 param="bootstrap_room")
        return None

    def check_text_fits(self, texts: list[str], param: str) -> None:
        """ContextLengthExceeded (400) when `texts` need the whole context by the bytes bound
        (tokenizer/text_bound.py), checked before tokenizing; no-op without a bound."""
        bound = getattr(self.tokenizer, "text_bound", None)
        if bound is None:
            return
        # A character is at most 4 UTF-8 bytes, so a text takes at most ceil(4 * len / bytes_per_token)
        # of the bound's tokens: below the context by that, the bound cannot refuse; skip encoding.
        per_token = bound.bytes_per_token
        if sum(4 * len(t) + per_token - 1 for t in texts) < per_token * self.max_context_len:
            return
        at_least = sum(bound.min_tokens(t) for t in texts)
        if at_least >= self.max_context_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_context_len} tokens. However, "
                f"your {param} takes at least {at_least} tokens by its size in bytes (no token "
                f"covers more than {bound.bytes_per_token}). Please reduce its length.",
                param=param)

    async def encode(self, text: str) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


class GenerationRun:
    """One HTTP request's engine requests (n per prompt) as one group; exiting aborts the unfinished.
    Choice j of prompt i has index i * n + j; `resume_ids` follow the prompt (server/resume.py)."""

    def __init__(self, ctx: ServingContext, base_id: str, prompt_ids: list[list[int]],
                 params: SamplingParams, resume_ids: list[int] | None = None,
                 pd: PDTarget | None = None):
        self.ctx = ctx
        self.base_id = base_id
        self.prompt_ids = prompt_ids
        self.n = params.n
        self.filters, params = ctx.filters_for(params, self._report)
        self.trackers = [RequestTracker(f"{base_id}-{i}", ids, params, ctx.tokenizer)
                         for i, ids in enumerate(prompt_ids)]
        self.resume_ids = list(resume_ids or ())
        self.resumed_text = ""
        self._owner: dict[str, int] = {}
        adds: list[AddReq] = []
        for i, (ids, tracker) in enumerate(zip(prompt_ids, self.trackers)):
            for child_id, child_params in tracker.child_requests():
                self._owner[child_id] = i
                adds.append(AddReq(child_id, ids + self.resume_ids, child_params))
        self._adds = adds if pd is None else with_rooms(adds, pd)
        self.stream: RequestStream | None = None
        self._timers = RunTimers(None, [])

    async def __aenter__(self) -> GenerationRun:
        """Submit and wait for acceptance (raises the rejection); listed in `ctx.runs` while open."""
        try:
            self.stream = self.ctx.client.submit(self._adds)
            self.ctx.runs[self.base_id] = self
            self._timers = RunTimers(self.ctx.metrics, [a.request_id for a in self._adds])
            await self.stream.accepted()
            if self.resume_ids:
                self.resumed_text = self.trackers[0].resume(self.resume_ids)
        except BaseException:
            self._timers.discard()
            self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Abort whatever has not finished; idempotent."""
        if self.ctx.runs.get(self.base_id) is self:
            del self.ctx.runs[self.base_id]
        self._timers.close()
        if self.stream is not None:
            self.stream.close()

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort_all()

    async def updates(self) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
        """(choice index, update) for each non-empty update after the filters, until all finish."""
        assert self.stream is not None, "use `async with run:` first"
        while self.stream.unfinished:
            out = await self.stream.get()
            self._timers.on_output(out)
            prompt_index = self._owner[out.request_id]
            u = self.trackers[prompt_index].process(out)
            if u.abort_child is not None:
                self.stream.abort(u.abort_child)
            index = prompt_index * self.n + u.index
            detection = self._check(index, u, out)
            if detection is not None:
                yield index, ChoiceUpdate(u.index, finish_reason="abort")
                raise self._anomaly(index, detection)
            if not u.is_empty:
                yield index, u

    def _check(self, index: int, u: ChoiceUpdate, out: EngineOutput) -> Detection | None:
        """A KV checksum error or a filter's detection (filters may rewrite `u.text`)."""
        if out.error_code == KV_CHECKSUM_ERROR:
            return Detection("kv_checksum", out.error or "")
        if not u.is_empty:
            for output_filter in self.filters:
                detection = output_filter.feed(index, u)
                if detection is not None:
                    return detection
        return None

    async def results(self) -> list[RequestOutput]:
        """One RequestOutput per prompt; each text is the filtered updates joined, as a stream sends it."""
        texts: dict[int, list[str]] = {0: [self.resumed_text]}
        async for index, u in self.updates():
            texts.setdefault(index, []).append(u.text)
        results = [t.result() for t in self.trackers]
        for prompt_index, result in enumerate(results):
            for c in result.outputs:
                c.text = "".join(texts.get(prompt_index * self.n + c.index, ()))
        return results

    def _report(self, index: int, detection: Detection) -> None:
        """A detection that does not stop the request: counted and logged."""
        kind, detail = detection
        if self.ctx.metrics is not None:
            self.ctx.metrics.count_detection(kind, "report")
        logger.warning("output anomaly (%s) in %s choice %d, reported only: %s", kind,
                       self.base_id, index, detail)

    def _anomaly(self, index: int, detection: Detection) -> OutputAnomaly:
        kind, detail = detection
        if self.ctx.metrics is not None:
            self.ctx.metrics.count_detection(kind, "abort")
        logger.warning("output anomaly (%s) in %s choice %d: %s", kind, self.base_id, index, detail)
        return OutputAnomaly(f"The output of choice {index} looked broken ({kind}: {detail}); "
                             "the request was stopped. Retrying it may succeed.", kind)

    def usage(self, reasoning_tokens: int | None = None) -> Usage:
        """Usage over every choice; `reasoning_tokens` goes to `completion_tokens_details`."""
        prompt = sum(t.prompt_tokens for t in self.trackers)
        completion = sum(t.completion_tokens for t in self.trackers)
        cached = sum(t.cached_tokens for t in self.trackers)
        hosts = [t.cached_tokens_host for t in self.trackers if t.cached_tokens_host is not None]
        details = PromptTokensDetails(cached_tokens=cached,
                                      **({"cached_tokens_host": sum(hosts)} if hosts else {}))
        counts = [t.spec for t in self.trackers if t.spec is not None]
        extra = sum(counts[1:], counts[0]).usage_fields() if counts else {}
        if reasoning_tokens is not None:
            extra["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=details, **extra)

    def reasoning_tokens(self, outputs: ChatOutputs) -> int | None:
        tracker = self.trackers[0]
        skip = tracker.params.skip_special_tokens
        return outputs.reasoning_tokens(
            [c.token_ids for c in tracker.result().outputs],
            lambda ids: self.ctx.tokenizer.decode(ids, skip_special_tokens=skip))

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprob | None]:
        """None for the first position."""
        lps = self.trackers[prompt_index].prompt_logprobs or []
        return [None, *lps]


DONE = "data: [DONE]\n\n"

def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"

async def parse_body(request: Request, model: type[Req], max_bytes: int = MAX_BODY_BYTES) -> Req:
    """`model` from a JSON body; InvalidRequest (400), or BodyTooLarge (413) over `max_bytes`."""
    check_json_content_type(request)
    body = await read_body(request, max_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None

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

def error_event(exc: Exception) -> str:
    """An error after the 200 went out, as an SSE event."""
    if isinstance(exc, RadixServeError):
        body = exc.to_dict()
    else:
        logger.exception("streaming failed")
        body = error_body("internal server error", "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"
