"""RequestTracker: fans a request out into n engine children and turns EngineOutputs into choice updates."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from radixserve.errors import InvalidRequest
from radixserve.outputs import (CompletionOutput, EngineOutput, RequestOutput, SpecCounts,
                                TokenLogprob)
from radixserve.sampling_params import SamplingParams
from radixserve.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceUpdate:
    """What one EngineOutput changed for one choice (ignore it if `is_empty`): the tokens kept (none
    after a stop string); finish_reason on the ending update; `abort_child` the caller must abort."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    abort_child: str | None = None
    error: str | None = None
    spec: SpecCounts | None = None
    confidences: list[float] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


@dataclass(slots=True)
class _Choice:

    child_id: str
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_cached_tokens_host: int | None = None
    spec: SpecCounts | None = None


class RequestTracker:
    """n choices: submit `child_requests()`, feed their outputs to `process()` until `finished`; stop
    strings are matched here; `result()` is the updates' sum. InvalidRequest for an n out of range."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, prompt: str | None = None):
        params.check_n()
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt = prompt
        self.params = params
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._choices = [
            _Choice(child_id=f"{request_id}-{i}",
                    detok=IncrementalDetokenizer(tokenizer, params.skip_special_tokens),
                    stops=StopStringMatcher(params.stop, params.include_stop_str_in_output))
            for i in range(params.n)]
        self._index = {c.child_id: i for i, c in enumerate(self._choices)}

    def child_requests(self) -> list[tuple[str, SamplingParams]]:
        """(f"{request_id}-{i}", params with n=1 and seed + i) per choice."""
        out = []
        for i, choice in enumerate(self._choices):
            seed = None if self.params.seed is None else self.params.seed + i
            out.append((choice.child_id, dataclasses.replace(self.params, n=1, seed=seed)))
        return out

    def process(self, out: EngineOutput) -> ChoiceUpdate:
        """Fold one engine output into its choice; KeyError for a foreign id. Tokens after the one
        completing a stop string are dropped; the ending stop token is kept but not decoded."""
        index = self._index.get(out.request_id)
        if index is None:
            raise KeyError(f"{out.request_id!r} is not a child of request {self.request_id!r}")
        choice = self._choices[index]
        update = ChoiceUpdate(index=index)
        if choice.finish_reason is not None:
            return update  # late output for a finished choice
        if index == 0:
            choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
            choice.num_cached_tokens_host = out.num_cached_tokens_host
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.spec is not None:
            choice.spec = update.spec = out.spec

        ids = list(out.new_token_ids)
        num_text_ids = len(ids)
        if out.finished and out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id:
            num_text_ids -= 1
        parts: list[str] = []
        num_kept = len(ids)
        for k in range(num_text_ids):
            check = choice.stops.feed(choice.detok.add(ids[k:k + 1]))
            parts.append(check.text)
            if check.matched is not None:
                num_kept = k + 1
                self._finish(choice, update, "stop", check.matched)
                if not out.finished:
                    update.abort_child = choice.child_id
                break
        if choice.finish_reason is None and out.finished:
            check = choice.stops.feed(choice.detok.finish())
            parts.append(check.text)
            if check.matched is not None:
                self._finish(choice, update, "stop", check.matched)
            else:
                parts.append(choice.stops.flush())
                reason = out.finish_reason or "stop"
                asked = reason == "stop" and out.stop_token_id in self.params.stop_token_ids
                self._finish(choice, update, reason, out.stop_token_id if asked else None)   # EOS: None, as vLLM
                update.error = out.error

        update.text = "".join(parts)
        update.token_ids = ids[:num_kept]
        choice.text_parts.append(update.text)
        choice.token_ids.extend(update.token_ids)
        if self.params.logprobs is not None:
            update.logprobs = list(out.new_logprobs or [])[:num_kept]
            choice.logprobs.extend(update.logprobs)
        if self.params.guard_confidence:
            update.confidences = [lp.top_logprob for lp in (out.new_logprobs or [])[:num_kept]]
        return update

    def resume(self, token_ids: list[int]) -> str:
        """Continue choice 0 after tokens another worker delivered, as if made here; returns their
        text. InvalidRequest (400) when they already end with a stop string."""
        choice = self._choices[0]
        parts = []
        for tid in token_ids:
            check = choice.stops.feed(choice.detok.add([tid]))
            if check.matched is not None:
                raise InvalidRequest("resume_token_ids already end with a stop string",
                                     param="resume_token_ids")
            parts.append(check.text)
        text = "".join(parts)
        choice.text_parts.append(text)
        choice.token_ids.extend(token_ids)
        return text

    @staticmethod
    def _finish(choice: _Choice, update: ChoiceUpdate, reason: str, stop_reason: str | int | None) -> None:
        choice.finish_reason = update.finish_reason = reason
        choice.stop_reason = update.stop_reason = stop_reason

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def prompt_tokens(self) -> int:
        """Counted once whatever n is."""
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self._choices)

    @property
    def cached_tokens(self) -> int:
        """From choice 0 only (<= prompt_tokens)."""
        return min(self._choices[0].num_cached_tokens, self.prompt_tokens)

    @property
    def cached_tokens_host(self) -> int | None:
        host = self._choices[0].num_cached_tokens_host
        return None if host is None else min(host, self.cached_tokens)

    @property
    def spec(self) -> SpecCounts | None:
        counts = [c.spec for c in self._choices if c.spec is not None]
        return sum(counts[1:], counts[0]) if counts else None

    def result(self) -> RequestOutput:
        want_logprobs = self.params.logprobs is not None
        outputs = [CompletionOutput(index=i, text="".join(c.text_parts), token_ids=list(c.token_ids),
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    logprobs=list(c.logprobs) if want_logprobs else None)
                   for i, c in enumerate(self._choices)]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_ids), outputs=outputs,
                             num_cached_tokens=self.cached_tokens, prompt_logprobs=self.prompt_logprobs,
                             finished=self.finished, spec=self.spec,
                             num_cached_tokens_host=self.cached_tokens_host)
